"""Training through the Runner on gloo ranks equals the single-device model (3 AdamW steps):
data parallelism (GradSync), ZeRO-1, tensor × data, interleaved pipeline × data with ZeRO-1,
active global-norm clipping, bf16 mixed precision (against a single-device bf16 run), and
ZeRO-1's optimizer-state memory (1/d per rank)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.plan import Plan
from autopar.testing import spawn

from models import runtime_model
from programs import make_plan, make_program, train_rank, train_single_device, with_zero
from reference import optimizer_state_bytes

pytestmark = pytest.mark.distributed

LR = 1e-3
# bf16 tolerance: the loss is itself a bf16 number (8 significant bits: for a loss in [4, 8)
# one ulp is 2^-5 = 0.031), and the parallel run sums micro-batches and replicas in another
# order than the single-device run, so losses agree to ~1 bf16 ulp: rtol 2^-7 (two ulps).
# Weights are the fp32 masters; AdamW (lr 1e-3) moves them by <= ~1e-3 per step whatever the
# gradient rounding, so the masters agree to atol 3e-3 after 3 steps.
BF16_LOSS_RTOL = 2.0 ** -7
BF16_WEIGHT_ATOL = 3e-3


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def check(name: str, plan: Plan, *, max_norm: float | None = None, precision: str = "fp32",
          timeout_s: float = 300.0):
    results = spawn(train_rank, plan.gpus, name, plan, _adamw, max_norm, precision,
                    timeout_s=timeout_s)
    ref = train_single_device(name, plan, _adamw, max_grad_norm=max_norm, precision=precision)
    if max_norm is not None:  # the check can fail: clipping really changed the gradients
        assert min(ref.grad_norms) > 2 * max_norm, ref.grad_norms
    tol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=BF16_LOSS_RTOL,
                                                                       atol=0.0)
    for r, (losses, _, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), **tol,
                                   msg=lambda m: f"rank {r} losses: {m}")
    state = results[0][1]
    assert list(state) == list(ref.state)
    wtol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=0,
                                                                        atol=BF16_WEIGHT_ATOL)
    init = runtime_model(name, plan.num_layers)
    moved = 0
    for key, want in ref.state.items():
        torch.testing.assert_close(state[key].float(), want.float(), **wtol,
                                   msg=lambda m, k=key: f"{k}: {m}")
        moved += int(not torch.equal(init.state_dict()[key].float(), state[key].float()))
    assert moved > 0
    return results, optimizer_state_bytes(ref.optimizer)


def test_d2():
    check("gpt", make_plan(d=2, m=2, layers=2))


def test_d2_zero1_clipping_active_and_state_bytes_halved():
    results, ref_bytes = check("gpt", with_zero(make_plan(d=2, m=2, layers=2), 1),
                               max_norm=0.05)
    for _losses, _state, nbytes in results:
        # ZeRO-1: each rank keeps Adam's m and v for ceil(N/2) of the N elements (+ a few
        # scalar `step` states per parameter segment): half the single-device bytes
        assert abs(nbytes / ref_bytes - 0.5) < 0.02, (nbytes, ref_bytes)


@pytest.mark.slow
def test_t2_d2_clipping_active():
    check("gpt", make_plan(t=2, d=2, m=2, layers=2), max_norm=0.05)


@pytest.mark.slow
def test_p2_d2_interleaved_zero1():
    check("gpt", with_zero(make_plan(p=2, d=2, v=2, m=2, schedule="interleaved-1f1b",
                                     layers=4), 1))


def test_bf16_d2():
    check("gpt", make_plan(d=2, m=2, layers=2), precision="bf16", max_norm=0.05)


@pytest.mark.slow
def test_bf16_p2_d2_zero1():
    check("gpt", with_zero(make_plan(p=2, d=2, m=2, layers=2), 1), precision="bf16")


@pytest.mark.slow
def test_bf16_t2_sequence_parallel_overlapped_column_parallel():
    """bf16 through the fused column-parallel calls (passes/overlap.py): their weight
    gradients reach the fp32 main_grad hooks like a plain linear's."""
    check("gpt", dataclasses.replace(make_plan(t=2, m=2, layers=2), sequence_parallel=True),
          precision="bf16", max_norm=0.05)


def test_zero3_with_a_split_backward_and_bad_precision_are_clear_errors(monkeypatch):
    """(zero=3 runs under 1f1b, interleaved and breadth-first:
    tests/numerics/test_sharded_dp.py)"""
    monkeypatch.setenv("WORLD_SIZE", "2")
    prog, _ = make_program("gpt", with_zero(make_plan(d=2, m=2, layers=2,
                                                      schedule="interleaved-zb"), 3))
    with pytest.raises(ValueError, match=r"zero=3 with schedule='interleaved-zb'.*use "
                                         r"zero=0/1"):
        prog.compile()
    prog, _ = make_program("gpt", make_plan(d=2, m=2, layers=2))
    with pytest.raises(ValueError, match=r"precision='fp16'"):
        prog.compile(precision="fp16")


def test_bf16_p2_interleaved_zero_bubble_clipping_active():
    """Split backwards (W accumulates the weight gradients) feed the fp32 main-grads through
    the post-accumulate hooks, and clipping sees the whole gradient."""
    check("gpt", make_plan(p=2, v=2, m=2, schedule="interleaved-zb", layers=4),
          precision="bf16", max_norm=0.05)
