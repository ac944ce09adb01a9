"""Runner checkpoints: save under one plan, load under another (weights AND Adam state), and
training continues with the losses of an uninterrupted single-device run; full_state_dict()
loaded into the original model class reproduces the parallel model; a crash during save
leaves the previous checkpoint loadable; mismatched or unsafe checkpoints are refused."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from autopar.plan import Plan
from autopar.testing import spawn

import models
from reference import weight_mismatches
from programs import (BF16_LOSS_RTOL, BF16_WEIGHT_ATOL, loss_fn, make_data, make_plan,
                      make_program, train_single_device, train_steps, with_zero)

pytestmark = pytest.mark.distributed

STEPS = 3


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def reference(plan: Plan) -> tuple[list[float], list[dict]]:
    """Single-device losses and the state dicts of the uninterrupted run: [0] before the first
    step, [k + 1] after step k."""
    ref = train_single_device("gpt", plan, _adamw, keep_states=True)
    return ref.losses, [ref.init] + ref.states


def run_rank(rank, world, plan, path, *, load, start, stop, save, die_in_save=False):
    """Compile under `plan`, optionally load `path`, train steps [start, stop), optionally save."""
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=_adamw, timeout_s=20)
    loaded = runner.load_checkpoint(path) if load else None
    losses = train_steps(runner, plan, make_data(plan, vocab)[start:stop])
    if save:
        runner.save_checkpoint(path)
    state = runner.full_state_dict()
    if die_in_save:
        import autopar.runtime.checkpoint as ck
        original = os.replace

        def die_before_commit(src, dst):
            if Path(dst).name == ck.LAYOUT_FILE:
                os._exit(5)          # the data files are written, the layout and link are not
            original(src, dst)
        os.replace = die_before_commit
        try:
            runner.save_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - the surviving rank reports what it saw
            return "raised", type(exc).__name__, str(exc)
    return loaded, losses, state


@pytest.mark.slow
def _resume_and_compare(plan, path, ref_losses, ref_states, label):
    """Load the step-1 checkpoint at `path` under `plan` on 4 ranks, train to STEPS; assert
    every rank resumed at step 1 with the uninterrupted losses (Adam's m, v and step restored:
    otherwise step 2's loss would differ) and the final weights. Weights: atol 5e-5 — Adam
    divides by sqrt(v), so an element whose gradient is ~0 turns fp32 reduction-order noise
    into up to ~3% of one lr=1e-3 step (measured 3e-5 on 1 of 1024 elements); the losses are
    the tight check. Returns the ranks' results."""
    out = spawn(run_rank, 4, plan, path, load=True, start=1, stop=STEPS, save=False,
                timeout_s=400)
    for r, (step, losses, _) in enumerate(out):
        assert step == 1
        torch.testing.assert_close(losses, ref_losses[1:], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{label} rank {r}: {m}")
    assert not weight_mismatches(out[0][2], ref_states[-1], ref_states[0]), \
        weight_mismatches(out[0][2], ref_states[-1], ref_states[0])
    return out


def test_save_t2_p2_load_p4_and_d4_zero1_continues_like_uninterrupted(tmp_path):
    path = str(tmp_path / "ckpt")
    saver = make_plan(t=2, p=2, b=2, m=2, layers=4)             # global batch 4
    ref_losses, ref_states = reference(saver)
    res = spawn(run_rank, 4, saver, path, load=False, start=0, stop=1, save=True,
                timeout_s=400)
    torch.testing.assert_close(res[0][1], ref_losses[:1], rtol=1e-4, atol=1e-5)
    assert (tmp_path / "ckpt" / "plan.json").is_file()
    assert Plan.from_json((tmp_path / "ckpt" / "plan.json").read_text()) == saver

    # full_state_dict() in the original model class reproduces the parallel model: its loss
    # on the next batch is the loss the resumed parallel runs report for that step
    model, vocab = models.runtime_model("gpt", 4), models.RUNTIME_VOCAB
    model.load_state_dict(res[0][2])
    x, y = make_data(saver, vocab)[1]
    with torch.no_grad():
        single = loss_fn(model(x), y).item()

    for plan in (make_plan(p=4, b=1, m=4, layers=4),
                 with_zero(make_plan(d=4, b=1, m=1, layers=4), 1)):
        assert plan.global_batch_size == saver.global_batch_size
        out = _resume_and_compare(plan, path, ref_losses, ref_states,
                                  f"{plan.t, plan.p, plan.d}")
        assert abs(out[0][1][0] - single) < 1e-5


def test_sharded_weights_checkpoint_and_reshard_across_zero_levels(tmp_path):
    """Saved under ZeRO-3 with the interleaved schedule (weights, gradients and Adam state
    sharded per chunk over d), loaded under ZeRO-1 1F1B and under ZeRO-2 breadth-first (other
    shard layouts): training continues with the uninterrupted single-device losses."""
    path = str(tmp_path / "ckpt")
    saver = with_zero(make_plan(p=2, d=2, v=2, b=1, m=2, schedule="interleaved-1f1b",
                                layers=4), 3)                           # global batch 4
    ref_losses, ref_states = reference(saver)
    res = spawn(run_rank, 4, saver, path, load=False, start=0, stop=1, save=True,
                timeout_s=400)
    torch.testing.assert_close(res[0][1], ref_losses[:1], rtol=1e-4, atol=1e-5)
    for plan in (with_zero(make_plan(p=2, d=2, b=1, m=2, layers=4), 1),
                 with_zero(make_plan(p=2, d=2, v=2, b=1, m=2, schedule="breadth-first",
                                     layers=4), 2)):
        _resume_and_compare(plan, path, ref_losses, ref_states, f"zero={plan.zero}")


def _bf16_rank(rank, world, plan, path, *, load, start, stop, save):
    """run_rank under bf16: (loaded step, full_state_dict right after loading, losses, final
    full_state_dict)."""
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=_adamw, timeout_s=60, precision="bf16")
    loaded = runner.load_checkpoint(path) if load else None
    at_load = runner.full_state_dict()
    losses = train_steps(runner, plan, make_data(plan, vocab)[start:stop])
    if save:
        runner.save_checkpoint(path)
    return loaded, at_load, losses, runner.full_state_dict()


def test_bf16_zero3_checkpoint_holds_the_fp32_masters(tmp_path):
    """Saved under ZeRO-3 in bf16 (d = 2): the checkpoint holds the fp32 master shards, not
    their bf16 rounding — loaded under ZeRO-3 and under ZeRO-0 (bf16), full_state_dict
    returns them bit for bit — and training continues with the uninterrupted single-device
    bf16 losses and weights (the bf16 tolerances of tests/programs.py)."""
    path = str(tmp_path / "ckpt")
    saver = with_zero(make_plan(d=2, b=1, m=2), 3)                  # global batch 4
    ref = train_single_device("gpt", saver, _adamw, precision="bf16", keep_states=True)
    res = spawn(_bf16_rank, 2, saver, path, load=False, start=0, stop=1, save=True,
                timeout_s=300)
    torch.testing.assert_close(res[0][2], ref.losses[:1], rtol=BF16_LOSS_RTOL, atol=0.0)
    saved = res[0][3]
    assert all(w.dtype == torch.float32 for w in saved.values())
    assert any(not torch.equal(w, w.to(torch.bfloat16).float()) for w in saved.values())
    for plan in (saver, make_plan(d=2, b=1, m=2)):
        out = spawn(_bf16_rank, 2, plan, path, load=True, start=1, stop=STEPS, save=False,
                    timeout_s=300)
        loaded, at_load, losses, final = out[0]
        assert loaded == 1
        assert list(at_load) == list(saved)
        assert all(torch.equal(at_load[k], saved[k]) for k in saved), f"zero={plan.zero}"
        for r, res_r in enumerate(out):
            torch.testing.assert_close(res_r[2], ref.losses[1:], rtol=BF16_LOSS_RTOL,
                                       atol=0.0, msg=lambda m: f"zero={plan.zero} rank {r}: {m}")
        for key, want in ref.states[-1].items():
            torch.testing.assert_close(final[key].float(), want.float(), rtol=0,
                                       atol=BF16_WEIGHT_ATOL)


def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "ckpt")
    plan = with_zero(make_plan(p=2, d=1, b=1, m=2, layers=2), 1)
    res = spawn(run_rank, 2, plan, path, load=False, start=0, stop=1, save=True,
                die_in_save=True, timeout_s=200, pg_timeout_s=15, allow_exit=[0])
    assert res[0] is None                         # rank 0 died while committing the save
    kind, exc_type, message = res[1]
    assert kind == "raised" and exc_type == "PeerError" and "rank 0" in message, message
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert any(".tmp-" in n for n in leftovers), leftovers   # the half-written second save
    # The link still points at the complete first save (step 1), which loads and resumes
    ref_losses, ref_states = reference(plan)
    out = spawn(run_rank, 2, plan, path, load=True, start=1, stop=2, save=True, timeout_s=200)
    assert out[0][0] == 1
    torch.testing.assert_close(out[0][1], ref_losses[1:2], rtol=1e-4, atol=1e-5)
    assert not weight_mismatches(out[0][2], ref_states[2], ref_states[0]), \
        weight_mismatches(out[0][2], ref_states[2], ref_states[0])
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())  # the next save cleaned up


def _refusals_rank(rank, world, path):
    import autopar
    plan = make_plan(layers=2)
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=_adamw, timeout_s=20)
    x, y = make_data(plan, vocab)[0]
    runner.train_step(x, y)
    runner.save_checkpoint(path)
    messages = {}
    ex = torch.zeros(plan.micro_batch_size, 8, dtype=torch.long)
    others = {
        "wider": models.gpt(heads=2, hidden=48),
        "llama": models.runtime_model("llama_style", 2),
    }
    for label, model in others.items():
        other = autopar.api.ParallelProgram(model=model, plan=plan, profile=None,
                                            example_inputs=(ex,), loss_fn=loss_fn,
                                            example_targets=ex, cluster=None)
        try:
            other.compile(timeout_s=20).load_checkpoint(path)
        except ValueError as exc:
            messages[label] = str(exc)
    # an unsafe pickle in DCP's metadata file is refused, never executed
    target = Path(path).resolve() / ".metadata"
    evil = pickle.dumps(_Evil())
    # padded to the original's size (a pickle ends at its STOP opcode), so the size check
    # passes and the checksum is what refuses it
    target.write_bytes(evil + b"\0" * max(0, target.stat().st_size - len(evil)))
    try:
        runner.load_checkpoint(path)
    except ValueError as exc:
        messages["pickle"] = str(exc)
    return messages


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/autopar-pwned-by-checkpoint",))


def test_mismatched_and_unsafe_checkpoints_are_refused(tmp_path):
    if os.path.exists("/tmp/autopar-pwned-by-checkpoint"):
        os.remove("/tmp/autopar-pwned-by-checkpoint")
    (messages,) = spawn(_refusals_rank, 1, str(tmp_path / "ckpt"), timeout_s=200)
    wider = messages["wider"]
    assert "shape mismatch" in wider and "transformer.wpe.weight (checkpoint (16, 32), " \
        "model (16, 48))" in wider, wider
    llama = messages["llama"]
    assert "missing from the checkpoint" in llama and "in the checkpoint but not in the " \
        "model" in llama and "transformer.h.0.attn.c_attn.weight" in llama, llama
    # the layout's checksum refuses the replaced file before anything reads it (the
    # restricted unpickler behind it: test_checkpoint.py's single-process test)
    assert ".metadata has CRC-32" in messages["pickle"] and "corrupt" in messages["pickle"]
    assert not os.path.exists("/tmp/autopar-pwned-by-checkpoint")
