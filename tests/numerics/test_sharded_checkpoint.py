"""Sharded checkpoints (issue 27): every rank writes only what it holds, in about the same
bytes, without gathering — and what they wrote loads bit for bit under another plan.

One spawn of 4 ranks per layout group; inside it each plan compiles, trains a step and saves:
- d = 4 under ZeRO-1, ZeRO-2 and ZeRO-3 (a GPT wide enough that its shard state, ~10 MB a
  rank, stands well above the noise of the resident-memory reading): each rank's .distcp
  bytes within 1.5× of the mean, and its peak resident memory during a save (the second: the
  first also creates the checkpoint's gloo group, a fixed few MB) grows by less than half its
  shard state (before: the ZeRO regimes all-gathered the whole state, d× it);
- t = 2 × d = 2 (ZeRO-1) and p = 2 × d = 2 (ZeRO-3, the tied embedding on both stages): the
  same balance; p = 4 (ZeRO-0) with one block called at every depth (every stage holds a
  copy): each stage writes a quarter of it and every stage reads its copy back; that save is
  asynchronous (its packs are slices of the staged buffer; the synchronous saves' are the
  pieces written one after another: every save's pieces lie in a few raw byte packs a rank,
  read by range);
then one rank under ZeRO-0 loads the ZeRO-3 checkpoint, and the p = 4 shared-block one:
weights and Adam state equal the saved ones bit for bit (and a checkpoint in the form written before sharded saves loads back into its
shards bit for bit); every load (straight into the shards) restores the rank's state bit for
bit with its largest temporary ≤ 1/4 of the shard state, and at d = 4 its resident growth
< 1/2 of it (the load it replaced built the unsharded local state: 2 – 4× it); and a
Mixtral saved at d = 2 ep = 2 ZeRO-1 loads on one rank (ep = 1) bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from autopar.api import ParallelProgram
from autopar.runtime.checkpoint import close_writer
from autopar.runtime.ckpt_load import last_load_stats
from autopar.testing import spawn

import models
from programs import SEQ, adamw, loss_fn, make_data, make_plan, train_steps, with_zero

pytestmark = [pytest.mark.distributed]

WIDE = dict(vocab=64, seq=SEQ, layers=2, heads=4, hidden=384)   # 3.6 M parameters


def _program(plan, wide):
    """wide: True (the WIDE GPT), False (the tiny GPT), "shared_block" (one block called at
    every depth: at p > 2 every stage holds a copy) or "shared_subset" (the same model cut so
    that stage 0 holds the embedding alone: stages 1..p-1 hold the block)."""
    model = (models.shared_block(seq=SEQ, layers=plan.num_layers) if _shared(wide)
             else models.gpt(**WIDE) if wide else models.gpt(seq=SEQ))
    ex = torch.zeros(plan.micro_batch_size, SEQ, dtype=torch.long)
    return ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(ex,),
                           loss_fn=loss_fn, example_targets=ex, cluster=None)


def _shared(wide) -> bool:
    return wide in ("shared_block", "shared_subset")


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _save_rank(rank, world, plans, tmp):
    torch.set_num_threads(1)
    out = []
    for plan, wide in plans:
        runner = _program(plan, wide).compile(optimizer=adamw, timeout_s=60)
        train_steps(runner, plan, make_data(plan, 64)[:1])
        held = sum(t.numel() * t.element_size() for h in runner.regime.shard_state()
                   for t in h.tensors.values())
        tag = "s" if wide == "shared_subset" else ""
        path = Path(tmp) / f"t{plan.t}p{plan.p}d{plan.d}z{plan.zero}{tag}"
        if wide is True:    # the rows whose memory is asserted: the first save creates the
            runner.save_checkpoint(path)    # checkpoint group (a fixed cost), measure the second
        Path("/proc/self/clear_refs").write_text("5")      # reset the peak resident size
        before_kb = _rss_kb("VmRSS")
        runner.save_checkpoint(path, async_save=_shared(wide))   # packs (below)
        runner.wait_for_checkpoint()
        grew_kb = _rss_kb("VmHWM") - before_kb
        written = sum(f.stat().st_size for f in path.resolve().glob(f"__{rank}_*.distcp"))
        saved = (runner.full_state_dict(), runner.regime.optimizer_state()) \
            if (plan.zero == 3 and plan.d == 4) or _shared(wide) else None
        layout = json.loads((path / "autopar_layout.json").read_text())
        packed = all(isinstance(p[0], list) and p[1].startswith("pack/")
                     for e in layout["tensors"].values() for p in e["pieces"])
        out.append(dict(plan=str(path.name), held=held, grew=grew_kb * 1024, written=written,
                        packed=packed,
                        saved=saved if rank == 0 or _shared(wide) else None,
                        **_reload(runner, path)))
    close_writer()                       # the shared-block save's writer process
    return out


def _reload(runner, path):
    """Load `path` back into a runner whose held state was overwritten with NaN: the load
    restores it bit for bit, its counted temporaries (ckpt_load.LoadStats) and its peak
    resident growth."""
    before = [{k: t.clone() for k, t in h.tensors.items()} for h in runner.regime.shard_state()]
    for h in runner.regime.shard_state():
        for t in h.tensors.values():
            t.fill_(float("nan"))
    Path("/proc/self/clear_refs").write_text("5")
    before_kb = _rss_kb("VmRSS")
    runner.load_checkpoint(path)
    load_grew = (_rss_kb("VmHWM") - before_kb) * 1024
    after = [dict(h.tensors) for h in runner.regime.shard_state()]
    same = len(before) == len(after) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(before, after))
    stats = last_load_stats()
    return dict(restored=same, load_grew=load_grew, load_peak=stats.peak_bytes,
                load_whole=stats.whole_items)


def _balanced(results):
    for k in range(len(results[0])):
        written = [r[k]["written"] for r in results]
        mean = sum(written) / len(written)
        assert min(written) > 0 and max(written) <= 1.5 * mean, (results[0][k]["plan"], written)


def _load_rank(rank, world, path, shared_paths):
    """ZeRO-0 on one rank loads `path`; then a checkpoint in the form written before sharded
    saves (the gathered save: tensor-split [start, stop, key] pieces) loads back into the
    shards bit for bit. Returns (weights, optimizer state, the old form restored, and the
    shared-block model's weights and optimizer state loaded from each of `shared_paths`)."""
    shared = []
    for shared_path in shared_paths:
        one = _program(make_plan(layers=4), "shared_block").compile(optimizer=adamw,
                                                                   timeout_s=60)
        one.load_checkpoint(shared_path)
        shared.append((one.full_state_dict(), one.regime.optimizer_state()))
    plan = make_plan(d=1)
    runner = _program(plan, True).compile(optimizer=adamw, timeout_s=60)
    runner.load_checkpoint(path)
    out = runner.full_state_dict(), runner.regime.optimizer_state()
    runner.regime.shard_state = lambda: None
    runner.save_checkpoint(f"{path}-old-form")
    del runner.regime.shard_state
    layout = json.loads((Path(f"{path}-old-form") / "autopar_layout.json").read_text())
    old_form = all(len(p) == 3 and not isinstance(p[0], list)
                   for e in layout["tensors"].values() for p in e["pieces"])
    return out + (old_form and _reload(runner, f"{path}-old-form")["restored"], shared)


def test_zero_levels_and_layouts_write_evenly_in_bounded_memory_and_load_on_one_rank(tmp_path):
    plans = [(with_zero(make_plan(d=4, m=1, b=1), z), True) for z in (1, 2, 3)]
    plans += [(with_zero(make_plan(t=2, d=2, m=1, b=1), 1), False),
              (with_zero(make_plan(p=2, d=2, m=2, b=1), 3), False),
              (make_plan(p=4, m=4, b=1, layers=4), "shared_block"),
              (make_plan(p=4, m=4, b=1, layers=4, split=[0, 2, 1, 1]), "shared_subset")]
    results = spawn(_save_rank, 4, plans, str(tmp_path), timeout_s=500)
    _balanced(results)
    assert all(r["packed"] for r in results[0])          # sync and async saves: raw packs
    for rank, rows in enumerate(results):
        for row in rows:
            assert row["restored"] and row["load_whole"] == 0, (rank, row["plan"])
        for row in rows[:3]:    # the wide model's d = 4 saves and loads
            assert row["grew"] < row["held"] / 2, (rank, row["plan"], row["grew"], row["held"])
            assert row["load_peak"] <= row["held"] / 4, (rank, row["plan"], row["load_peak"])
            assert row["load_grew"] < row["held"] / 2, (rank, row["plan"], row["load_grew"],
                                                        row["held"])
    weights, state = results[0][2]["saved"]
    (got_weights, got_state, old_form_restored, shared), = spawn(
        _load_rank, 1, str(tmp_path / "t1p1d4z3"),
        [str(tmp_path / "t1p4d1z0"), str(tmp_path / "t1p4d1z0s")], timeout_s=200)
    assert old_form_restored
    _same_as_every_stage(shared[0], [rows[-2]["saved"] for rows in results])
    # stage 0 holds the embedding alone: stages 1-3 hold the block ("stages:1,2,3"), the
    # first of them writes what a lone copy would (checkpoint._writes: first_holder)
    _same_as_every_stage(shared[1], [rows[-1]["saved"] for rows in results], holders=(1, 2, 3))
    assert list(got_weights) == list(weights)
    for key, value in weights.items():
        assert torch.equal(got_weights[key], value), key
    assert sorted(got_state) == sorted(state)
    for key, st in state.items():
        for name, value in st.items():
            assert torch.equal(got_state[key][name], value), (key, name)


def _same_as_every_stage(loaded, saved, holders=(0, 1, 2, 3)):
    """The one-rank load of the p = 4 shared-block checkpoint equals every stage's weights
    and Adam state bit for bit (the block's on all four stages: each stage wrote a quarter
    of it, each stage's own copy read all of it back)."""
    weights, state = loaded
    assert sorted(weights) == sorted(saved[0][0])
    for key, value in weights.items():
        assert torch.equal(saved[0][0][key], value), key
    block = [k for k in state if k.startswith("block.")]
    assert block and all(set(block) <= set(saved[s][1]) for s in holders), block
    assert not any(set(block) & set(st) for s, (_, st) in enumerate(saved) if s not in holders)
    for stage, (_, st) in enumerate(saved):
        for key, names in st.items():
            for name, value in names.items():
                assert torch.equal(state[key][name], value), (stage, key, name)


def _ep_rank(rank, world, plan, path, save):
    torch.set_num_threads(1)
    batches = models.token_batches(64, (plan.global_batch_size, SEQ), 1, seed=1234)
    x = batches[0][0][:plan.micro_batch_size]
    prog = ParallelProgram(model=models.build("hf_mixtral", seed=0), plan=plan, profile=None,
                           example_inputs=(x,), loss_fn=loss_fn, example_targets=x,
                           cluster=None)
    runner = prog.compile(optimizer=adamw, timeout_s=60)
    if save:
        train_steps(runner, plan, batches)
        runner.save_checkpoint(path)
    else:
        runner.load_checkpoint(path)
    infos, ostate = runner.params.infos, runner.regime.optimizer_state()
    state = {infos[q].key: (infos[q].start if infos[q].expert else None,
                            ostate.get(infos[q].key, {})) for q in runner.params.tensors}
    return runner.full_state_dict(), state


def test_ep2_zero1_checkpoint_loads_at_ep1_bit_for_bit(tmp_path):
    """Saved at d = 2 ep = 2 under ZeRO-1 (each rank writes its experts' shard pieces), loaded
    on one rank (every expert whole): weights and Adam state equal, bit for bit."""
    path = str(tmp_path / "ckpt")
    saved = dataclasses.replace(make_plan(d=2, m=1, b=1), ep=2, zero=1)
    out = spawn(_ep_rank, 2, saved, path, True, timeout_s=300)
    (weights, state), = spawn(_ep_rank, 1, make_plan(d=1, m=1, b=2), path, False,
                              timeout_s=300)
    for key, value in out[0][0].items():
        assert torch.equal(weights[key], value), key
    experts = 0
    for rank_weights, rank_state in out:
        for key, (start, st) in rank_state.items():
            for name, value in st.items():
                want = state[key][1][name]
                if start is not None and value.dim() > 0:    # this rank's experts
                    want = want.narrow(0, start, value.shape[0])
                    experts += 1
                assert torch.equal(want, value), (key, name)
    assert experts >= 2 * 2 * 2    # 2 ranks × (gate_up, down) × (exp_avg, exp_avg_sq), ≥ 1 layer
