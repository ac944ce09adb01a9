"""Capture a user's model (and loss) as an FX graph with torch.export (non-strict).

Requires: an nn.Module on real or meta tensors, example inputs, optionally loss_fn and targets.
Guarantees: `Captured.gm` is an FX GraphModule in ATen training IR whose nodes carry
  meta["val"] (FakeTensor: shape/dtype), meta["nn_module_stack"] (the module path of the
  user's code), meta["stack_trace"] (user source line); parameters and buffers are get_attr
  nodes with the user's fully qualified names, so a state dict maps 1:1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx


class _WithLoss(torch.nn.Module):
    """Wraps model + loss_fn so the exported graph ends in the scalar loss."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any) -> Any:
        if self.loss_fn is None:
            return self.model(*args)
        *inputs, targets = args
        return self.loss_fn(self.model(*inputs), targets)


@dataclass
class Captured:
    """The captured program. `gm` is runnable (same numerics as the model)."""
    gm: torch.fx.GraphModule
    exported: torch.export.ExportedProgram
    model: torch.nn.Module
    has_loss: bool
    prefix: str  # module-path prefix added by the loss wrapper ("model." or "")


def capture(model: torch.nn.Module, example_inputs: tuple, loss_fn: Callable | None = None,
            targets: torch.Tensor | None = None) -> Captured:
    """torch.export (non-strict) of `model` (+ `loss_fn(model(*inputs), targets)`)."""
    wrapper = _WithLoss(model, loss_fn if targets is not None else None)
    args = tuple(example_inputs) + ((targets,) if targets is not None and loss_fn else ())
    exported = torch.export.export(wrapper, args, strict=False)
    gm = exported.module()
    return Captured(gm=gm, exported=exported, model=model,
                    has_loss=targets is not None and loss_fn is not None, prefix="model.")
