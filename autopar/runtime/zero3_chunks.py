"""Weights, gradients and optimizer states sharded per chunk over the data group (ZeRO-3 /
FSDP), under any schedule whose backward is not split (all but interleaved-zb).

Math (Rajbhandari et al. 1910.02054 §5, stage P_os+g+p; Lamy-Poirier 2106.02679 §4,
2211.05953 §3): chunk c's N_c parameter elements are laid end to end in one flat buffer padded
to N'_c = d·S_c, S_c = ceil(N_c / d); data-parallel rank r owns [r·S_c, (r+1)·S_c) as fp32
master weights (and, through the user's optimizer, 1/d of Adam's m and v). A step is

    whenever chunk c is about to compute and is not gathered:
        W_c = all_gather(shard_c)            # (N'_c,) into the chunk's flat buffer
    when chunk c is released (capacity, or its last compute of the step):
        g_c += reduce_scatter(flat grads_c) / d   # (S_c,) if it ran backwards since
        free W_c and the full gradients      # storage resized to 0 bytes
    optimizer.step() on the shards           # elementwise ⇒ exactly the unsharded AdamW

`autopar.weight_gathers.plan_gathers(actions, keep=K)` says where on a rank's action list: at most K chunks gathered
at once (the computing one and the one prefetched for the next compute), the one whose next
use is furthest released first. K = 2 is ZeRO-3: breadth-first gathers a chunk once per pass
(2v − 2 per step: the two top chunks stay gathered across the forward→backward turn), the
interleaved orders once per visit of a group of N micro-batches, 1F1B once per step. K = v is
the FSDP variant without resharding after forward (Plan.zero = 2, "ZeRO-2" in torchtitan's
words): each chunk gathered once, kept until its last backward, reduced once.

Memory kept per rank: the fp32 shard of every chunk (4·N/d bytes + the optimizer's state on
it), at most K gathered chunks at a time, the full gradients of the gathered chunks that ran
backwards since their last reduce-scatter, and the send buffers of reduce-scatters in flight.

Mixed precision (param_dtype=bf16, as FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)): the shard stays the fp32 master (what the optimizer steps, what
full_parameters and checkpoints return); `gather` casts it to bf16 *before* the all-gather, so
the collective moves 2 bytes per element into a bf16 flat buffer the parameters view. Autograd
gives bf16 gradients; a post-accumulate-grad hook folds each backward's into an fp32
`main_grad` allocated at the chunk's first backward of a visit (FSDP2 accumulates unsharded
gradients in reduce_dtype the same way, _fsdp_param.py to_accumulated_grad_if_needed) and
freed at its reduce-scatter, which sums those fp32 buffers over d in fp32. Why fp32 before the
reduction, not after: the single-device bf16 reference (runtime/precision.py) folds every
micro-batch's bf16 gradient into an fp32 main_grad, so summing micro-batches or replicas in
bf16 would round where the reference does not; in fp32 the two differ only by the order of
fp32 additions. Memory: the gathered chunk costs 2 bytes per element, its unreduced gradient
4 (the fp32 accumulation) while it runs backwards.

FP8 all-gather (`fp8=Fp8Gather(...)`, tensorwise FP8 under bf16, torchao's FSDP2
enable_fsdp_float8_all_gather): the weights only FP8 linears read form a second part of their
chunk, with its own flat layout and masters. Its gather casts the bf16 shard to e4m3 with each
weight's amax MAX-reduced over the data group and the groups its splits lie in (one all-reduce
per group, cached until the step changes the masters), all-gathers the 1-byte elements (half
bf16's traffic) and hands each parameter its (e4m3 view, inverse scale) under
runtime.fp8.FP8_WEIGHT, which fp8_linear uses as cast: the same bytes it would cast from the
bf16 weight, so the run is exactly the bf16-gathered one. The parameters view a bf16 buffer
that is never filled (0 bytes): their gradients arrive and reduce as the other part's.

How a chunk's weights are freed without breaking autograd (FSDP's trick): at construction
every parameter is re-pointed (`p.data = flat[off:off+n].view(shape)`) into its chunk's flat
buffer; `release` resizes that buffer's storage to 0 bytes and `gather` resizes it back and
all-gathers into it. Parameters keep their identity and shape, and the weights autograd saved in
the forward pass (views of the same storage) are valid again once the backward pass's gather
has run. Released weights have 0-byte storage: reading them crashes, so the runtime calls
`wait(c)` before each compute of c, which raises ValueError on a released chunk.

Runtime calls (autopar.runtime.regimes.zero3 runs the plan from the executor's hooks):
GATHER → `gather(c, async_op=True)`; before every compute of chunk c → `wait(c)` (no-op unless
a prefetch is in flight); REDUCE_SCATTER → `reduce_scatter_grads(c, async_op=True)`; RELEASE →
`release(c)`; after the schedule → `finish_reduces()`, `step()` (steps the shards),
`zero_grad()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import group_rank, group_size, start_reduce_scatter
from autopar.runtime.dist import peer_guard
from autopar.runtime.flat_shard import (FlatLayout, OptimState, Segment, gathered_state,
                                         load_state)
from autopar.runtime.fp8 import E4M3, FP8_WEIGHT, fp8_shard_cast
from autopar.runtime.precision import grad_of
from autopar.weight_gathers import GATHER, REDUCE_SCATTER, RELEASE

# ---- the runtime object ------------------------------------------------------------------
@dataclass(eq=False)
class _Chunk:
    params: list[torch.nn.Parameter]
    names: list[str]
    layout: FlatLayout
    flat: torch.Tensor              # (d·S,) gathered weights; storage 0 bytes when released
    master: list[torch.nn.Parameter]  # fp32 pieces of my shard, one per segment
    accumulates: bool = False       # params' main_grad is this object's fp32 accumulation
    gathered: bool = False
    pending: Any = None             # (work, send buffer) of an in-flight gather
    rs: Any = None                  # (wait, which parameters had gradients) of a reduce-scatter
    reduced: bool = False           # reduce-scattered at least once this step
    fp8: "_Chunk | None" = None     # the part gathered in FP8 (Fp8Gather), if any
    shell: torch.Tensor | None = None   # FP8 part: the bf16 buffer its parameters view (0 B)
    amax: torch.Tensor | None = None    # FP8 part: its weights' amaxes, until the next step

    @property
    def segments(self) -> list[Segment]:
        return self.layout.segments


@dataclass(frozen=True, kw_only=True)
class Fp8Gather:
    """Which parameters are all-gathered in FP8 (module docstring): `weights`, their ids (the
    weights only tensorwise FP8 linears read), and `amax_groups`, the groups besides the data
    group that hold parts of each (the tensor group)."""
    weights: frozenset
    amax_groups: tuple = ()


def _all_gather_into(out: torch.Tensor, mine: torch.Tensor, group: Any, async_op: bool) -> Any:
    """All-gather `mine` into the existing buffer `out` (dist.all_gather_single where torch
    has it: 2.13 deprecates all_gather_into_tensor)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=async_op)


def _free_grads(p: torch.Tensor, accumulates: bool) -> None:
    """Forget p's full gradient: .grad, and its main_grad — freed when it is the chunk's own
    accumulation (`accumulates`: reallocated at the next backward), zeroed when someone else
    owns it (runtime/precision.py's)."""
    if accumulates:
        p.main_grad = None
    elif hasattr(p, "main_grad"):
        p.main_grad.zero_()
    p.grad = None


def _accumulate_in(dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
    """Post-accumulate-grad hook: fold this backward's low-precision .grad into p.main_grad
    in `dtype`, allocated at the first backward since the chunk's last reduce-scatter."""
    def fold(p: torch.Tensor) -> None:
        with torch.no_grad():
            if p.main_grad is None:
                p.main_grad = p.grad.to(dtype, copy=True)
            else:
                p.main_grad.add_(p.grad)
        p.grad = None
    return fold


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class Zero3Chunks:
    """Chunk-wise sharded weights, gradients and optimizer state over a dp `group` (module doc).

    chunk_params: {chunk id: parameters} (or a list, chunk id = position) — this rank's chunks;
    a parameter may belong to one chunk only. names: same layout, the parameters' names (only
    for messages); optional. optimizer_factory(list of fp32 shard pieces) -> optimizer; it must
    be elementwise (SGD, Adam, AdamW) for the unsharded numbers. param_dtype: the dtype the
    parameters compute in and the all-gather moves (None: the parameters' own; bf16 for mixed
    precision — module doc); the masters are master_dtype, the reductions reduce_dtype.
    fp8: the parameters gathered in FP8 (Fp8Gather; bf16 param_dtype only; a chunk whose
    parameters are all FP8 ones gathers them in bf16).
    divide_by: the divisor of the summed gradients (None: the group's size d).
    """

    def __init__(self, chunk_params: Mapping[int, Sequence[torch.nn.Parameter]]
                 | Sequence[Sequence[torch.nn.Parameter]], group: Any,
                 optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 names: Mapping[int, Sequence[str]] | Sequence[Sequence[str]] | None = None,
                 master_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype = torch.float32,
                 param_dtype: torch.dtype | None = None, fp8: Fp8Gather | None = None,
                 divide_by: int | None = None):
        """Why this size: the chunks' parameters, group and optimizer, then keyword options of
        the sharding (names, master / reduce dtypes, FP8 gathers, the divisor) ZeRO-2/3 read."""
        cp = dict(chunk_params) if isinstance(chunk_params, Mapping) else dict(
            enumerate(chunk_params))
        nm = (dict(names) if isinstance(names, Mapping) else dict(enumerate(names))
              ) if names is not None else {}
        self.group, self.d, self.rank = group, group_size(group), group_rank(group)
        # the summed gradient's divisor: d, or c·d for experts reduced over the c·d/ep ranks
        # of their expert-data group (see autopar.runtime.data_parallel)
        self.divisor = divide_by or self.d
        self.master_dtype, self.reduce_dtype = master_dtype, reduce_dtype
        if param_dtype is not None and not param_dtype.is_floating_point:
            raise ValueError(f"Zero3Chunks: param_dtype={param_dtype}: must be a floating "
                             f"dtype (torch.bfloat16 for mixed precision), or None for the "
                             f"parameters' own")
        self.param_dtype = param_dtype
        if fp8 is not None and fp8.weights and param_dtype != torch.bfloat16:
            raise ValueError(f"Zero3Chunks: fp8 with param_dtype={param_dtype}: the FP8 gather "
                             f"casts the bf16 weights; pass param_dtype=torch.bfloat16 (or "
                             f"fp8=None)")
        self.fp8 = fp8
        seen: dict[int, int] = {}
        for c, params in cp.items():    # validate everything before re-pointing anything
            for p in params:
                if id(p) in seen:
                    raise ValueError(f"Zero3Chunks: a parameter of shape {tuple(p.shape)} is in "
                                     f"chunks {seen[id(p)]} and {c}; each parameter must belong "
                                     f"to exactly one chunk (untie shared weights, or keep "
                                     f"them out of ZeRO-3)")
                seen[id(p)] = c
                need = (p.storage_offset() + p.numel()) * p.element_size()
                if _nbytes(p) < need:
                    raise ValueError(f"Zero3Chunks: a parameter of shape {tuple(p.shape)} in "
                                     f"chunk {c} has no storage (already sharded by another "
                                     f"Zero3Chunks and released?); pass parameters that hold "
                                     f"their weights")
        self.chunks: dict[int, _Chunk] = {
            c: self._build_parts(c, list(params), list(nm.get(c, []))) for c, params in cp.items()}
        self.optimizer = optimizer_factory([m for _, ch in self.parts() for m in ch.master])
        self.num_gathers = 0          # all-gathers issued by this object (d > 1)
        self.num_reduce_scatters = 0

    def _build_parts(self, c: int, params: list[torch.nn.Parameter],
                     names: list[str]) -> _Chunk:
        """Chunk c, its FP8 weights (if some, not all) a second part (module docstring)."""
        names = names if len(names) == len(params) else [f"chunk{c}.param{i}"
                                                         for i in range(len(params))]
        ids = self.fp8.weights if self.fp8 is not None else frozenset()
        low = {i for i, p in enumerate(params) if id(p) in ids}
        if not low or len(low) == len(params):
            return self._build(c, params, names)
        rest = [i for i in range(len(params)) if i not in low]
        ch = self._build(c, [params[i] for i in rest], [names[i] for i in rest])
        ch.fp8 = self._build(c, [params[i] for i in sorted(low)],
                             [names[i] for i in sorted(low)], fp8=True)
        return ch

    def parts(self) -> list[tuple[int, _Chunk]]:
        """(chunk id, part) of every chunk's parts: its bf16 (or own-dtype) one, then its FP8
        one if it has one."""
        return [(c, part) for c in sorted(self.chunks) for part in self._parts(self.chunks[c])]

    @staticmethod
    def _parts(ch: _Chunk) -> list[_Chunk]:
        return [ch] if ch.fp8 is None else [ch, ch.fp8]

    def _build(self, c: int, params: list[torch.nn.Parameter], names: list[str],
               fp8: bool = False) -> _Chunk:
        if not params:
            raise ValueError(f"Zero3Chunks: chunk {c} has no parameters; leave it out")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"Zero3Chunks: chunk {c} mixes dtypes {sorted(map(str, dtypes))} / "
                             f"devices {sorted(map(str, devices))}; one flat buffer needs one of "
                             f"each — cast / move the model first")
        layout = FlatLayout([p.numel() for p in params], self.d, self.rank)
        # the masters from the given weights, before re-pointing casts them to param_dtype
        master = [torch.nn.Parameter(piece.detach().to(self.master_dtype).clone())
                  for piece in layout.pieces(params)]
        flat = torch.zeros(layout.shard_numel * self.d, dtype=self.param_dtype or params[0].dtype,
                           device=params[0].device)                          # (d·S,)
        with torch.no_grad():
            for p, view in zip(params, layout.split(flat)):
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)                # re-point into the flat buffer
        accumulates = flat.dtype != self.reduce_dtype     # fp32 accumulation (module doc)
        shell = None
        if fp8:            # the parameters view `shell` (never filled); gathers fill `flat`
            shell, flat = flat, torch.zeros(flat.numel(), dtype=E4M3, device=flat.device)
            shell.untyped_storage().resize_(0)
        if accumulates:
            for p in params:
                p.main_grad = None
                if p.requires_grad:                        # a frozen weight gets no gradient
                    p.register_post_accumulate_grad_hook(_accumulate_in(self.reduce_dtype))
        names = names if len(names) == len(params) else [f"chunk{c}.param{i}"
                                                         for i in range(len(params))]
        ch = _Chunk(params, names, layout, flat, master, accumulates=accumulates, shell=shell)
        self._free(ch)
        return ch

    # ---- weights -------------------------------------------------------------------------
    def _get(self, c: int) -> _Chunk:
        if c not in self.chunks:
            raise ValueError(f"Zero3Chunks: chunk {c} is not one of this rank's chunks "
                             f"{sorted(self.chunks)}; pass the chunk ids of the schedule")
        return self.chunks[c]

    @torch.no_grad()
    def gather(self, c: int, async_op: bool = False) -> Any:
        """All-gather chunk c's weights into its parameters. async_op: return the work handle
        (or None when nothing is in flight); `wait(c)` must run before the weights are used."""
        ch = self._get(c)
        if ch.gathered:
            raise ValueError(f"Zero3Chunks.gather({c}): chunk {c} is already gathered; release "
                             f"it first (each pass gathers once — see plan_gathers)")
        return [self._gather(part, async_op) for part in self._parts(ch)][0]

    def _gather(self, ch: _Chunk, async_op: bool) -> Any:
        """All-gather one part (an FP8 one cast first: module docstring)."""
        low = ch.shell.dtype if ch.shell is not None else ch.flat.dtype
        mine = ch.layout.shard(ch.master, low, ch.flat.device)                      # (S,)
        ch.flat.untyped_storage().resize_(ch.flat.numel() * ch.flat.element_size())
        ch.gathered = True
        out = ch.flat
        if ch.shell is not None:
            groups = (self.group, *(self.fp8.amax_groups if self.fp8 else ()))
            mine, ch.amax, inv = fp8_shard_cast(mine, ch.segments, len(ch.params), groups,
                                                ch.amax)
            for i, (p, view) in enumerate(zip(ch.params, ch.layout.split(ch.flat))):
                setattr(p, FP8_WEIGHT, (view.view(p.shape), inv[i]))
            out, mine = ch.flat.view(torch.uint8), mine.view(torch.uint8)   # gloo: bytes
        if self.d == 1:
            out.copy_(mine)
            return None
        with peer_guard("ZeRO-3 weight all-gather with", self.group):
            work = _all_gather_into(out, mine, self.group, async_op)
        self.num_gathers += 1
        if not async_op:
            return None
        ch.pending = (work, mine)
        return work

    def wait(self, c: int) -> None:
        """Block until chunk c's in-flight gather (if any) has landed. Call before every
        compute of chunk c: it also raises if the chunk is released (released weights have
        0-byte storage, and reading them would crash instead of raising)."""
        ch = self._get(c)
        if not ch.gathered:
            raise ValueError(f"Zero3Chunks: chunk {c}'s weights are released; gather({c}) "
                             f"must run before its compute (see plan_gathers)")
        for part in self._parts(ch):
            if part.pending is not None:
                with peer_guard("ZeRO-3 weight all-gather with", self.group):
                    part.pending[0].wait()
                part.pending = None

    def release(self, c: int) -> None:
        """Free chunk c's gathered weights (the local shard stays)."""
        ch = self._get(c)
        if not ch.gathered:
            raise ValueError(f"Zero3Chunks.release({c}): chunk {c} is not gathered")
        self.wait(c)      # a gather still in flight writes into the buffer: land it first
        for part in self._parts(ch):
            self._free(part)

    @staticmethod
    def _free(ch: _Chunk) -> None:
        ch.flat.untyped_storage().resize_(0)
        ch.gathered = False

    # ---- gradients and the step ----------------------------------------------------------
    @torch.no_grad()
    def run(self, op: str, c: int) -> None:
        """Carry out one op of plan_gathers for chunk c (collectives launched asynchronously)."""
        if op == GATHER:
            self.gather(c, async_op=True)
        elif op == RELEASE:
            self.release(c)
        elif op == REDUCE_SCATTER:
            self.reduce_scatter_grads(c, async_op=True)
        else:
            raise ValueError(f"Zero3Chunks.run: op={op!r} must be one of "
                             f"{(GATHER, RELEASE, REDUCE_SCATTER)}")

    def reduce_scatter_grads(self, c: int, async_op: bool = False) -> None:
        """Reduce-scatter chunk c's gradients accumulated since its last reduce-scatter into
        my shard's gradient — averaged over d, added to what this step's earlier
        reduce-scatters of c gave (a chunk released between visits is reduced once per
        visit) — and free the full gradients. async_op: finish_reduces waits for it."""
        for part in self._parts(self._get(c)):
            self._reduce_scatter(part, async_op)

    def _reduce_scatter(self, ch: _Chunk, async_op: bool) -> None:
        if ch.rs is not None:
            self._finish_reduce(ch)                         # one in flight per chunk
        grads = [grad_of(p) for p in ch.params]
        has = [g is not None for g in grads]
        flat = ch.layout.flatten(grads, self.reduce_dtype, ch.flat.device)          # (d·S,)
        for p in ch.params:
            _free_grads(p, ch.accumulates)                  # the full gradient is freed
        if self.d == 1:
            wait: Callable[[], torch.Tensor] = lambda: flat                      # noqa: E731
        else:
            wait = start_reduce_scatter(flat, 0, self.group)                    # (S,)
            self.num_reduce_scatters += 1
        ch.rs = (wait, has)
        if not async_op:
            self._finish_reduce(ch)

    def _finish_reduce(self, ch: _Chunk) -> None:
        wait, has = ch.rs
        out = wait()
        if self.divisor > 1:
            out.div_(self.divisor)
        for s, m in zip(ch.segments, ch.master):
            if has[s.param]:
                piece = out[s.shard_lo:s.shard_lo + s.hi - s.lo].to(m.dtype)
                m.grad = piece if m.grad is None else m.grad.add_(piece)
        ch.rs = None
        ch.reduced = True

    def finish_reduces(self) -> None:
        """Wait for every in-flight reduce-scatter; the shard pieces' .grad are then final.
        A chunk never reduced this step is reduced now (a plan without its reduce-scatter).
        Idempotent within a step: chunks already finished are left alone, so a caller may
        finish the reduces, clip the shard gradients, then call step()."""
        for _, ch in self.parts():
            if ch.rs is None and not ch.reduced:
                self._reduce_scatter(ch, False)
            if ch.rs is not None:
                self._finish_reduce(ch)

    @torch.no_grad()
    def step(self) -> None:
        """Finish the reduce-scatters and run the optimizer on my shards. The new weights reach
        the parameters at each chunk's next gather; chunks must be released by now."""
        self.check_released()
        self.finish_reduces()
        self.optimizer.step()
        self.stepped()

    def check_released(self) -> None:
        """Before the optimizer steps the masters: no chunk may still be gathered."""
        live = [c for c, ch in self.chunks.items() if ch.gathered]
        if live:
            raise ValueError(f"Zero3Chunks.step: chunks {live} are still gathered; their "
                             f"weights would go stale — release them first (plan_gathers "
                             f"releases every chunk after its last backward)")

    def stepped(self) -> None:
        """The optimizer has stepped the masters (by step(), or by the regime that shares one
        optimizer between Zero3Chunks): new masters, new FP8 amaxes."""
        for _, ch in self.parts():
            ch.reduced, ch.amax = False, None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for _, ch in self.parts():
            ch.reduced = False
            for p in ch.params:
                _free_grads(p, ch.accumulates)

    # ---- inspection ----------------------------------------------------------------------
    def shard_bytes(self) -> int:
        """Bytes of this rank's master shards (what persists between steps, besides the
        optimizer state)."""
        return sum(m.numel() * m.element_size() for _, ch in self.parts() for m in ch.master)

    def gathered_bytes(self) -> int:
        """Bytes of full weights held right now (0 between steps)."""
        return sum(_nbytes(ch.flat) for _, ch in self.parts())

    def gathered_state(self) -> OptimState:
        """{name: {state name: tensor shaped like the parameter, or a scalar}} of every chunk's
        parameters: the unsharded optimizer state (all-gathers over dp; collective)."""
        out: OptimState = {}
        for _, ch in self.parts():
            out.update(gathered_state(ch.layout, ch.master, self.optimizer,
                                      [p.shape for p in ch.params], ch.names, self.group,
                                      ch.flat.device))
        return out

    def load(self, weights: Mapping[str, torch.Tensor], state: OptimState) -> None:
        """Set every chunk's shard from full fp32 weights by parameter name, and (if given)
        its optimizer state from the unsharded state (no communication; inverse of
        full_parameters / gathered_state). Chunks must be released."""
        with torch.no_grad():
            for _, ch in self.parts():
                ch.amax = None
                for m, piece in zip(ch.master, ch.layout.pieces(
                        [weights[n].reshape(-1) for n in ch.names])):
                    m.copy_(piece)
                if state:
                    load_state(ch.layout, ch.master, self.optimizer, ch.names, state)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 weight} of every chunk (gathers; collective; for checks and
        checkpoints — every dp rank must call it). Under mixed precision the fp32 masters are
        gathered (the bf16 buffer is their rounding)."""
        out = {}
        if self.param_dtype not in (None, self.master_dtype):
            for _, ch in self.parts():
                full = ch.layout.gather(ch.master, self.group, self.master_dtype,
                                        ch.flat.device, [p.shape for p in ch.params])
                out.update(zip(ch.names, full))
            return out
        for c, ch in sorted(self.chunks.items()):
            was = ch.gathered
            if was:
                self.wait(c)
            else:
                self.gather(c)
            for p, name in zip(ch.params, ch.names):
                out[name] = p.detach().to(torch.float32).clone()
            if not was:
                self.release(c)
        return out
