"""ZeRO-3-style weight sharding per chunk, for the breadth-first schedule (issue 6).

Math (Rajbhandari et al. 1910.02054 §5, stage P_os+g+p; Lamy-Poirier 2106.02679 §4,
2211.05953 §3): chunk c's N_c parameter elements are laid end to end in one flat buffer padded
to N'_c = d·S_c, S_c = ceil(N_c / d); data-parallel rank r owns [r·S_c, (r+1)·S_c) as fp32
master weights (and, through the user's optimizer, 1/d of Adam's m and v). A step is

    for each pass over chunk c (forward, then backward):
        W_c = all_gather(shard_c)            # (N'_c,) into the chunk's flat buffer
        ... all micro-batches of the pass ...
        free W_c                             # storage resized to 0 bytes
    after chunk c's last backward:
        g_c = reduce_scatter(flat grads_c) / d   # (S_c,) my shard's averaged gradient
    optimizer.step() on the shards           # elementwise ⇒ exactly the unsharded AdamW

Under breadth-first each chunk is gathered once per pass — 2 all-gathers and 1 reduce-scatter
per chunk per step whatever the number of micro-batches m — where a depth-first schedule
(1F1B / interleaved) would gather once per micro-batch visit (2106.02679 §4.2).

Memory kept per rank (what `plan_gathers` guarantees on a breadth-first list): the fp32 shard of
every chunk (4·N/d bytes + the optimizer's state on it), at most TWO gathered chunks at a time
(the one computing and the next one being prefetched), the full gradients of the chunk whose
backward pass is running, and the send buffer of reduce-scatters still in flight.

How a chunk's weights are freed without breaking autograd (FSDP's trick): at construction
every parameter is re-pointed (`p.data = flat[off:off+n].view(shape)`) into its chunk's flat
buffer; `release` resizes that buffer's storage to 0 bytes and `gather` resizes it back and
all-gathers into it. Parameters keep their identity and shape, and the weights autograd saved in
the forward pass (views of the same storage) are valid again once the backward pass's gather
has run. Released weights have 0-byte storage: reading them crashes, so the runtime calls
`wait(c)` before each compute of c, which raises ValueError on a released chunk.

Runtime calls (see `plan_gathers`): GATHER → `gather(c, async_op=True)`; before every compute
of chunk c → `wait(c)` (no-op unless a prefetch is in flight); RELEASE → `release(c)`;
REDUCE_SCATTER (the schedule's R{c} position) → `reduce_scatter_grads(c, async_op=True)`;
after the schedule → `step()` (waits for the reduce-scatters, steps the shards), `zero_grad()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import group_rank, group_size
from autopar.runtime.dist import peer_guard

GATHER, RELEASE, REDUCE_SCATTER = "GATHER", "RELEASE", "REDUCE_SCATTER"
_TOKEN = {GATHER: "AG", RELEASE: "FREE", REDUCE_SCATTER: "RS"}


# ---- the plan: pure, on action lists -----------------------------------------------------
def _passes(actions: Sequence[Any]) -> list[tuple[str, int, int, int]]:
    """Maximal runs of computes of one (kind, chunk): (kind, chunk, first pos, last pos)."""
    out: list[list] = []
    for n, a in enumerate(actions):
        if a.kind not in ("F", "B"):
            continue
        if out and out[-1][0] == a.kind and out[-1][1] == a.chunk:
            out[-1][3] = n
        else:
            out.append([a.kind, a.chunk, n, n])
    return [tuple(x) for x in out]


def plan_gathers(actions: Sequence[Any], *, keep_turn: bool = False
                 ) -> list[tuple[int, str, int]]:
    """Where a rank's weight gathers, releases and gradient reduce-scatters go.

    Returns (index, op, chunk) sorted by index: run `op` on `chunk` just before `actions[index]`
    (index == len(actions): after the last action). Ops at one index run in the listed order.

    A *pass* is a maximal run of the rank's computes of one kind on one chunk (breadth-first:
    one forward and one backward pass per chunk). Each pass gets one GATHER, issued (async) one
    compute before its first compute so it overlaps that compute (at index 0 for the rank's
    first pass; right at the pass start after a RELEASE of the same chunk, whose buffer cannot
    hold two copies), and one RELEASE right after its last compute. After a chunk's last
    backward: REDUCE_SCATTER, then the RELEASE. `keep_turn=True` keeps a chunk gathered
    between two back-to-back passes over it (the forward→backward turn of the top chunk),
    saving one all-gather per step. On a breadth-first list at most two chunks are gathered at
    once; other schedules get one gather per pass (many per step: use ZeRO-1 there).

        >>> from autopar.schedules import breadth_first
        >>> print(format_with_gathers(breadth_first(1, 2, 2)[0]))
        AG0 F0.0 AG1 F0.1 FREE0 F1.0 F1.1 FREE1 AG1 B1.0 AG0 B1.1 RS1 FREE1 R1 B0.0 B0.1 RS0 FREE0 R0
    """
    passes = _passes(actions)
    last_b = {c: last for kind, c, _, last in passes if kind == "B"}
    ops: list[tuple[int, int, int, str, int]] = []   # (index, phase, seq, op, chunk)
    for k, (kind, c, first, last) in enumerate(passes):
        prev = passes[k - 1] if k else None
        turn = prev is not None and prev[1] == c
        if not (turn and keep_turn):
            if prev is None:
                at = 0
            elif turn:
                at = first              # after the same chunk's RELEASE at this index
            else:
                at = prev[3]            # prefetch: before the previous pass's last compute
            ops.append((at, 2, k, GATHER, c))
        nxt = passes[k + 1] if k + 1 < len(passes) else None
        keep = keep_turn and nxt is not None and nxt[1] == c
        if kind == "B" and last_b[c] == last:
            ops.append((last + 1, 0, k, REDUCE_SCATTER, c))
        if not keep:
            ops.append((last + 1, 1, k, RELEASE, c))
    ops.sort()
    return [(i, op, c) for i, _, _, op, c in ops]


def format_with_gathers(actions: Sequence[Any], plan: Sequence[tuple[int, str, int]] | None
                        = None, *, keep_turn: bool = False) -> str:
    """One rank's actions with the plan's ops merged in: AG{c} gather, FREE{c} release,
    RS{c} reduce-scatter (default plan: `plan_gathers(actions, keep_turn=keep_turn)`)."""
    plan = plan_gathers(actions, keep_turn=keep_turn) if plan is None else plan
    at: dict[int, list[str]] = {}
    for i, op, c in plan:
        at.setdefault(i, []).append(f"{_TOKEN[op]}{c}")
    out: list[str] = []
    for n in range(len(actions) + 1):
        out += at.get(n, [])
        if n < len(actions):
            out.append(str(actions[n]))
    return " ".join(out)


def max_gathered(actions: Sequence[Any], plan: Sequence[tuple[int, str, int]]) -> int:
    """Most chunks gathered at once (in flight or in use) when `plan` runs on `actions`."""
    live: set[int] = set()
    most = 0
    for _, op, c in plan:
        if op == GATHER:
            live.add(c)
            most = max(most, len(live))
        elif op == RELEASE:
            live.discard(c)
    return most


# ---- the runtime object ------------------------------------------------------------------
@dataclass(frozen=True)
class _Segment:
    param: int          # index in the chunk's parameter list
    lo: int             # [lo, hi) of that parameter's flattened elements
    hi: int
    shard_lo: int       # where it sits in my shard


@dataclass(eq=False)
class _Chunk:
    params: list[torch.nn.Parameter]
    names: list[str]
    offsets: list[int]
    flat: torch.Tensor              # (d·S,) gathered weights; storage 0 bytes when released
    shard_numel: int                # S
    segments: list[_Segment]
    master: list[torch.nn.Parameter]  # fp32 pieces of my shard, one per segment
    gathered: bool = False
    pending: Any = None             # (work, send buffer) of an in-flight gather
    rs: Any = None                  # (work, output, send buffer) of an in-flight reduce-scatter
    reduced: bool = False           # this step's gradient shard is final (finish_reduces ran)


def _collective(op: str) -> Callable:
    """dist.{op}_single where torch has it (2.13 deprecates the *_tensor names), else
    dist.{op}_into_tensor / dist.{op}_tensor; looked up per call."""
    old = "all_gather_into_tensor" if op == "all_gather" else "reduce_scatter_tensor"
    return getattr(dist, f"{op}_single", None) or getattr(dist, old)


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class Zero3Chunks:
    """Chunk-wise sharded weights, gradients and optimizer state over a dp `group` (module doc).

    chunk_params: {chunk id: parameters} (or a list, chunk id = position) — this rank's chunks;
    a parameter may belong to one chunk only. names: same layout, the parameters' names (only
    for messages); optional. optimizer_factory(list of fp32 shard pieces) -> optimizer; it must
    be elementwise (SGD, Adam, AdamW) for the unsharded numbers.
    """

    def __init__(self, chunk_params: Mapping[int, Sequence[torch.nn.Parameter]]
                 | Sequence[Sequence[torch.nn.Parameter]], group: Any,
                 optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 names: Mapping[int, Sequence[str]] | Sequence[Sequence[str]] | None = None,
                 master_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype = torch.float32):
        cp = dict(chunk_params) if isinstance(chunk_params, Mapping) else dict(
            enumerate(chunk_params))
        nm = (dict(names) if isinstance(names, Mapping) else dict(enumerate(names))
              ) if names is not None else {}
        self.group, self.d, self.rank = group, group_size(group), group_rank(group)
        self.master_dtype, self.reduce_dtype = master_dtype, reduce_dtype
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
            c: self._build(c, list(params), list(nm.get(c, []))) for c, params in cp.items()}
        self.optimizer = optimizer_factory([m for ch in self.chunks.values() for m in ch.master])
        self.num_gathers = 0          # all-gathers issued by this object (d > 1)
        self.num_reduce_scatters = 0

    def _build(self, c: int, params: list[torch.nn.Parameter], names: list[str]) -> _Chunk:
        if not params:
            raise ValueError(f"Zero3Chunks: chunk {c} has no parameters; leave it out")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"Zero3Chunks: chunk {c} mixes dtypes {sorted(map(str, dtypes))} / "
                             f"devices {sorted(map(str, devices))}; one flat buffer needs one of "
                             f"each — cast / move the model first")
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        S = -(-n // self.d)
        flat = torch.zeros(S * self.d, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, off in zip(params, offsets):
                flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = flat[off:off + p.numel()].view(p.shape)    # re-point into the flat
        lo_shard, hi_shard = self.rank * S, (self.rank + 1) * S
        segs = []
        for i, (p, off) in enumerate(zip(params, offsets)):
            lo, hi = max(off, lo_shard), min(off + p.numel(), hi_shard)
            if lo < hi:
                segs.append(_Segment(i, lo - off, hi - off, lo - lo_shard))
        master = [torch.nn.Parameter(flat[lo_shard + s.shard_lo:lo_shard + s.shard_lo + s.hi
                                          - s.lo].to(self.master_dtype).clone())
                  for s in segs]
        names = names if len(names) == len(params) else [f"chunk{c}.param{i}"
                                                         for i in range(len(params))]
        ch = _Chunk(params, names, offsets, flat, S, segs, master)
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
        mine = torch.zeros(ch.shard_numel, dtype=ch.flat.dtype, device=ch.flat.device)  # (S,)
        for s, m in zip(ch.segments, ch.master):
            mine[s.shard_lo:s.shard_lo + s.hi - s.lo].copy_(m)
        ch.flat.untyped_storage().resize_(ch.flat.numel() * ch.flat.element_size())
        ch.gathered = True
        if self.d == 1:
            ch.flat.copy_(mine)
            return None
        with peer_guard("ZeRO-3 weight all-gather with", self.group):
            work = _collective("all_gather")(ch.flat, mine, group=self.group,
                                             async_op=async_op)
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
        if ch.pending is not None:
            with peer_guard("ZeRO-3 weight all-gather with", self.group):
                ch.pending[0].wait()
            ch.pending = None

    def release(self, c: int) -> None:
        """Free chunk c's gathered weights (the local shard stays)."""
        ch = self._get(c)
        if not ch.gathered:
            raise ValueError(f"Zero3Chunks.release({c}): chunk {c} is not gathered")
        self.wait(c)      # a gather still in flight writes into the buffer: land it first
        self._free(ch)

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

    def reduce_scatter_grads(self, c: int, async_op: bool = False) -> Any:
        """Reduce-scatter chunk c's accumulated gradients (its last backward has run) into my
        shard's gradient, averaged over d, and free the full gradients."""
        ch = self._get(c)
        if ch.rs is not None or ch.reduced:
            raise ValueError(f"Zero3Chunks.reduce_scatter_grads({c}): already issued this step")
        S, d = ch.shard_numel, self.d
        flat = torch.zeros(S * d, dtype=self.reduce_dtype, device=ch.flat.device)   # (d·S,)
        has = []
        for p, off in zip(ch.params, ch.offsets):
            g = _grad_of(p)
            has.append(g is not None)
            if g is not None:
                flat[off:off + p.numel()].copy_(g.reshape(-1))
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
            p.grad = None                                   # the full gradient is freed
        if d == 1:
            ch.rs = (None, flat, None, has)
            return None
        out = flat.new_empty(S)                                                     # (S,)
        with peer_guard("ZeRO-3 gradient reduce-scatter with", self.group):
            work = _collective("reduce_scatter")(out, flat, group=self.group,
                                                 async_op=async_op)
        self.num_reduce_scatters += 1
        ch.rs = (work if async_op else None, out, flat, has)
        return work if async_op else None

    def _finish_reduce(self, ch: _Chunk) -> None:
        work, out, _, has = ch.rs
        if work is not None:
            with peer_guard("ZeRO-3 gradient reduce-scatter with", self.group):
                work.wait()
        if self.d > 1:
            out.div_(self.d)
        for s, m in zip(ch.segments, ch.master):
            m.grad = out[s.shard_lo:s.shard_lo + s.hi - s.lo].to(m.dtype) if has[s.param] \
                else None
        ch.rs = None
        ch.reduced = True

    def finish_reduces(self) -> None:
        """Wait for every in-flight reduce-scatter; the shard pieces' .grad are then set.
        A chunk never reduced this step is reduced now (e.g. a schedule without R{c}).
        Idempotent within a step: chunks already finished are left alone, so a caller may
        finish the reduces, clip the shard gradients, then call step()."""
        for c in sorted(self.chunks):
            ch = self.chunks[c]
            if ch.reduced:
                continue
            if ch.rs is None:
                self.reduce_scatter_grads(c)
            self._finish_reduce(ch)

    @torch.no_grad()
    def step(self) -> None:
        """Finish the reduce-scatters and run the optimizer on my shards. The new weights reach
        the parameters at each chunk's next gather; chunks must be released by now."""
        live = [c for c, ch in self.chunks.items() if ch.gathered]
        if live:
            raise ValueError(f"Zero3Chunks.step: chunks {live} are still gathered; their "
                             f"weights would go stale — release them first (plan_gathers "
                             f"releases every chunk after its last backward)")
        self.finish_reduces()
        self.optimizer.step()
        for ch in self.chunks.values():
            ch.reduced = False

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for ch in self.chunks.values():
            ch.reduced = False
            for p in ch.params:
                p.grad = None

    # ---- inspection ----------------------------------------------------------------------
    def shard_bytes(self) -> int:
        """Bytes of this rank's master shards (what persists between steps, besides the
        optimizer state)."""
        return sum(m.numel() * m.element_size() for ch in self.chunks.values() for m in ch.master)

    def gathered_bytes(self) -> int:
        """Bytes of full weights held right now (0 between steps)."""
        return sum(_nbytes(ch.flat) for ch in self.chunks.values())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 weight} of every chunk (gathers; collective; for checks and
        checkpoints — every dp rank must call it)."""
        out = {}
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
