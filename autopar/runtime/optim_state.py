"""Where a loaded optimizer-state tensor lives: the rule torch.optim's own `load_state_dict`
applies (`Optimizer._process_value_according_to_param_policy`), stated once for autopar's
loaders, which fill `optimizer.state` directly (a sharded load reads into the regime's own
tensors instead of building a state dict).

- A scalar (Adam's `step`): float32, on the CPU, unless the parameter's group is `fused` or
  `capturable`, whose kernels read it on the parameter's device (a CPU step there fails:
  "state_steps is on cpu, different from other tensors on cuda:0", found on an H100).
- Anything else: the parameter's device, and its dtype when the parameter is floating point.
"""
from __future__ import annotations

import torch


def state_value(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
    """`value` (one state tensor of `param`) placed as torch's optimizers expect it."""
    if value.dim() == 0:
        group = next((g for g in optimizer.param_groups
                      if any(p is param for p in g["params"])), {})
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        return value.to(dtype=torch.float32,
                        device=param.device if on_device else torch.device("cpu"))
    if param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)
