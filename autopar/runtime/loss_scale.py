"""Dynamic loss scaling for fp16 training: one scaler for the whole job.

fp16 has 5 exponent bits: gradients below 2^-24 flush to zero. Loss scaling (Micikevicius et
al. 1710.03740) multiplies the loss by S before the backward, so the fp16 gradients are S·g,
and divides the fp32 gradients by S before clipping and the step. S is dynamic, as
torch.amp.GradScaler's: a step whose gradients hold an inf or nan is skipped and S *=
backoff_factor; after growth_interval clean steps in a row S *= growth_factor. The scaler uses
GradScaler's own kernels (`torch._amp_foreach_non_finite_check_and_unscale_`,
`torch._amp_update_scale_`), so its scale sequence is GradScaler's.

Across ranks (Megatron's `found_inf` all-reduce over the model-parallel group, here the world):
each rank checks the gradients its optimizer steps — after the data-parallel reductions, so a
replica's inf has reached every replica — and the flag is all-reduced over every rank (tensor,
pipeline, data, context and expert ranks hold different gradients), so every rank skips the
same steps and keeps the same S. The scale is a host float the executor multiplies each
micro-batch's loss by (a power of two: exact in fp32).

    scaler = LossScaler(LossScaling(), device)
    loss_scales = scaler.scaled(loss_scales)        # each micro-batch's backward multiplier
    ... backward, regime.finish() ...
    if scaler.unscale(regime.optimizer, world):     # False: an inf/nan somewhere in the job
        clip, step
    scaler.update()                                 # backoff or growth, the same on every rank
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from autopar.runtime.collectives import all_reduce_

STATE_KEY = "autopar.loss_scaler"   # the key of the scaler's state in a checkpoint's user_state


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """torch.amp.GradScaler's knobs and defaults (init 2^16, ×2 after 2000 clean steps,
    ×0.5 on an overflow)."""
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        checks = [("init_scale", self.init_scale > 0, "> 0"),
                  ("growth_factor", self.growth_factor > 1, "> 1"),
                  ("backoff_factor", 0 < self.backoff_factor < 1, "in (0, 1)"),
                  ("growth_interval", isinstance(self.growth_interval, int)
                   and self.growth_interval >= 1, "an int >= 1")]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"LossScaling: {name}={getattr(self, name)!r}: must be {rule} "
                                 f"(GradScaler's default is {getattr(LossScaling, name)!r})")


class LossScaler:
    """The job's dynamic loss scale on this rank (module docstring)."""

    def __init__(self, config: LossScaling, device: torch.device):
        self.config = config
        self._scale = torch.full((1,), float(config.init_scale), dtype=torch.float32,
                                 device=device)
        self._growth = torch.zeros((1,), dtype=torch.int32, device=device)
        self._found = torch.zeros((1,), dtype=torch.float32, device=device)
        self.skipped_steps = 0          # steps skipped for an overflow so far

    @property
    def scale(self) -> float:
        return float(self._scale)

    def scaled(self, loss_scales: Sequence[float]) -> list[float]:
        """Each micro-batch's backward multiplier times the loss scale."""
        s = self.scale
        return [w * s for w in loss_scales]

    def unscale(self, optimizer: torch.optim.Optimizer, group: Any) -> bool:
        """Divide the gradients `optimizer` steps by the scale (in place, GradScaler's kernel);
        whether every gradient of every rank in `group` was finite (one all-reduce)."""
        self._found.zero_()
        inv = self._scale.double().reciprocal().float()
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for group_ in optimizer.param_groups:
            for p in group_["params"]:
                if p.grad is not None:
                    by_kind.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), grads in by_kind.items():
            found = torch.zeros_like(self._found, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv.to(device))
            self._found += found.to(self._found.device)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            all_reduce_(self._found, group)
        return not bool(self._found.item())

    def update(self) -> None:
        """After unscale: back off on an overflow (the step was skipped), else count a clean
        step and grow after growth_interval of them (GradScaler.update's kernel)."""
        c = self.config
        if self._found.item():
            self.skipped_steps += 1
        torch._amp_update_scale_(self._scale, self._growth, (self._found > 0).float(),
                                 c.growth_factor, c.backoff_factor, c.growth_interval)

    def state_dict(self) -> dict:
        """JSON-serialisable state (what a checkpoint saves)."""
        return {"scale": self.scale, "growth_tracker": int(self._growth.item()),
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale.fill_(float(state["scale"]))
        self._growth.fill_(int(state["growth_tracker"]))
        self.skipped_steps = int(state.get("skipped_steps", 0))
