"""ZeRO-1: optimizer states (and fp32 master weights) sharded over the data-parallel group.

Math (Rajbhandari et al. 1910.02054 §5.1, stage P_os): the d replicas' parameters are laid end
to end in one flat buffer of N elements, padded to N' = d·S, S = ceil(N / d); dp rank r owns
the contiguous shard [r·S, (r+1)·S) (autopar.runtime.flat_shard.FlatLayout). A step is

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

Memory (Megatron-Core's contiguous gradient buffer): the gradients accumulate in place in one
flat buffer of N' elements that lives for the run (the 4 gradient bytes per parameter the cost
model counts): `main_grad` is a view of it (`bind_main_grads`), and an fp32 `.grad` becomes one
at its first accumulation. The reduce-scatter reads it without a copy, and the updated weights
are all-gathered into its storage (free again once the shard's gradients are taken), so a step
allocates no full-size buffer beside it: 2·S elements (the reduced and the updated shard).
zero_grad zeroes it, once a step: only when something wrote into it since.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from autopar.runtime.clip import clip_grad_norm_
from autopar.runtime.collectives import all_gather, group_rank, group_size, start_reduce_scatter
from autopar.runtime.flat_shard import FlatLayout, OptimState, gathered_state, load_state
from autopar.runtime.hooks import weak_hook
from autopar.runtime.params import ParamInfo
from autopar.runtime.precision import adopt_grad, grad_of, home_main_grad


class ZeroOptimizer:
    """The user's optimizer over this dp rank's 1/d of the flattened parameters (see module)."""

    def __init__(self, params: Sequence[torch.Tensor], param_infos: Sequence[ParamInfo],
                 optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 group: Any, *, reduce_dtype: torch.dtype = torch.float32,
                 master_dtype: torch.dtype = torch.float32, divide_by: int | None = None):
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
        # the summed gradient's divisor: d, or c·d for experts reduced over the c·d/ep ranks
        # of their expert-data group (see autopar.runtime.data_parallel)
        self.divisor = divide_by or self.d
        self.reduce_dtype = reduce_dtype
        self.layout = FlatLayout([p.numel() for p in self.params], self.d, self.rank)
        self.segments = self.layout.segments
        self.master = [torch.nn.Parameter(piece.to(master_dtype).clone())
                       for piece in self.layout.pieces([p.detach() for p in self.params])]
        self.optimizer = optimizer_factory(list(self.master))
        self._shard_grad: torch.Tensor | None = None
        self._pending: Callable[[], torch.Tensor] | None = None  # waits for the reduce-scatter
        # the gradients' home (module doc): (N',), each parameter's place a view of it
        self._flat = torch.zeros(self.layout.shard_numel * self.d, dtype=reduce_dtype,
                                 device=self._device)
        self._views = [x.view(p.shape) for x, p in zip(self.layout.split(self._flat),
                                                         self.params)]
        # whether anything wrote into it since it was last zeroed: zero_grad zeroes it only
        # then (a step calls zero_grad twice, the runner's and Zero1.step's, a memset each)
        self._dirty = False
        for p, view in zip(self.params, self._views):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(weak_hook(self._accumulated, view))

    def _accumulated(self, view: torch.Tensor, p: torch.Tensor) -> None:
        """After each accumulation of p's gradient: the buffer holds something now, and a
        fresh fp32 .grad moves into its view (precision.adopt_grad)."""
        self._dirty = True
        adopt_grad(p, view)

    def bind_main_grads(self) -> None:
        """Make each parameter's fp32 `main_grad` (MixedPrecision's) its view of the flat
        buffer; call after MixedPrecision is made, before the first backward."""
        for p, view in zip(self.params, self._views):
            if hasattr(p, "main_grad"):
                home_main_grad(p, view)
                self._dirty = True

    @property
    def _device(self) -> Any:
        return self.params[0].device if self.params else "cpu"   # NCCL needs device tensors

    # ---- the step -----------------------------------------------------------------------
    def reduce_grads(self, async_op: bool = False) -> None:
        """Reduce-scatter the flat gradients; my shard's average becomes the master grads.

        async_op=True launches the reduce-scatter and returns at once (breadth-first: a chunk's
        reduction overlaps the backward of the chunks below it); the first use of the master
        grads (finish_reduce, clip, step) waits for it.
        """
        self.finish_reduce()
        flat = self._flat                                                     # (N',)
        self._dirty = True              # the copies below, the fallback's in-place all-reduce
        with torch.no_grad():
            for p, view in zip(self.params, self._views):
                g = grad_of(p)      # one not accumulated in place (a tied copy's zeros)
                if g is not None and g.data_ptr() != view.data_ptr():
                    view.copy_(g)
        if self.d == 1:
            self._set_shard_grad(flat.clone())                                # (S,)
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
        if self.divisor > 1:
            shard.div_(self.divisor)
        self._shard_grad = shard
        for s, m in zip(self.segments, self.master):
            has = grad_of(self.params[s.param]) is not None
            m.grad = shard[s.shard_lo:s.shard_lo + s.hi - s.lo].to(m.dtype) if has else None

    def clip_grad_norm_(self, max_norm: float, groups: Any) -> torch.Tensor:
        """Global-norm clipping of the sharded gradients (sums over dp too); returns the norm."""
        self.finish_reduce()
        if self._shard_grad is None:
            self.reduce_grads()
        infos = [self.param_infos[s.param] for s in self.segments]
        return clip_grad_norm_(self.master, infos, max_norm, groups, dp_sharded=True,
                               real_parts=False, spans=[(s.lo, s.hi) for s in self.segments])

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
        for m in self.master:         # the shard's gradients are spent
            m.grad = None
        if not self.params:
            return
        with torch.no_grad():
            dtype = self.params[0].dtype
            # into the gradient buffer's storage, my shard in my slot of it (in place, as
            # NCCL allows): its gradients were taken (reduce_grads)
            room = (self._flat.view(dtype)[:self._flat.numel()]
                    if dtype.itemsize <= self._flat.dtype.itemsize and self.d > 1 else None)
            S = self.layout.shard_numel
            slot = room[self.rank * S:(self.rank + 1) * S] if room is not None else None
            mine = self.layout.shard(self.master, dtype, self._device, out=slot)   # (S,)
            full = all_gather(mine, 0, self.group, out=room) if self.d > 1 else mine
            for p, x in zip(self.params, self.layout.split(full)):             # (N',)
                p.copy_(x.view_as(p))
            self._dirty = True         # the weights, until zero_grad (the step's last call)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat buffer (main_grad with it); `.grad` None (or zeros), so that a
        parameter no micro-batch reaches is skipped as on one device."""
        for m in self.master:
            m.grad = None
        if self._dirty:
            self._flat.zero_()
            self._dirty = False
        for p, view in zip(self.params, self._views):
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
            if hasattr(p, "main_grad") and p.main_grad.data_ptr() != view.data_ptr():
                p.main_grad.zero_()          # not bound to the flat buffer (bind_main_grads)
        self._shard_grad = None

    # ---- memory and checkpoints ---------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer-state tensors (Adam's m, v, step ...)."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))

    def gathered_masters(self) -> list[torch.Tensor]:
        """The fp32 master weights shaped like each local parameter (all-gathers over dp;
        collective): what a checkpoint saves under bf16."""
        return self.layout.gather(self.master, self.group, torch.float32, self._device,
                                  [p.shape for p in self.params])

    def load_masters(self, weights: Sequence[torch.Tensor]) -> None:
        """Set my master shard from full-precision tensors shaped like each local parameter
        (no communication; exact under bf16, where the parameters hold rounded values)."""
        with torch.no_grad():
            for m, piece in zip(self.master, self.layout.pieces(list(weights))):
                m.copy_(piece)

    def gathered_state(self) -> OptimState:
        """{ParamInfo.key: {state name: tensor shaped like the local parameter, or a scalar}}:
        the unsharded optimizer state of this rank's parameters (all-gathers over dp;
        collective). The form checkpoint.save_checkpoint takes as `optimizer_state`."""
        return gathered_state(self.layout, self.master, self.optimizer,
                              [p.shape for p in self.params],
                              [info.key for info in self.param_infos], self.group, self._device)

    def load_gathered_state(self, state: OptimState) -> None:
        """Inverse of gathered_state: take my shard's pieces (no communication)."""
        load_state(self.layout, self.master, self.optimizer,
                   [info.key for info in self.param_infos], state)
