"""ZeRO-1: optimizer states (and fp32 master weights) sharded over the data-parallel group.

Math (Rajbhandari et al. 1910.02054 §5.1, stage P_os): the d replicas' parameters are laid end
to end in one flat buffer of N elements, padded to N' = d·S, S = ceil(N / d); dp rank r owns
the contiguous shard [r·S, (r+1)·S). A step is

    g_shard = reduce_scatter(flat grads) / d        # (S,) the averaged gradient of my shard
    optimizer.step() on my shard's fp32 master     # only 1/d of Adam's m, v and master
    params = all_gather(updated shard)             # (N',) back into every local parameter

Communication: reduce-scatter + all-gather move the same bytes as one all-reduce (ring:
2·(d-1)/d·N each way). gloo in torch 2.13 has reduce_scatter_tensor; if a backend lacks it,
collectives.start_reduce_scatter falls back to all-reduce + own slice (d× the reduce traffic).

The shard is handed to the user's optimizer as *segments*: one fp32 tensor per parameter
piece that falls into the shard (a shard boundary may cut a parameter). Elementwise optimizers
(SGD, Adam, AdamW, ...) then give exactly the unsharded numbers, and a parameter whose
gradient is None on every replica is skipped as on one device. Optimizers that use whole-tensor
statistics (LAMB, Adafactor) would see pieces: not supported.

Per-step call order (the runner): backward over all micro-batches (no GradSync: the
reduce-scatter replaces its all-reduce) → optional tied-embedding all-reduce of full grads →
`zero.reduce_grads()` → optional `zero.clip_grad_norm_(max_norm, groups)` → `zero.step()` →
`zero.zero_grad()`.

Gradients are read from `p.main_grad` when present (fp32 accumulation, precision.py) else
`p.grad`; parameters may be bf16 (the master shard is fp32 regardless).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.clip import clip_grad_norm_
from autopar.runtime.collectives import (all_gather, group_rank, group_size,
                                         start_reduce_scatter)
from autopar.runtime.params import ParamInfo


@dataclass(frozen=True)
class _Segment:
    index: int          # which parameter
    lo: int             # [lo, hi) in that parameter's flattened elements
    hi: int
    shard_lo: int       # where it sits in my shard


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    return p.main_grad if hasattr(p, "main_grad") else p.grad


class ZeroOptimizer:
    """The user's optimizer over this dp rank's 1/d of the flattened parameters (see module)."""

    def __init__(self, params: Sequence[torch.Tensor], param_infos: Sequence[ParamInfo],
                 optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 group: Any, *, reduce_dtype: torch.dtype = torch.float32,
                 master_dtype: torch.dtype = torch.float32):
        self.params = list(params)
        self.param_infos = list(param_infos)
        if len(self.params) != len(self.param_infos):
            raise ValueError(f"ZeroOptimizer: {len(self.params)} params but "
                             f"{len(self.param_infos)} ParamInfos; pass one per parameter")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeroOptimizer: parameters have dtypes {sorted(map(str, dtypes))}; "
                             f"the flat buffer needs one dtype — cast the model first")
        self.group, self.d, self.rank = group, group_size(group), group_rank(group)
        self.reduce_dtype = reduce_dtype
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.shard_numel = -(-n // self.d) if n else 0          # S = ceil(N / d)
        self.segments = self._segments()
        self.master = [self._master_piece(s, master_dtype) for s in self.segments]
        self.optimizer = optimizer_factory(list(self.master))
        self._shard_grad: torch.Tensor | None = None
        self._pending: Callable[[], torch.Tensor] | None = None  # waits for the reduce-scatter

    def _segments(self) -> list[_Segment]:
        lo_shard, hi_shard = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            lo, hi = max(off, lo_shard), min(off + p.numel(), hi_shard)
            if lo < hi:
                out.append(_Segment(i, lo - off, hi - off, lo - lo_shard))
        return out

    def _master_piece(self, s: _Segment, dtype: torch.dtype) -> torch.nn.Parameter:
        flat = self.params[s.index].detach().reshape(-1)
        return torch.nn.Parameter(flat[s.lo:s.hi].to(dtype).clone())

    # ---- the step -----------------------------------------------------------------------
    def reduce_grads(self, async_op: bool = False) -> None:
        """Reduce-scatter the flat gradients; my shard's average becomes the master grads.

        async_op=True launches the reduce-scatter and returns at once (breadth-first: a chunk's
        reduction overlaps the backward of the chunks below it); the first use of the master
        grads (finish_reduce, clip, step) waits for it.
        """
        self.finish_reduce()
        S, d = self.shard_numel, self.d
        device = self.params[0].device if self.params else "cpu"
        flat = torch.zeros(S * d, dtype=self.reduce_dtype, device=device)   # (N',)
        for p, off in zip(self.params, self.offsets):
            g = _grad_of(p)
            if g is not None:
                flat[off:off + p.numel()].copy_(g.reshape(-1))
        if d == 1:
            self._set_shard_grad(flat)                                        # (S,)
            return
        self._pending = start_reduce_scatter(flat, 0, self.group)   # holds flat until the wait
        if not async_op:
            self.finish_reduce()

    def finish_reduce(self) -> None:
        """Wait for an async reduce-scatter launched by reduce_grads(async_op=True)."""
        if self._pending is None:
            return
        wait, self._pending = self._pending, None
        self._set_shard_grad(wait())                                          # (S,)

    def _set_shard_grad(self, shard: torch.Tensor) -> None:
        if self.d > 1:
            shard.div_(self.d)
        self._shard_grad = shard
        for s, m in zip(self.segments, self.master):
            has = _grad_of(self.params[s.index]) is not None
            m.grad = shard[s.shard_lo:s.shard_lo + s.hi - s.lo].to(m.dtype) if has else None

    def clip_grad_norm_(self, max_norm: float, groups: Any) -> torch.Tensor:
        """Global-norm clipping of the sharded gradients (sums over dp too); returns the norm."""
        self.finish_reduce()
        if self._shard_grad is None:
            self.reduce_grads()
        infos = [self.param_infos[s.index] for s in self.segments]
        return clip_grad_norm_(self.master, infos, max_norm, groups, dp_sharded=True,
                               real_parts=False)

    @torch.no_grad()
    def step(self) -> None:
        """Step my shard with the user's optimizer, then all-gather the updated parameters."""
        self.finish_reduce()
        if self._shard_grad is None:
            self.reduce_grads()
        self.optimizer.step()
        self.publish()

    def publish(self) -> None:
        """After the optimizer stepped my shard: all-gather every shard into the parameters
        (ChunkedZero steps one optimizer over several shards, then publishes each)."""
        self._shard_grad = None
        self._all_gather_params()

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        if not self.params:
            return
        dtype, device = self.params[0].dtype, self.params[0].device
        mine = torch.zeros(self.shard_numel, dtype=dtype, device=device)    # (S,)
        for s, m in zip(self.segments, self.master):
            mine[s.shard_lo:s.shard_lo + s.hi - s.lo].copy_(m)
        full = all_gather(mine, 0, self.group) if self.d > 1 else mine     # (N',)
        for p, off in zip(self.params, self.offsets):
            p.copy_(full[off:off + p.numel()].view_as(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.master:
            m.grad = None
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        self._shard_grad = None

    # ---- memory and checkpoints ---------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer-state tensors (Adam's m, v, step ...)."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))

    def gathered_masters(self) -> list[torch.Tensor]:
        """The fp32 master weights shaped like each local parameter (all-gathers over dp;
        collective): what a checkpoint saves under bf16."""
        device = self.params[0].device if self.params else "cpu"
        mine = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        for s, m in zip(self.segments, self.master):
            mine[s.shard_lo:s.shard_lo + s.hi - s.lo].copy_(m.detach().reshape(-1))
        full = all_gather(mine, 0, self.group) if self.d > 1 else mine
        return [full[off:off + p.numel()].view_as(p).clone()
                for p, off in zip(self.params, self.offsets)]

    def load_masters(self, weights: Sequence[torch.Tensor]) -> None:
        """Set my master shard from full-precision tensors shaped like each local parameter
        (no communication; exact under bf16, where the parameters hold rounded values)."""
        with torch.no_grad():
            for s, m in zip(self.segments, self.master):
                m.copy_(weights[s.index].detach().reshape(-1)[s.lo:s.hi])

    def gathered_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{ParamInfo.key: {state name: tensor shaped like the local parameter, or a scalar}}:
        the unsharded optimizer state of this rank's parameters (all-gathers over dp;
        collective). The form checkpoint.save_checkpoint takes as `optimizer_state`."""
        names, scalars = self._state_names()
        out: dict[str, dict[str, torch.Tensor]] = {}
        device = self.params[0].device if self.params else "cpu"   # NCCL needs device tensors
        for name in names:
            mine = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
            for s, m in zip(self.segments, self.master):
                v = self.optimizer.state.get(m, {}).get(name)
                if v is not None:
                    mine[s.shard_lo:s.shard_lo + s.hi - s.lo].copy_(v.reshape(-1))
            full = all_gather(mine, 0, self.group) if self.d > 1 else mine
            for p, off, info in zip(self.params, self.offsets, self.param_infos):
                out.setdefault(info.key, {})[name] = full[off:off + p.numel()].view_as(p).clone()
        for name, value in scalars.items():
            for info in self.param_infos:
                out.setdefault(info.key, {})[name] = value.clone()
        return out

    def _state_names(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Per-element state names, and scalar states (one value, e.g. Adam's step), agreed
        over dp (a rank whose segments have no state yet still takes part)."""
        tensors: set[str] = set()
        scalars: dict[str, torch.Tensor] = {}
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    tensors.add(k)
                elif isinstance(v, torch.Tensor):
                    scalars.setdefault(k, v.detach())
        if self.d > 1:
            agreed: list[Any] = [None] * self.d
            dist.all_gather_object(agreed, (sorted(tensors),
                                            {k: float(v) for k, v in scalars.items()}),
                                   group=self.group)
            tensors = set().union(*(set(a[0]) for a in agreed))
            merged: dict[str, float] = {}
            for a in agreed:
                merged.update(a[1])
            scalars = {k: torch.tensor(v, dtype=torch.float32) for k, v in merged.items()}
        return sorted(tensors), scalars

    def load_gathered_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of gathered_state: take my shard's pieces (no communication)."""
        for s, m in zip(self.segments, self.master):
            key = self.param_infos[s.index].key
            if key not in state:
                raise ValueError(f"load_gathered_state: no optimizer state for {key!r}")
            st = {}
            for name, v in state[key].items():
                if v.dim() == 0:
                    st[name] = v.detach().clone().to(torch.float32)
                else:
                    st[name] = v.detach().reshape(-1)[s.lo:s.hi].clone().to(m.dtype)
            self.optimizer.state[m] = st
