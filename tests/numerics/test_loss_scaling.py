"""fp16 with dynamic loss scaling (autopar/runtime/loss_scale.py) against one device trained
in fp16 under torch.amp.GradScaler (tests/reference.py), at t = 2, p = 2 and d = 2.

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
                      make_program, train_single_device)

pytestmark = pytest.mark.distributed

SCALING = LossScaling(init_scale=2.0 ** 16, growth_factor=2.0 ** 20, backoff_factor=2.0 ** -20,
                      growth_interval=1)
MAX_NORM = 0.05


def _train_fp16(rank, world, plan, ckpt):
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
    runner.close()
    return losses, scales, final, restored, states


@pytest.mark.parametrize("pins", [dict(t=2), dict(p=2), dict(d=2)], ids=["t2", "p2", "d2"])
def test_fp16_loss_scaling_equals_one_device_gradscaler(pins, tmp_path):
    plan = make_plan(**pins)
    results = spawn(_train_fp16, plan.gpus, plan, str(tmp_path / "ckpt"), timeout_s=240)
    ref = train_single_device("gpt", plan, adamw_decayed, max_grad_norm=MAX_NORM,
                              precision="fp16", loss_scaling=SCALING)
    assert ref.loss_scales == [2.0 ** 36, 2.0 ** 16, 2.0 ** 36]   # step 2 overflowed
    for r, (losses, scales, final, restored, _) in enumerate(results):
        assert scales == ref.loss_scales, f"rank {r}"
        assert final["skipped_steps"] == 1, f"rank {r} skipped {final['skipped_steps']} steps"
        assert restored == final, f"rank {r}: the checkpoint's scaler {restored} != {final}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses),
                                   rtol=BF16_LOSS_RTOL, atol=0.0,
                                   msg=lambda m: f"rank {r} losses: {m}")
    states = results[0][4]
    assert all(torch.equal(states[2][k], states[1][k]) for k in states[1])  # skipped step 2
    assert any(not torch.equal(states[3][k], states[2][k]) for k in states[2])
    assert any(not torch.equal(states[1][k], states[0][k]) for k in states[0])
    for key, want in ref.state.items():
        torch.testing.assert_close(states[3][key].float(), want.float(), rtol=0,
                                   atol=BF16_WEIGHT_ATOL, msg=lambda m, k=key: f"{k}: {m}")
