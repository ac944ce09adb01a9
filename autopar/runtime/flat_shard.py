"""The flat layout ZeRO shards over the data group: tensors end to end, cut into d equal shards.

Math (Rajbhandari et al. 1910.02054 §5): the N elements of a list of tensors are laid end to
end, padded to N' = d·S with S = ceil(N / d); data-parallel rank r owns [r·S, (r+1)·S). A
tensor may straddle a shard boundary: the part of tensor i in my shard is a `Segment` —
elements [lo, hi) of the flattened tensor, at `shard_lo` in my shard.

    numels (5, 7, 3), d = 2: N = 15, S = 8.
    rank 0 owns [0, 8):  tensor 0 [0, 5) at 0, tensor 1 [0, 3) at 5
    rank 1 owns [8, 16): tensor 1 [3, 7) at 0, tensor 2 [0, 3) at 4, then 1 padding element

ZeroOptimizer (runtime/zero.py) lays out all of a rank's parameters this way, Zero3Chunks
(runtime/zero3_chunks.py) each chunk's. The optimizer runs on one fp32 "master" piece per
segment, so its state is per segment too; `gathered_state` / `load_state` convert it to and from
per-tensor state shaped like the tensors (what checkpoints store, plan-independent).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import all_gather, group_size
from autopar.runtime.optim_state import state_value

OptimState = dict[str, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Segment:
    param: int          # which tensor of the list
    lo: int             # [lo, hi) of its flattened elements
    hi: int
    shard_lo: int       # where it sits in my shard


class FlatLayout:
    """Where each of `numels` tensors' elements sit in the d shards, and my segments of them."""

    def __init__(self, numels: Sequence[int], d: int, rank: int):
        self.offsets, n = [], 0
        for k in numels:
            self.offsets.append(n)
            n += int(k)
        self.numels = [int(k) for k in numels]
        self.numel, self.d = n, d
        self.shard_numel = -(-n // d) if n else 0                      # S = ceil(N / d)
        lo_shard, hi_shard = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.segments = []
        for i, (k, off) in enumerate(zip(self.numels, self.offsets)):
            lo, hi = max(off, lo_shard), min(off + k, hi_shard)
            if lo < hi:
                self.segments.append(Segment(i, lo - off, hi - off, lo - lo_shard))

    def flatten(self, tensors: Sequence[torch.Tensor | None], dtype: torch.dtype,
                device: Any) -> torch.Tensor:
        """(d·S,) the tensors end to end (None: zeros), padded with zeros. Each element is
        written once (no fill before the copies: a whole extra pass over the buffer)."""
        flat = torch.empty(self.shard_numel * self.d, dtype=dtype, device=device)
        for t, off, k in zip(tensors, self.offsets, self.numels):
            if t is not None:
                flat[off:off + k].copy_(t.detach().reshape(-1))
            else:
                flat[off:off + k].zero_()
        flat[self.numel:].zero_()
        return flat

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Flat views of each tensor in a (d·S,) buffer (reshape them to the tensors' shapes)."""
        return [flat[off:off + k] for off, k in zip(self.offsets, self.numels)]

    def pieces(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """My segments of whole tensors (views of their flattened elements)."""
        return [tensors[s.param].reshape(-1)[s.lo:s.hi] for s in self.segments]

    def shard(self, pieces: Sequence[torch.Tensor], dtype: torch.dtype, device: Any,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """(S,) my shard from one piece per segment (padding zero), in `out` when given.
        The segments are contiguous from the shard's start: only the padding past them is
        zeroed (each element written once)."""
        mine = torch.empty(self.shard_numel, dtype=dtype, device=device) if out is None else out
        end = 0
        for s, x in zip(self.segments, pieces):
            end = s.shard_lo + s.hi - s.lo
            mine[s.shard_lo:end].copy_(x.detach().reshape(-1))
        mine[end:].zero_()
        return mine

    def gather(self, pieces: Sequence[torch.Tensor], group: Any, dtype: torch.dtype,
               device: Any, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """Every tensor whole, shaped `shapes`, from every rank's segment pieces (all-gather
        over `group`: collective)."""
        mine = self.shard(pieces, dtype, device)                         # (S,)
        full = all_gather(mine, 0, group) if group_size(group) > 1 else mine   # (d·S,)
        return [x.view(shape).clone() for x, shape in zip(self.split(full), shapes)]


def gathered_state(layout: FlatLayout, masters: Sequence[torch.Tensor],
                   optimizer: torch.optim.Optimizer, shapes: Sequence[torch.Size],
                   keys: Sequence[str], group: Any, device: Any) -> OptimState:
    """{keys[i]: {state name: tensor shaped like tensor i, or a 0-d scalar}}: the unsharded
    optimizer state of the tensors whose segments `masters` are (all-gathers; collective).
    Elementwise states (Adam's m, v) are gathered; scalar ones (Adam's step) agreed over the
    group (a rank whose segments have no state yet still takes part)."""
    names, scalars = _state_names(optimizer, group)
    out: OptimState = {}
    for name in names:
        pieces = []
        for m in masters:
            value = optimizer.state.get(m, {}).get(name)
            pieces.append(value if value is not None else torch.zeros_like(m))
        for key, full in zip(keys, layout.gather(pieces, group, torch.float32, device, shapes)):
            out.setdefault(key, {})[name] = full
    for name, value in scalars.items():
        for key in keys:
            out.setdefault(key, {})[name] = value.clone()
    return out


def load_state(layout: FlatLayout, masters: Sequence[torch.Tensor],
               optimizer: torch.optim.Optimizer, keys: Sequence[str], state: OptimState) -> None:
    """Inverse of gathered_state: each master takes its segment of its tensor's state (no
    communication)."""
    for s, m in zip(layout.segments, masters):
        key = keys[s.param]
        if key not in state:
            raise ValueError(f"load_state: no optimizer state for {key!r}; the state must "
                             f"hold every tensor of the layout (a checkpoint of this model)")
        optimizer.state[m] = {
            name: state_value(optimizer, m, v.detach().clone() if v.dim() == 0 else
                              v.detach().reshape(-1)[s.lo:s.hi].clone())
            for name, v in state[key].items()}


def _state_names(optimizer: torch.optim.Optimizer, group: Any
                 ) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Per-element state names, and scalar states (one value, e.g. Adam's step), agreed over
    the group."""
    tensors: set[str] = set()
    scalars: dict[str, torch.Tensor] = {}
    for st in optimizer.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors.add(k)
            elif isinstance(v, torch.Tensor):
                scalars.setdefault(k, v.detach())
    n = group_size(group)
    if n > 1:
        agreed: list[Any] = [None] * n
        dist.all_gather_object(agreed, (sorted(tensors), {k: float(v) for k, v in scalars.items()}),
                               group=group)
        tensors = set().union(*(set(a[0]) for a in agreed))
        merged: dict[str, float] = {}
        for a in agreed:
            merged.update(a[1])
        scalars = {k: torch.tensor(v, dtype=torch.float32) for k, v in merged.items()}
    return sorted(tensors), scalars


def held_segments(layout: FlatLayout, masters: Sequence[torch.Tensor],
                  optimizer: torch.optim.Optimizer, names: Sequence[str]) -> list:
    """My segments as checkpoint pieces (autopar.runtime.ckpt_pieces.Held): each master piece
    and its optimizer state, views, no communication — what a sharded save writes."""
    from autopar.runtime.ckpt_pieces import held_range
    return [held_range(names[s.param], s.lo, s.hi, m, optimizer.state.get(m, {}), False)
            for s, m in zip(layout.segments, masters)]
