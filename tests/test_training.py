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
from test_runtime_numerics import loss_fn, make_data, make_model, make_plan, make_program

pytestmark = pytest.mark.distributed

LR = 1e-3
# bf16 tolerance: the loss is itself a bf16 number (8 significant bits: for a loss in [4, 8)
# one ulp is 2^-5 = 0.031), and the parallel run sums micro-batches and replicas in another
# order than the single-device run, so losses agree to ~1 bf16 ulp: rtol 2^-7 (two ulps).
# Weights are the fp32 masters; AdamW (lr 1e-3) moves them by <= ~1e-3 per step whatever the
# gradient rounding, so the masters agree to atol 3e-3 after 3 steps.
BF16_LOSS_RTOL = 2.0 ** -7
BF16_WEIGHT_ATOL = 3e-3


def with_zero(plan: Plan, zero: int) -> Plan:
    return Plan.from_dict({**plan.to_dict(), "zero": zero})


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def reference(name: str, plan: Plan, *, max_norm: float | None = None,
              precision: str = "fp32") -> tuple[list[float], dict, list[float], int]:
    """(losses, state dict, unclipped grad norms, optimizer-state bytes) on one device."""
    from autopar.runtime.precision import MixedPrecision
    model, vocab = make_model(name, plan.num_layers)
    mp = MixedPrecision(list(model.parameters())) if precision == "bf16" else None
    opt = _adamw(mp.master_params if mp else model.parameters())
    stepped = mp.master_params if mp else list(model.parameters())
    losses, norms = [], []
    for x, y in make_data(plan, vocab):
        if not mp:   # (mp.step zeroes main_grad; opt.zero_grad would unlink the masters' grads)
            opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(stepped, max_norm)))
        if mp:
            mp.step(opt)
        else:
            opt.step()
        losses.append(loss.item())
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    if mp:  # the fp32 masters are the weights (full_state_dict returns them too)
        by_id = {id(p): m for p, m in zip(mp.params, mp.master_params)}
        for k, v in model.state_dict(keep_vars=True).items():
            if id(v) in by_id:
                state[k] = by_id[id(v)].detach().clone()
    nbytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor))
    return losses, state, norms, nbytes


def train_rank(rank, world, name, plan, max_norm, precision):
    prog, vocab = make_program(name, plan)
    runner = prog.compile(optimizer=_adamw, max_grad_norm=max_norm, precision=precision,
                          timeout_s=60)
    share = plan.global_batch_size // plan.d
    losses = []
    for x, y in make_data(plan, vocab):
        lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
        losses.append(runner.train_step(x[lo:hi], y[lo:hi]))
    return losses, runner.full_state_dict(), runner.optimizer_state_bytes()


def check(name: str, plan: Plan, *, max_norm: float | None = None, precision: str = "fp32",
          timeout_s: float = 300.0):
    results = spawn(train_rank, plan.gpus, name, plan, max_norm, precision, timeout_s=timeout_s)
    ref_losses, ref_state, norms, ref_bytes = reference(name, plan, max_norm=max_norm,
                                                        precision=precision)
    if max_norm is not None:  # the check can fail: clipping really changed the gradients
        assert min(norms) > 2 * max_norm, norms
    tol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=BF16_LOSS_RTOL,
                                                                       atol=0.0)
    for r, (losses, _, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol,
                                   msg=lambda m: f"rank {r} losses: {m}")
    state = results[0][1]
    assert list(state) == list(ref_state)
    wtol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=0,
                                                                        atol=BF16_WEIGHT_ATOL)
    init, _ = make_model(name, plan.num_layers)
    moved = 0
    for key, ref in ref_state.items():
        torch.testing.assert_close(state[key].float(), ref, **wtol,
                                   msg=lambda m, k=key: f"{k}: {m}")
        moved += int(not torch.equal(init.state_dict()[key].float(), state[key].float()))
    assert moved > 0
    return results, ref_bytes


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
    """(zero=3 runs under 1f1b, interleaved and breadth-first: tests/test_sharded_dp.py)"""
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
