"""Where each local parameter tensor sits in the user's single-device model.

`ParamInfo` is the one description the runtime passes to gradient sync, ZeRO, clipping,
`full_state_dict()` and checkpoints: which user state-dict key(s) a local tensor stands for,
the full (unpadded) shape, and which slice of it this rank holds.

Worked example: GPT-2's wte (vocab 50257, hidden 768) under t = 2 with the vocabulary padded
to 50432 (a multiple of 128·t): tensor rank 0 holds padded rows [0, 25216) = real rows
[0, 25216); rank 1 holds padded rows [25216, 50432) = real rows [25216, 50257) followed by
175 padding rows. So rank 1's ParamInfo is split_dim=0, start=25216, stop=50257, and its local
tensor has 25216 rows of which the first stop - start = 25041 are real.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    key: str                       # the user's state-dict key
    aliases: tuple[str, ...] = ()  # other user keys of the same tensor (tied weights)
    global_shape: tuple[int, ...]  # full shape in the single-device model (unpadded)
    split_dim: int | None = None   # tensor-parallel split dimension; None = replicated over t
    start: int = 0                 # this rank's real slice [start, stop) along split_dim
    stop: int = 0
    replicated_over_tp: bool = True   # same values on every tensor rank (count once in norms)
    shared_with: str | None = None    # "embedding": also held by another pipeline stage

    def real_part(self, local: torch.Tensor) -> torch.Tensor:
        """The rows of `local` that are real (drops vocabulary padding)."""
        if self.split_dim is None:
            return local
        return local.narrow(self.split_dim, 0, self.stop - self.start)

    def global_index(self) -> tuple[slice, ...]:
        """Index of this rank's real slice in the full tensor."""
        idx = [slice(None)] * len(self.global_shape)
        if self.split_dim is not None:
            idx[self.split_dim] = slice(self.start, self.stop)
        return tuple(idx)
