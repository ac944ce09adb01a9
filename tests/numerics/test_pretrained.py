"""Runner.load_pretrained: a `transformers` save_pretrained directory (safetensors, one file or
sharded with an index) loaded into a program under t = 2, p = 2 and ZeRO-3 (d = 2). After
loading, full_state_dict() equals the saved weights exactly, and training gives the losses and
weights of the single-device model loaded with from_pretrained. GPT-2 covers the fused q/k/v
(each tensor rank reads a slice of every block) and the tied wte / lm_head (saved once)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopar.runtime.pretrained import INDEX_FILE, SINGLE_FILE, weight_files
from autopar.testing import spawn

import models
from programs import MAX_NORM, adamw, make_data, make_plan, make_program, train_steps, with_zero
from reference import train, weight_mismatches

pytestmark = pytest.mark.distributed

NAME, LAYERS = "hf_gpt2", 2


def _pretrained() -> torch.nn.Module:
    """The "released" model: runtime_model's architecture, other weights (seed 11)."""
    torch.manual_seed(11)
    return models.hf_gpt2(layers=LAYERS, heads=2, use_cache=True)


def _save(directory: Path, sharded: bool) -> dict[str, torch.Tensor]:
    """Save the pretrained model; return what the files hold, by key."""
    from safetensors.torch import load_file

    model = _pretrained()
    model.save_pretrained(directory, **({"max_shard_size": "40KB"} if sharded else {}))
    files = set(weight_files(directory).values())
    assert (len(files) > 1) == sharded and (directory / INDEX_FILE).exists() == sharded
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update(load_file(str(f)))
    return saved


def _rank(rank: int, world: int, plan, directory: str):
    prog, vocab = make_program(NAME, plan)
    runner = prog.compile(optimizer=adamw, max_grad_norm=MAX_NORM, timeout_s=60)
    runner.load_pretrained(directory)
    loaded = runner.full_state_dict()
    losses = train_steps(runner, plan, make_data(plan, vocab))
    return loaded, losses, runner.full_state_dict()


PLANS = {
    "t2": lambda: make_plan(t=2, layers=LAYERS),
    "p2": lambda: make_plan(p=2, layers=LAYERS),
    "d2-zero3": lambda: with_zero(make_plan(d=2, layers=LAYERS), 3),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_load_pretrained_equals_the_saved_weights_and_trains_like_one_device(
        tmp_path, plan_name, sharded):
    if sharded and plan_name != "t2":
        pytest.skip("the sharded layout is read the same way under every plan; t=2 covers it")
    from transformers import GPT2LMHeadModel

    plan = PLANS[plan_name]()
    saved = _save(tmp_path, sharded)
    results = spawn(_rank, plan.gpus, plan, str(tmp_path), timeout_s=240)
    loaded, losses, final = results[0]
    reference = GPT2LMHeadModel.from_pretrained(tmp_path)
    want = reference.state_dict()
    assert list(loaded) == list(want)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    for key in loaded:                       # lm_head.weight: tied, saved once as wte
        assert torch.equal(loaded[key], want[key]), key
    fresh = models.runtime_model(NAME, LAYERS).state_dict()   # the program's own init
    assert not torch.equal(fresh["transformer.wte.weight"], loaded["transformer.wte.weight"])
    ref = train(reference, make_data(plan, models.RUNTIME_VOCAB), adamw,
                loss_fn=_loss, max_grad_norm=MAX_NORM)
    for r, (_, rank_losses, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(ref.losses),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r}: {m}")
    assert not weight_mismatches(final, ref.state, ref.init), \
        weight_mismatches(final, ref.state, ref.init)


def _loss(output, targets):
    from programs import loss_fn
    return loss_fn(output, targets)


def _mismatch_rank(rank: int, world: int, plan, directory: str):
    prog, _ = make_program(NAME, plan)
    runner = prog.compile(optimizer=adamw, timeout_s=60)
    try:
        runner.load_pretrained(directory)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_different_configuration_is_one_line_naming_key_shapes_and_fix(tmp_path):
    torch.manual_seed(0)
    models.hf_gpt2(layers=LAYERS, heads=2, hidden=16, use_cache=True).save_pretrained(tmp_path)
    plan = make_plan(t=2, layers=LAYERS)
    messages = spawn(_mismatch_rank, plan.gpus, plan, str(tmp_path), timeout_s=120)
    assert messages[0] == messages[1]          # every rank raises the same error
    msg = messages[0]
    assert msg is not None and "\n" not in msg
    assert "transformer.wte.weight" in msg and "(64, 16)" in msg and "(64, 32)" in msg
    assert "same configuration" in msg


def test_a_directory_without_safetensors_says_how_to_save_one(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=f"neither {SINGLE_FILE} nor {INDEX_FILE}.*"
                                         f"safe_serialization=True"):
        weight_files(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="not a safetensors index") as info:
        weight_files(tmp_path)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(ValueError, match="is not a directory"):
        weight_files(tmp_path / "nowhere")
