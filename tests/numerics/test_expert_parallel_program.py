"""Expert parallelism as a whole program (compile() and the Runner on gloo ranks): transformers'
Mixtral and OLMoE (4 experts per layer, top-2) at d = 2 with ep = 2 — each rank holds 2 of the
4 experts of every layer, tokens reach them by all-to-all, the expert gradients are reduced
over the expert-data group (one rank here: only the division by c·d is left) and the rest over
the 2 data-parallel ranks (and at d = 4 over 2 ranks of 4), clipping counts each expert once — against the same model trained
on one device (3 AdamW steps with clipping, losses and full_state_dict at rtol 1e-4 /
atol 1e-5)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.api import ParallelProgram
from autopar.plan import Plan
from autopar.runtime.pretrained import SINGLE_FILE
from autopar.testing import spawn

import models
from programs import (BF16_LOSS_RTOL, BF16_MEDIAN_UPDATE_RTOL, BF16_UPDATE_RTOL,
                      BF16_UPDATE_SCALE_RTOL, BF16_WEIGHT_ATOL, MAX_NORM, STEPS, adamw,
                      check_trained, loss_fn, make_plan, sgd_momentum, train_steps)
from reference import assert_weights_match, train

pytestmark = pytest.mark.distributed

SEQ, EXPERTS = 8, 4   # models.hf_mixtral / hf_olmoe: 4 experts per layer, top-2


def _data(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return models.token_batches(64, (batch, SEQ), STEPS, seed=1234)


def _rank(rank: int, world: int, name: str, plan) -> tuple:
    torch.set_num_threads(1)
    model = models.build(name, seed=0)
    x, y = _data(plan.micro_batch_size)[0]
    prog = ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(x,),
                           loss_fn=loss_fn, example_targets=y, cluster=None)
    runner = prog.compile(optimizer=adamw, max_grad_norm=MAX_NORM, timeout_s=60)
    shapes = {q: tuple(p.shape) for q, p in runner.named_parameters()}
    losses = train_steps(runner, plan, _data(plan.global_batch_size))
    return losses, runner.full_state_dict(), shapes


def _check(name: str, plan) -> list:
    results = spawn(_rank, plan.gpus, name, plan, timeout_s=300)
    model = models.build(name, seed=0)
    ref = train(model, _data(plan.global_batch_size), adamw, loss_fn=loss_fn,
                max_grad_norm=MAX_NORM)
    for r, (_, _, shapes) in enumerate(results):
        halved = [q for q, s in shapes.items() if len(s) == 3 and s[0] == EXPERTS // plan.ep]
        assert len(halved) == 2 * plan.num_layers // plan.p, (r, shapes)   # gate_up, down
    check_trained(results, ref, models.build(name, seed=0).state_dict())
    return results


@pytest.mark.parametrize("name", ["hf_mixtral", "hf_olmoe", "hf_llama4", "hf_inkling"])
def test_ep2_d2_program_matches_single_device(name):
    """Llama 4's experts are batched matmuls over every token (no grouping offsets): each
    rank's (E, N, hidden) rows go to the experts' ranks as E/ep batches and come back.
    Inkling has both: 4 routed grouped experts and 2 shared batched ones (their gate and up
    read one expanded input, the router's per-token gains travel with the rows)."""
    _check(name, dataclasses.replace(make_plan(d=2), ep=2))


def test_llama4_c2_ring_ep2_d2_matches_single_device():
    """Llama 4 at c = 2 (ring attention over its complex-number rotary) × d = 2, ep = 2 over
    the 4 context-and-data ranks: each rank repeats its own tokens once per expert and sends
    the (E, N, hidden) batches to the experts' ranks."""
    plan = dataclasses.replace(make_plan(d=2), ep=2)
    _check("hf_llama4", Plan.from_dict({**plan.to_dict(), "c": 2, "cp_attention": "ring"}))


def test_ep2_d2_op_recompute_matches_single_device():
    """Recompute op with experts: their token all-to-alls (c10d ops writing fresh buffers)
    and grouped GEMMs run again in the recomputation, the dense GEMMs alternate."""
    _check("hf_mixtral", dataclasses.replace(make_plan(d=2), ep=2, recompute="op"))


@pytest.mark.parametrize("name, sp", [("hf_mixtral", False), ("hf_olmoe", True),
                                      ("hf_llama4", True)])
def test_t2_ep2_program_splits_experts_both_ways(name, sp):
    """t=2 d=2 ep=2 (4 ranks): each rank holds 2 of the 4 experts, each expert's FFN split
    over the 2 tensor ranks (passes/sharding/); full_state_dict gathers over both. With
    sequence parallelism the tokens are gathered before the routing, so each tensor rank
    dispatches all of its replica's rows to the expert group."""
    _check(name, dataclasses.replace(make_plan(t=2, d=2), ep=2, sequence_parallel=sp))


def test_ep2_d4_program_reduces_experts_over_the_expert_data_group():
    """4 ranks: expert groups [0, 1] [2, 3], expert-data groups [0, 2] [1, 3] (the expert
    gradients summed over 2 ranks, divided by 4)."""
    _check("hf_mixtral", dataclasses.replace(make_plan(d=4, m=1), ep=2))


@pytest.mark.parametrize("schedule, v, split", [("1f1b", 1, None),
                                               ("interleaved-zb", 2, [0, 1, 1, 0])])
def test_ep2_d2_p2_program_matches_single_device(schedule, v, split):
    """With a pipeline (p = 2, 4 ranks): each stage's experts spread over its own expert
    group, the micro-batches' all-to-alls in the schedule's order on both ranks of it; the
    zero-bubble schedule splits each backward into B (the all-to-alls' backward) and W."""
    _check("hf_mixtral", dataclasses.replace(
        make_plan(d=2, p=2, v=v, split=split, schedule=schedule), ep=2))


@pytest.mark.parametrize("d, p, schedule", [(2, 1, "1f1b"), (4, 1, "1f1b"),
                                             (2, 2, "breadth-first")])
def test_zero1_with_ep2_matches_single_device(d, p, schedule):
    """ZeRO-1: the dense optimizer state sharded over the c·d ranks, the experts' over their
    expert-data group (1 rank at d=2, 2 at d=4); breadth-first: per chunk, each chunk's dense
    and expert parts reduce-scattered at its REDUCE."""
    plan = dataclasses.replace(make_plan(d=d, p=p, m=2 if d == 2 else 1, schedule=schedule),
                               ep=2, zero=1)
    _check("hf_mixtral", plan)


def _resume_rank(rank: int, world: int, plan, path: str, save: bool) -> tuple:
    """Under `plan`: either train the first STEPS - 1 steps and save, or load and train the
    last step; (losses, full_state_dict) of the steps run."""
    torch.set_num_threads(1)
    x, y = _data(plan.micro_batch_size)[0]
    prog = ParallelProgram(model=models.build("hf_mixtral", seed=0), plan=plan, profile=None,
                           example_inputs=(x,), loss_fn=loss_fn, example_targets=y,
                           cluster=None)
    runner = prog.compile(optimizer=adamw, max_grad_norm=MAX_NORM, timeout_s=60)
    batches = _data(plan.global_batch_size)
    if save:
        losses = train_steps(runner, plan, batches[:-1])
        runner.save_checkpoint(path)
    else:
        assert runner.load_checkpoint(path) == STEPS - 1
        losses = train_steps(runner, plan, batches[-1:])
    return losses, runner.full_state_dict()


@pytest.mark.parametrize("saved_t, saved_zero, t, d, ep, m, zero", [
    (1, 0, 1, 2, 1, 2, 0), (1, 0, 1, 4, 4, 1, 0), (1, 1, 1, 2, 1, 2, 0), (1, 0, 1, 4, 2, 1, 1),
    (1, 0, 2, 1, 1, 4, 0), (1, 0, 2, 2, 2, 2, 0), (2, 1, 1, 2, 1, 2, 0)])
def test_checkpoint_saved_at_ep2_resumes_under_another_ep(tmp_path, saved_t, saved_zero, t, d,
                                                           ep, m, zero):
    """Saved at d=2 ep=2 (each rank writes its 2 experts' weights and Adam moments; under
    ZeRO-1 gathered from the shards), loaded at d=2 ep=1 (every expert on every rank), d=4
    ep=4 (one expert per rank), d=4 ep=2 ZeRO-1, or t=2 (every expert's FFN split over the
    tensor ranks: each reads a box across the saved dim-0 pieces), or t=2 d=2 ep=2 (both
    splits); and saved at t=2 d=2 ep=2 ZeRO-1 (the experts gathered over the tensor ranks
    first), loaded at d=2 ep=1: the last step equals the uninterrupted single-device run's."""
    path = str(tmp_path / "ckpt")
    saved = dataclasses.replace(make_plan(t=saved_t, d=2), ep=2, zero=saved_zero)
    spawn(_resume_rank, saved.gpus, saved, path, True, timeout_s=300)
    plan = dataclasses.replace(make_plan(t=t, d=d, m=m), ep=ep, zero=zero)
    results = spawn(_resume_rank, plan.gpus, plan, path, False, timeout_s=300)
    ref = train(models.build("hf_mixtral", seed=0), _data(plan.global_batch_size), adamw,
                loss_fn=loss_fn, max_grad_norm=MAX_NORM)
    for r, (losses, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[-1:]),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} loss: {m}")
    state = results[0][1]
    assert_weights_match(state, ref.state, ref.init)


def _pretrained_rank(rank: int, world: int, plan, directory: str) -> dict:
    torch.set_num_threads(1)
    x, y = _data(plan.micro_batch_size)[0]
    prog = ParallelProgram(model=models.build("hf_mixtral", seed=0), plan=plan, profile=None,
                           example_inputs=(x,), loss_fn=loss_fn, example_targets=y,
                           cluster=None)
    runner = prog.compile(optimizer=adamw, timeout_s=60)
    runner.load_pretrained(directory)
    return runner.full_state_dict()


@pytest.mark.parametrize("t", [1, 2])
def test_load_pretrained_at_ep2_reads_each_ranks_experts(tmp_path, t):
    """A safetensors directory of other weights (seed 5) under the model's own keys, loaded at
    d=2 ep=2 (and t=2), each rank reading its 2 experts' rows (and its tensor slice of them):
    full_state_dict() equals the saved model's
    state dict. (transformers' save_pretrained of Mixtral writes the per-expert checkpoint
    keys, which load_pretrained does not convert, at any ep: see docs/known-gaps.md.)"""
    from safetensors.torch import save_file
    saved = models.build("hf_mixtral", seed=5)
    save_file({k: v.contiguous() for k, v in saved.state_dict().items()},
              str(tmp_path / SINGLE_FILE))
    plan = dataclasses.replace(make_plan(t=t, d=2), ep=2)
    state = spawn(_pretrained_rank, plan.gpus, plan, str(tmp_path), timeout_s=300)[0]
    want = saved.state_dict()
    assert list(state) == list(want)
    bad = [k for k, v in want.items() if not torch.equal(state[k], v)]
    assert not bad, bad


# ---- sharded weights (ZeRO-2/3) with ep = 2, in one process group of 4 ranks ------------------
ZERO_CASES = (("hf_mixtral", 3, "fp32"), ("hf_olmoe", 2, "fp32"), ("hf_qwen2_moe", 3, "fp32"),
              ("hf_mixtral", 2, "bf16"), ("hf_llama4", 3, "fp32"))
BF16_MAX_NORM = 0.05   # tests/programs.py check_training's bf16 setting (clipping active)


def _zero_plan(zero: int, ep: int = 2):
    return dataclasses.replace(make_plan(d=4, m=1), ep=ep, zero=zero)


def _optim(precision: str) -> tuple:
    """(optimizer, max_grad_norm) of a case: SGD with momentum (programs.sgd_momentum; its
    buffer checkpointed) in both precisions, bf16 with clipping active. Not AdamW in fp32: it
    divides out a gradient wrong by a constant factor (the experts' divisor c·d against
    c·d/ep). Not AdamW in bf16: its normalised step turns bf16 rounding of near-zero gradients into
    lr-sized moves, so on an AVX-512 AMD EPYC host Mixtral's experts' updates were 9-10% off
    one device's at ep = 2, under ZeRO-0 and ZeRO-2 alike (5.6% at ep = 1), and one master
    crossed BF16_WEIGHT_ATOL; with SGD every tensor's update was within 0.8% at ep = 1 and 2
    (2026-11-26), so the median and scale checks below see a wrong gradient, not noise."""
    return sgd_momentum, MAX_NORM if precision == "fp32" else BF16_MAX_NORM


def _zero_rank(rank: int, world: int, path: str) -> list:
    """Each ZERO_CASES case at d = 4 ep = 2 (expert groups [0, 1] [2, 3], expert-data groups
    [0, 2] [1, 3]: the experts' shards over 2 ranks, the dense ones over 4), the first saving a
    checkpoint before its last step; then Mixtral at ep = 1 ZeRO-1 loads it and trains the last
    step. Per run: (losses, full_state_dict, (expert shard elements, local expert elements))."""
    torch.set_num_threads(1)
    out = []
    runs = [(name, _zero_plan(zero), precision) for name, zero, precision in ZERO_CASES]
    for i, (name, plan, precision) in enumerate(runs + [("hf_mixtral", _zero_plan(1, 1), "fp32")]):
        x, y = _data(plan.micro_batch_size)[0]
        prog = ParallelProgram(model=models.build(name, seed=0), plan=plan, profile=None,
                               example_inputs=(x,), loss_fn=loss_fn, example_targets=y,
                               cluster=None)
        optimizer, max_norm = _optim(precision)
        runner = prog.compile(optimizer=optimizer, max_grad_norm=max_norm, precision=precision,
                              timeout_s=60)
        batches = _data(plan.global_batch_size)
        if i == len(runs):     # the resume: ep = 1, ZeRO-1
            assert runner.load_checkpoint(path) == STEPS - 1
            losses = train_steps(runner, plan, batches[-1:])
        else:
            losses = train_steps(runner, plan, batches[:-1])
            if i == 0:
                runner.save_checkpoint(path)
            losses += train_steps(runner, plan, batches[-1:])
        experts = [q for q, info in runner.params.infos.items() if info.expert]
        shard = sum(m.numel() for part in getattr(runner.regime, "parts", [])[1:]
                    for ch in part.chunks.values() for m in ch.master)
        out.append((losses, runner.full_state_dict(),
                    (shard, sum(runner.params.tensors[q].numel() for q in experts))))
    return out


def test_zero2_zero3_with_ep2_match_single_device_and_resume_at_ep1_zero1(tmp_path):
    """ZeRO-3 and ZeRO-2 with ep = 2 on Mixtral, OLMoE, Qwen2-MoE and Llama 4 (fp32), and
    Mixtral's ZeRO-2 in bf16: each chunk's experts a flat buffer of their own, sharded, gathered and
    reduce-scattered over the expert-data group (and divided by c·d), the dense weights over
    the 4 data ranks (autopar/runtime/regimes/zero3.py), against one device; and the
    checkpoint saved at ep = 2 ZeRO-3 (each rank writing its experts' shard pieces) resumed at
    ep = 1 ZeRO-1: its last step equals the uninterrupted single-device run's."""
    path = str(tmp_path / "ckpt")
    results = spawn(_zero_rank, 4, path, timeout_s=600)
    refs = {}
    for i, (name, zero, precision) in enumerate(ZERO_CASES):
        optimizer, max_norm = _optim(precision)
        ref = refs.setdefault(i, train(models.build(name, seed=0), _data(8), optimizer,
                                       loss_fn=loss_fn, max_grad_norm=max_norm,
                                       precision=precision))
        for r, per_rank in enumerate(results):
            shard, local = per_rank[i][2]
            assert local and 2 * shard - local in (0, 1), (name, r, shard, local)   # 1 chunk
        init = models.build(name, seed=0).state_dict()
        if precision == "fp32":
            check_trained([per_rank[i] for per_rank in results], ref, init)
            continue
        for r, per_rank in enumerate(results):
            torch.testing.assert_close(torch.tensor(per_rank[i][0]), torch.tensor(ref.losses),
                                       rtol=BF16_LOSS_RTOL, atol=0.0)
        assert_weights_match(results[0][i][1], ref.state, init, rtol=0, atol=BF16_WEIGHT_ATOL,
                             update_rtol=BF16_UPDATE_RTOL,
                             median_update_rtol=BF16_MEDIAN_UPDATE_RTOL,
                             update_scale_rtol=BF16_UPDATE_SCALE_RTOL)
    resumed, ref = [per_rank[-1] for per_rank in results], refs[0]
    for r, (losses, _, _) in enumerate(resumed):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[-1:]),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} loss: {m}")
    assert_weights_match(resumed[0][1], ref.state, models.build("hf_mixtral", seed=0).state_dict())
