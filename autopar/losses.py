"""Loss functions with the `loss_fn(model_output, targets) -> scalar mean loss` contract."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def cross_entropy(output: Any, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy of logits (..., V) against targets (...).

    Accepts a logits tensor or any model output with a `.logits` attribute (the `transformers`
    convention), so unmodified Hugging Face models need no wrapper.
    """
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"cross_entropy: model output is a {type(output).__name__} without a "
                         f"tensor `.logits`; pass a loss_fn that picks the logits out of it")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index)
