"""fp16 with dynamic loss scaling (autopar/runtime/loss_scale.py) against one device trained
in fp16 under torch.amp.GradScaler (tests/reference.py), at t = 2, p = 2 and d = 2 under
ZeRO 0, 1 and 3 (one spawn of 2 ranks trains the five plans in turn), and at t = 2, p = 2,
d = 2 ZeRO-3 together (8 ranks).

The scaler is set so that its schedule covers growth, an overflow and backoff in 3 steps:
2^16 at step 1 (clean: ×2^20 after one clean step), 2^36 at step 2 (the fp16 logit
gradients overflow: the step is skipped on every rank and the scale backs off ×2^-20), 2^16
at step 3. Checked: every rank's scale after each step is GradScaler's, every rank skipped
exactly that one step, the fp32 masters after the skipped step are bit-for-bit those before it
(and step 3 moves them), losses and final weights equal the reference at bf16-level tolerance,
and the scaler's state comes back from a checkpoint."""
from __future__ import annotations

import pytest
import torch

from autopar.runtime.loss_scale import LossScaling
from autopar.testing import spawn

from programs import (BF16_LOSS_RTOL, BF16_WEIGHT_ATOL, adamw_decayed, make_data, make_plan,
                      make_program, train_single_device, with_zero)

pytestmark = pytest.mark.distributed

SCALING = LossScaling(init_scale=2.0 ** 16, growth_factor=2.0 ** 20, backoff_factor=2.0 ** -20,
                      growth_interval=1)
MAX_NORM = 0.05


def _train_fp16(rank, world, jobs):
    """[(losses, scales, final, restored, states)] of each (plan, checkpoint dir) job, trained
    in turn on these ranks (the last closes the process group)."""
    return [_train_one(plan, ckpt, j == len(jobs) - 1) for j, (plan, ckpt) in enumerate(jobs)]


def _train_one(plan, ckpt, close):
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=adamw_decayed, max_grad_norm=MAX_NORM, precision="fp16",
                          loss_scaling=SCALING, timeout_s=60)
    share = plan.global_batch_size // plan.d
    lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
    losses, scales, states = [], [], [runner.full_state_dict()]
    for x, y in make_data(plan, vocab):
        losses.append(runner.train_step(x[lo:hi], y[lo:hi]))
        scales.append(runner.scaler.scale)
        states.append(runner.full_state_dict())
    runner.save_checkpoint(ckpt)
    final = runner.scaler.state_dict()
    runner.scaler.load_state_dict({"scale": 1.0, "growth_tracker": 0, "skipped_steps": 0})
    runner.load_checkpoint(ckpt)
    restored = runner.scaler.state_dict()
    if close:
        runner.close()
    return losses, scales, final, restored, states


PLANS = {"t2": make_plan(t=2), "p2": make_plan(p=2), "d2": make_plan(d=2),
         "d2-zero1": with_zero(make_plan(d=2), 1), "d2-zero3": with_zero(make_plan(d=2), 3)}


def test_fp16_loss_scaling_equals_one_device_gradscaler(tmp_path):
    jobs = [(plan, str(tmp_path / name)) for name, plan in PLANS.items()]
    results = spawn(_train_fp16, 2, jobs, timeout_s=400)
    for j, (name, plan) in enumerate(PLANS.items()):
        _check(name, plan, [res[j] for res in results])


def test_fp16_loss_scaling_t2_p2_d2_zero3_together_equals_one_device(tmp_path):
    """All three splits and ZeRO-3 in one 8-rank run: one scale, one skipped step everywhere."""
    plan = with_zero(make_plan(t=2, p=2, d=2), 3)
    results = spawn(_train_fp16, 8, [(plan, str(tmp_path / "t2p2d2"))], timeout_s=400)
    _check("t2-p2-d2-zero3", plan, [res[0] for res in results])


def _check(name, plan, results):
    """Each rank's run of `plan` (results[r]) against the single-device GradScaler run."""
    ref = train_single_device("gpt", plan, adamw_decayed, max_grad_norm=MAX_NORM,
                              precision="fp16", loss_scaling=SCALING)
    assert ref.loss_scales == [2.0 ** 36, 2.0 ** 16, 2.0 ** 36]   # step 2 overflowed
    for r, (losses, scales, final, restored, _) in enumerate(results):
        assert scales == ref.loss_scales, f"{name} rank {r}"
        assert final["skipped_steps"] == 1, f"{name} rank {r} skipped {final['skipped_steps']}"
        assert restored == final, f"{name} rank {r}: the checkpoint's scaler {restored} != {final}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses),
                                   rtol=BF16_LOSS_RTOL, atol=0.0,
                                   msg=lambda m: f"{name} rank {r} losses: {m}")
    states = results[0][4]
    assert all(torch.equal(states[2][k], states[1][k]) for k in states[1]), name  # skipped
    assert any(not torch.equal(states[3][k], states[2][k]) for k in states[2]), name
    assert any(not torch.equal(states[1][k], states[0][k]) for k in states[0]), name
    for key, want in ref.state.items():
        torch.testing.assert_close(states[3][key].float(), want.float(), rtol=0,
                                   atol=BF16_WEIGHT_ATOL, msg=lambda m, k=key: f"{name} {k}: {m}")
