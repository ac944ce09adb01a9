"""Expert parallelism's token exchange: the dispatch / combine all-to-all pair.

The experts of a mixture-of-experts layer are spread over the ep ranks of an expert group
(autopar/runtime/groups.py expert_groups): rank e holds experts [e·E/ep, (e+1)·E/ep). Each rank
routes its own tokens; transformers' grouped-matmul path sorts the (token, choice) rows by
expert and describes the groups by `offs`, the cumulative row count per expert (E,). Then

    forward                                            backward
    dispatch  rows to their experts' rank: all-to-all,  the gradients back: the reverse
              regrouped by local expert (offs_local)     all-to-all
    combine   results back to the rows' rank: the       the gradients out again: the
              reverse all-to-all, in the sorted order     dispatch's all-to-all

Megatron-Core's all-to-all token dispatcher (MoEAlltoAllTokenDispatcher) and torchtitan's
expert-parallel all-to-all do the same; each is a short autograd.Function whose backward is the
reverse exchange, with the group passed explicitly and an identity fast path for a group of one.
gloo runs all_to_all_single with uneven splits on CPU (autopar/runtime/collectives.py).

Worked example, E = 4 experts on ep = 2 ranks: rank 0's 5 rows go to experts (0, 0, 1, 2, 3)
(offs [2, 3, 4, 5]), rank 1's 3 rows to (1, 3, 3) (offs [0, 1, 1, 3]). Rank 0 (experts 0, 1)
sends its first 3 rows to itself and 2 to rank 1; it receives rank 1's 1 row for expert 1.
Received: [r0 e0, r0 e0, r0 e1 | r1 e1], regrouped by local expert: e0 (2 rows), e1 (2 rows),
offs_local [2, 4]. Rank 1 (experts 2, 3) receives [r0 e2, r0 e3 | r1 e3, r1 e3]: regrouped
e2 (1 row), e3 (3 rows: r0's, then r1's two), offs_local [1, 4].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.collectives import group_size
from autopar.runtime.dist import peer_guard


@dataclass(frozen=True)
class Route:
    """Where one rank's sorted rows go and where the rows it receives came from.

    send: rows to each rank of the group (this rank's rows are sorted by expert, so by rank);
    recv: rows from each rank; order: the received rows regrouped by local expert (index into
    the received buffer, rank-major as it arrives); offs_local: the cumulative rows per local
    expert after regrouping (int32, for a grouped matmul over the local experts)."""
    send: list[int]
    recv: list[int]
    order: torch.Tensor
    offs_local: torch.Tensor


def route(offs: torch.Tensor, group: Any) -> Route:
    """The Route of rows sorted by expert with cumulative counts `offs` (E,) over `group`
    (ep ranks, E divisible by ep): exchanges the per-expert counts (one small all-to-all)."""
    ep = group_size(group)
    experts = offs.numel()
    if experts % ep:
        raise ValueError(f"route: {experts} experts over an expert group of {ep} ranks; each "
                         f"rank holds E/ep whole experts, so ep must divide {experts}: re-plan "
                         f"with an ep that divides it")
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    if ep == 1:   # every expert here: the rows stay where they are
        rows = int(counts.sum())
        return Route(send=[rows], recv=[rows], order=torch.arange(rows),
                     offs_local=offs.to(torch.int32))
    local = experts // ep
    got = torch.empty_like(counts)
    with peer_guard("expert all-to-all (counts) with", group):
        dist.all_to_all_single(got, counts.contiguous(), group=group)
    got = got.view(ep, local)                          # (source rank, local expert)
    # the row bookkeeping on the host, from one copy of the counts (not a sync per block)
    host = got.cpu()
    start = torch.cumsum(host.flatten(), 0) - host.flatten()
    # rank-major arrival -> expert-major: for each local expert, each source's block in turn
    order = torch.cat([torch.arange(int(s), int(s) + int(n))
                       for s, n in zip(start.view(ep, local).t().flatten(),
                                       host.t().flatten())] or [torch.zeros(0, dtype=torch.long)])
    return Route(send=counts.view(ep, local).sum(1).tolist(), recv=host.sum(1).tolist(),
                 order=order.to(device=offs.device, dtype=torch.long),
                 offs_local=torch.cumsum(got.sum(0), 0).to(torch.int32))


def local_offsets(r: Route) -> torch.Tensor:
    """The cumulative rows per local expert after dispatch (for the grouped matmuls)."""
    return r.offs_local


def _exchange(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Any,
              what: str) -> torch.Tensor:
    out = x.new_empty((sum(out_rows),) + tuple(x.shape[1:]))
    with peer_guard(f"expert all-to-all ({what}) with", group):
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_rows,
                               input_split_sizes=in_rows, group=group)
    return out


class _Dispatch(torch.autograd.Function):
    """Forward: rows to their experts' ranks, regrouped by local expert; backward: reverse."""

    @staticmethod
    def forward(ctx, x, r: Route, group):
        ctx.r, ctx.group, ctx.rows = r, group, x.shape[0]
        return _exchange(x, r.recv, r.send, group, "dispatch")[r.order]

    @staticmethod
    def backward(ctx, grad):
        r = ctx.r
        arrived = torch.zeros_like(grad)
        arrived[r.order] = grad
        return _exchange(arrived, r.send, r.recv, ctx.group, "dispatch backward"), None, None


class _Combine(torch.autograd.Function):
    """Forward: results back to the rows' ranks, in their sorted order; backward: dispatch."""

    @staticmethod
    def forward(ctx, y, r: Route, group):
        ctx.r, ctx.group = r, group
        arrived = torch.empty_like(y)
        arrived[r.order] = y
        return _exchange(arrived, r.send, r.recv, group, "combine")

    @staticmethod
    def backward(ctx, grad):
        r = ctx.r
        return _exchange(grad, r.recv, r.send, ctx.group, "combine backward")[r.order], None, None


def dispatch(x: torch.Tensor, r: Route, group: Any) -> torch.Tensor:
    """Rows `x` (sorted by expert) to their experts' ranks, grouped by local expert."""
    return x if group_size(group) == 1 else _Dispatch.apply(x, r, group)


def combine(y: torch.Tensor, r: Route, group: Any) -> torch.Tensor:
    """The experts' results `y` (grouped by local expert) back to their rows' ranks."""
    return y if group_size(group) == 1 else _Combine.apply(y, r, group)


def batch_route(x: torch.Tensor, group: Any) -> Route:
    """The Route of experts run as one bmm (passes/expert_chains.py): x (E, N, K) holds
    N rows for each of the E experts, i.e. rows sorted by expert with offs N, 2N, ..., EN."""
    experts, rows = int(x.shape[0]), int(x.shape[1])
    offs = torch.arange(1, experts + 1, dtype=torch.int32, device=x.device) * rows
    return route(offs, group)


def dispatch_batches(x: torch.Tensor, r: Route, group: Any, local: int) -> torch.Tensor:
    """x (E, N, K) to its experts' ranks: (local, rows from every rank, K). Each rank sends
    every expert the same N rows, so each local expert receives the same count."""
    if group_size(group) == 1:
        return x
    return dispatch(x.flatten(0, 1), r, group).view(local, -1, x.shape[-1])


def combine_batches(y: torch.Tensor, r: Route, group: Any, experts: int) -> torch.Tensor:
    """The local experts' results y (local, rows from every rank, M) back to their rows'
    ranks: (experts, N, M), this rank's rows for every expert."""
    if group_size(group) == 1:
        return y
    return combine(y.flatten(0, 1), r, group).view(experts, -1, y.shape[-1])


def mean_over(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The mean of `x` over `group`, for values without a gradient (the router's per-expert
    token counts, passes/router_stats.py); a new tensor. None / one rank: x itself."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.detach().clone().contiguous()
    with peer_guard("the router's token counts (all-reduce)", group):
        dist.all_reduce(out, group=group)
    return out / n
