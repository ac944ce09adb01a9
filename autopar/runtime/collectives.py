"""Megatron's tensor- and sequence-parallel mappings and the pipeline's point-to-point helpers.

Conjugate pairs (1909.08053 §3, 2205.05198 §4.2), each an autograd.Function with the group
passed explicitly and an identity fast path for a group of one rank (`group=None` also means
one rank: a program compiled for t=1 runs without any process group):

    forward                      backward
    copy_to_tp  (f)   identity           all-reduce
    copy_to_tp_parts  identity           all-reduce of some rows (f on a mixed weight's
                                         replicated part)
    reduce_from_tp (g) all-reduce        identity
    scatter_to_sp     split along dim    all-gather along dim
    gather_from_sp    all-gather         split
    reduce_scatter_to_sp reduce-scatter  all-gather
    all_gather_sp     all-gather         reduce-scatter
    column_parallel   f or all_gather_sp, then the projections it feeds; backward starts the
                      input gradient's all-reduce / reduce-scatter, computes the weight
                      gradients meanwhile, then waits (passes/overlap.py puts it in the graph)

The lower-case functions `f(x, group)`, `g(x, group)`, `copy_to_tp(x, group)`, ... are plain
functions, usable as FX `call_function` targets. gloo in torch 2.13 supports all_reduce,
all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single (measured); if a backend
lacks reduce-scatter, `start_reduce_scatter` falls back to all-reduce + slice.

Collectives never write into a tensor autograd may still need: the incoming value is copied
into a fresh contiguous buffer first (an add's backward hands the *same* grad tensor to both
operands, so an in-place all-reduce of one would corrupt the other).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.runtime.dist import PeerError, peer_guard

__all__ = [
    "copy_to_tp", "copy_to_tp_parts", "reduce_from_tp", "scatter_to_sp", "gather_from_sp",
    "reduce_scatter_to_sp", "all_gather_sp", "column_parallel", "row_parallel", "f", "g", "send_tensor",
    "recv_tensor", "group_size", "group_rank", "PeerError", "all_reduce", "all_reduce_",
    "all_gather", "reduce_scatter",
    "start_all_reduce", "start_all_gather", "start_reduce_scatter",
]


# ---- helpers -----------------------------------------------------------------------------

def group_size(group: Any) -> int:
    """World size of `group`; None means a group of one rank."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This rank's index within `group`; None means a group of one rank."""
    return 0 if group is None else dist.get_rank(group)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that is safe to overwrite in place (a copy unless already fresh)."""
    y = x.contiguous()
    return y.clone() if y is x else y


def _check_split(x: torch.Tensor, dim: int, n: int, op: str) -> int:
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(
            f"{op}: dim {dim} of shape {tuple(x.shape)} has size {x.shape[dim]}, not divisible "
            f"by the group size {n}; sequence parallelism needs the sequence length to be a "
            f"multiple of t: pad it or pick a t that divides {x.shape[dim]}")
    return dim


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of `x` over `group` (a new tensor; `x` is left as it is)."""
    return start_all_reduce(x, group)()


def all_reduce_(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum the contiguous `x` over `group` in place; returns x. Only for buffers nobody else
    reads meanwhile (flattened gradients, a loss): autograd values go through all_reduce."""
    if not x.is_contiguous():
        raise ValueError(f"all_reduce_: a tensor of shape {tuple(x.shape)} is not contiguous; "
                         f"an in-place reduction needs one buffer (use all_reduce)")
    return start_all_reduce(x, group, owned=True)()


def _split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n = group_size(group)
    dim = _check_split(x, dim, n, "split")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_gather(x: torch.Tensor, dim: int, group: Any,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (into `out` at dim 0)."""
    return start_all_gather(x, dim, group, out)()


def start_all_gather(x: torch.Tensor, dim: int, group: Any,
                     out: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """Launch the all-gather of `x` along `dim`; the returned function waits for it. `out`
    (dim 0 only): a contiguous tensor of the gathered shape and x's dtype to gather into."""
    n = group_size(group)
    dim = dim % x.dim()
    src = x.contiguous()                                        # (..., S, ...)
    shape = (n * src.shape[0],) + tuple(src.shape[1:])
    if out is not None and (dim != 0 or tuple(out.shape) != shape or out.dtype != src.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"all_gather: out has shape {tuple(out.shape)} and dtype {out.dtype}; "
                         f"gathering dim 0 needs a contiguous {shape} {src.dtype} tensor")
    if out is None:
        out = src.new_empty(shape)                              # (n*D0, ...)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with peer_guard("all-gather with", group):
        work = gather(out, src, group=group, async_op=True)
    wait = _waiter(work, out, "all-gather with", group)
    if dim == 0:
        return wait                                             # (n*S, ...): no copy
    # one copy: (n, ..., S, ...) -> (..., n, S, ...) -> (..., n*S, ...)
    return lambda: wait().unflatten(0, (n, src.shape[0])).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's 1/n slice along `dim` of the sum of `x` over `group`."""
    return start_reduce_scatter(x, dim, group)()


def start_reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> Callable[[], torch.Tensor]:
    """Launch the reduce-scatter of `x` along `dim`; the returned function waits for it."""
    n = group_size(group)
    dim = _check_split(x, dim, n, "reduce-scatter")
    shape = tuple(x.shape)
    # (..., n*S, ...) -> (n, ..., S, ...): rank r's block first-dim contiguous (one copy)
    src = x.unflatten(dim, (n, shape[dim] // n)).movedim(dim, 0).contiguous()
    out = src.new_empty(src.shape[1:])                          # (..., S, ...)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        with peer_guard("reduce-scatter with", group):
            work = rs(out, src.flatten(0, 1), group=group, async_op=True)  # gloo: (n*D0, ...)
        return _waiter(work, out, "reduce-scatter with", group)
    except PeerError:
        raise
    except (NotImplementedError, RuntimeError) as exc:
        if not _unsupported(exc):
            raise
    # Fallback: all-reduce the whole tensor, keep this rank's slice (n x the traffic). Tried
    # anew on every call (no memory of the backend: no module state); a backend without
    # reduce-scatter refuses at once, before moving any data.
    return start_all_reduce(src, group, lambda r: r[group_rank(group)])


def _unsupported(exc: BaseException) -> bool:
    """Whether a collective's error says the backend does not implement it."""
    return isinstance(exc, NotImplementedError) or any(
        w in str(exc).lower() for w in ("not supported", "unsupported", "not implemented"))


def start_all_reduce(x: torch.Tensor, group: Any,
                     then: Callable[[torch.Tensor], torch.Tensor] = lambda r: r,
                     owned: bool = False) -> Callable[[], torch.Tensor]:
    """Launch the all-reduce of `x` (of a copy unless `owned`: nobody else reads x); the
    returned function waits and gives then(sum)."""
    out = x.contiguous() if owned else _fresh(x)
    with peer_guard("all-reduce with", group):
        work = dist.all_reduce(out, group=group, async_op=True)
    wait = _waiter(work, out, "all-reduce with", group)
    return lambda: then(wait())


def _waiter(work: Any, out: torch.Tensor, op: str, group: Any) -> Callable[[], torch.Tensor]:
    def wait() -> torch.Tensor:
        with peer_guard(op, group):
            if work is not None:
                work.wait()
        return out
    return wait


# ---- autograd Functions ------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (enters a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _CopyToTPParts(torch.autograd.Function):
    """f on some rows: identity forward, all-reduce of the gradient's `parts` (start, length)
    along `dim` backward, the other rows untouched (the replicated part of a mixed weight)."""

    @staticmethod
    def forward(ctx, x, group, dim, parts):
        ctx.group, ctx.dim, ctx.parts = group, dim, parts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        pieces = [grad.narrow(ctx.dim, s, n) for s, n in ctx.parts]
        summed = all_reduce(torch.cat(pieces, ctx.dim), ctx.group)    # one collective
        out = grad.clone()
        offset = 0
        for s, n in ctx.parts:
            out.narrow(ctx.dim, s, n).copy_(summed.narrow(ctx.dim, offset, n))
            offset += n
        return out, None, None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (leaves a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSP(torch.autograd.Function):
    """Keep this rank's slice along `dim` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along `dim` forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along `dim` forward; all-gather the gradient backward (SP's g)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _AllGatherSP(torch.autograd.Function):
    """All-gather along `dim` forward; reduce-scatter the gradient backward (SP's f)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ColumnParallel(torch.autograd.Function):
    """f (or SP's all-gather) fused with the projections it feeds: the input gradient's
    all-reduce (SP: reduce-scatter) runs while the weight gradients are computed."""

    @staticmethod
    def forward(ctx, x, group, layouts, sp_dim, *weights_and_biases):
        k = len(layouts)
        ws, bs = weights_and_biases[:k], weights_and_biases[k:]
        ctx.group, ctx.layouts, ctx.sp_dim = group, layouts, sp_dim
        ctx.has_bias = [b is not None for b in bs]
        # SP keeps only this rank's sequence shard (B, T/t, C) and gathers it again in
        # backward, under the dx GEMMs (2205.05198 §4.2.2): the memory SP is chosen for
        ctx.save_for_backward(x, *ws)
        if sp_dim is None:
            return tuple(_project(x, w, b, lay) for w, b, lay in zip(ws, bs, layouts))
        return _gather_then_project(x, group, sp_dim, ws, bs, layouts)

    @staticmethod
    def backward(ctx, *grads):
        saved, *ws = ctx.saved_tensors
        need = ctx.needs_input_grad
        want_w = any(need[4 + i] or need[4 + len(ws) + i] for i in range(len(ws)))
        gather = (start_all_gather(saved, ctx.sp_dim, ctx.group)
                  if ctx.sp_dim is not None and want_w else None)
        finish = None
        if need[0]:
            dx = None
            for g, w, lay in zip(grads, ws, ctx.layouts):
                if g is not None:   # dx = sum_i dy_i W_i (linear's W is (out, in))
                    d = g.matmul(w if lay == "linear" else w.t())
                    dx = d if dx is None else dx.add_(d)
            if dx is None:
                shape = list(saved.shape)
                if ctx.sp_dim is not None:
                    shape[ctx.sp_dim] *= group_size(ctx.group)
                dx = saved.new_zeros(shape)
            finish = (start_all_reduce(dx, ctx.group, owned=True) if ctx.sp_dim is None
                      else start_reduce_scatter(dx, ctx.sp_dim, ctx.group))
        full = saved if gather is None else gather()
        dws, dbs = _weight_grads(full, grads, ctx.layouts, ctx.has_bias, need[4:])
        return (None if finish is None else finish(), None, None, None, *dws, *dbs)


def _gather_then_project(x: torch.Tensor, group: Any, dim: int, ws: tuple, bs: tuple,
                         layouts: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """all_gather(x, dim) then each projection, as a collective matmul (async TP's
    all-gather matmul): this rank's own sequence block is projected while the others' blocks
    are in flight, theirs once they arrive; the output blocks are put back in rank order."""
    n, me = group_size(group), group_rank(group)
    dim = dim % x.dim()
    wait = start_all_gather(x, dim, group)                      # (.., n*S, ..) when done
    if dim == x.dim() - 1:   # gathered along the contracted features: no block projects alone
        full = wait()
        return tuple(_project(full, w, b, lay) for w, b, lay in zip(ws, bs, layouts))
    own = [_project(x, w, b, lay) for w, b, lay in zip(ws, bs, layouts)]
    full = wait()
    per = x.shape[dim]
    outs = []
    for i, (w, b, lay) in enumerate(zip(ws, bs, layouts)):
        blocks = [own[i] if r == me else _project(full.narrow(dim, r * per, per), w, b, lay)
                  for r in range(n)]
        outs.append(torch.cat(blocks, dim))
    return tuple(outs)


def _weight_grads(full: torch.Tensor, grads: tuple, layouts: tuple[str, ...],
                  has_bias: list[bool], need: tuple[bool, ...]) -> tuple[list, list]:
    """dW_i (layout's shape) and db_i of each projection of `full`; None where not needed."""
    k = len(layouts)
    x2 = full.reshape(-1, full.shape[-1])                              # (B*T, C)
    dws, dbs = [], []
    for i, (g, lay, has_b) in enumerate(zip(grads, layouts, has_bias)):
        g2 = None if g is None else g.reshape(-1, g.shape[-1])         # (B*T, N/t)
        dws.append(None if g2 is None or not need[i] else
                   (g2.t().mm(x2) if lay == "linear" else x2.t().mm(g2)))
        dbs.append(g2.sum(0) if has_b and g2 is not None and need[k + i] else None)
    return dws, dbs


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, layout: str) -> torch.Tensor:
    if layout == "linear":                                          # y = x Wᵀ + b, W (N, C)
        return torch.nn.functional.linear(x, w, b)
    if x.dim() != 2:                                                # y = x W + b, W (C, N)
        y = torch.matmul(x, w)
        return y if b is None else y + b
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


# A row-parallel GEMM's reduction runs in this many pieces, each launched as soon as its rows
# are computed and in flight while the next piece's GEMM runs (Megatron-Core's
# --tp-comm-overlap splits the GEMM the same way). Not fitted: 4 hides all but a quarter of
# the communication behind the GEMM when the two take equal time; more pieces add a
# collective launch each.
ROW_CHUNKS = 4


def _pieces(rows: int, most: int = ROW_CHUNKS) -> int:
    """The largest piece count <= most that divides rows (1 when none does)."""
    return next(k for k in range(min(most, max(rows, 1)), 0, -1) if rows % k == 0)


class _RowParallel(torch.autograd.Function):
    """A row-parallel projection y = x·Wᵀ (or x·W) summed over the group (g), or summed and
    reduce-scattered along `sp_dim` (SP's g), as a collective matmul: the GEMM runs in row
    pieces and each piece's reduction is in flight while the next piece is computed (async
    TP's fused_matmul_reduce_scatter). Backward: dx = dy·W and dW = dyᵀ·x need no peer
    without SP; with SP the gradient's all-gather runs while this rank's own block of dx is
    computed."""

    @staticmethod
    def forward(ctx, x, group, layout, sp_dim, w):
        ctx.group, ctx.layout, ctx.sp_dim = group, layout, sp_dim
        ctx.save_for_backward(x, w)
        if sp_dim is None:
            x2 = x.reshape(-1, x.shape[-1])                            # (B*T, C/t)
            waits = [start_all_reduce(_project(piece, w, None, layout), group, owned=True)
                     for piece in x2.chunk(_pieces(x2.shape[0]))]
            sums = [wait() for wait in waits]                          # (rows, N) each
            # written into one output made here, returned whole: a view of it (the reshape
            # of the joined pieces) could not be modified in place after this Function, and
            # models do (Llama 4's MoE adds its routed experts into the shared expert's sum)
            y = sums[0].new_empty(*x.shape[:-1], sums[0].shape[-1])   # (B, T, N)
            torch.cat(sums, out=y.view(-1, y.shape[-1]))
            return y
        n = group_size(group)
        dim = _check_split(x, sp_dim, n, "reduce-scatter")
        per = x.shape[dim] // n
        k = _pieces(per)
        # piece j: the j-th k-th of every rank's block, so that its reduce-scatter hands rank
        # r the j-th part of block r and the parts concatenate into block r
        xv = x.unflatten(dim, (n, k, per // k))                        # (.., n, k, S/k, C)
        waits = [start_reduce_scatter(_project(xv.select(dim + 1, j).flatten(dim, dim + 1),
                                               w, None, layout), dim, group)
                 for j in range(k)]
        return torch.cat([wait() for wait in waits], dim)              # (.., S, N)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[4]
        if ctx.sp_dim is None:
            full = dy
            dx = _project_back(dy, w, ctx.layout) if need_x else None
        else:
            dim = ctx.sp_dim % dy.dim()
            wait = start_all_gather(dy, dim, ctx.group)
            own = _project_back(dy, w, ctx.layout) if need_x else None   # under the gather
            full = wait()
            dx = None
            if need_x:
                n, me, per = group_size(ctx.group), group_rank(ctx.group), dy.shape[dim]
                dx = torch.cat([own if r == me else _project_back(
                    full.narrow(dim, r * per, per), w, ctx.layout) for r in range(n)], dim)
        dw = None
        if need_w:
            g2, x2 = full.reshape(-1, full.shape[-1]), x.reshape(-1, x.shape[-1])
            dw = g2.t().mm(x2) if ctx.layout == "linear" else x2.t().mm(g2)
        return dx, None, None, None, dw


def _project_back(dy: torch.Tensor, w: torch.Tensor, layout: str) -> torch.Tensor:
    """dx of _project (no bias): dy·W for "linear" (W is (N, C)), dy·Wᵀ for "mm"."""
    return dy.matmul(w if layout == "linear" else w.t())


# ---- plain functions (FX call_function targets) ------------------------------------------

def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """f: identity forward, all-reduce backward over `group`."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def copy_to_tp_parts(x: torch.Tensor, group: Any, dim: int,
                     parts: list[tuple[int, int]]) -> torch.Tensor:
    """f restricted to the rows `parts` ((start, length) along `dim`): identity forward; the
    gradient of those rows all-reduced over `group` backward (each rank held a summand: the
    replicated k/v rows of a multi-query projection, read by this rank's query heads only)."""
    if group_size(group) == 1 or not parts:
        return x
    return _CopyToTPParts.apply(x, group, dim, [tuple(p) for p in parts])


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """g: all-reduce forward over `group`, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """This rank's 1/n slice of `x` along `dim`; backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterToSP.apply(x, group, dim)


def gather_from_sp(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """All-gather `x` along `dim`; backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromSP.apply(x, group, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Sum over `group` and keep this rank's slice along `dim`; backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatterToSP.apply(x, group, dim)


def all_gather_sp(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """All-gather `x` along `dim`; backward reduce-scatters."""
    return x if group_size(group) == 1 else _AllGatherSP.apply(x, group, dim)


def column_parallel(x: torch.Tensor, group: Any, layouts: tuple[str, ...], weights: tuple,
                    biases: tuple, sp_dim: int | None = None) -> tuple[torch.Tensor, ...]:
    """f (sp_dim None) or all_gather_sp(x, group, sp_dim), then one projection per weight:
    "linear": x Wᵀ + b (aten.linear), "mm": x W + b (aten.mm / addmm / matmul). Backward
    overlaps the input gradient's reduction with the weight gradients (Megatron-LM's
    asynchronous tensor-parallel all-reduce; 2205.05198 §4.2.2 for the reduce-scatter)."""
    if group_size(group) == 1:
        return tuple(_project(x, w, b, lay) for w, b, lay in zip(weights, biases, layouts))
    return _ColumnParallel.apply(x, group, tuple(layouts), sp_dim, *weights, *biases)


def row_parallel(x: torch.Tensor, group: Any, layout: str, weight: torch.Tensor,
                 sp_dim: int | None = None) -> torch.Tensor:
    """reduce_from_tp(project(x, weight)) (sp_dim None) or reduce_scatter_to_sp(project(x,
    weight), group, sp_dim), the reduction pipelined with the GEMM (_RowParallel); layout
    "linear": x Wᵀ, "mm": x W. A group of one: the projection alone."""
    if group_size(group) == 1:
        return _project(x, weight, None, layout)
    return _RowParallel.apply(x, group, layout, sp_dim, weight)


f = copy_to_tp
g = reduce_from_tp


# ---- point-to-point (pipeline) -----------------------------------------------------------

def send_tensor(t: torch.Tensor, dst: int, group: Any) -> None:
    """Blocking send of `t` to global rank `dst` (PeerError naming `dst` if it is gone).

    Blocking dist.send, not batch_isend_irecv: batched p2p hangs on gloo.
    """
    with peer_guard("send to", group, [dst]):
        dist.send(t.detach().contiguous(), dst=dst, group=group)


def recv_tensor(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, src: int, group: Any,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Blocking receive of a tensor of `shape`/`dtype` from global rank `src`.

    Raises PeerError naming `src` if it died (at once) or sent nothing within the group timeout.
    """
    buf = torch.empty(tuple(shape), dtype=dtype, device=device)
    with peer_guard("receive from", group, [src]):
        dist.recv(buf, src=src, group=group)
    return buf
