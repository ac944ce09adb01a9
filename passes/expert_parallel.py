"""Expert parallelism in the graph: each rank keeps E/ep of every layer's experts and sends its
tokens to their experts' ranks by all-to-all (autopar/runtime/experts.py).

Two forms of experts are found. Grouped (below): transformers' grouped-matmul path. Batched
(passes/expert_chains.py `expert_bmm_chains`: Llama 4's routed experts, Inkling's shared
ones): every token goes to every expert as one bmm of (E, N, K) rows by a 3-D parameter
(E, K, M); the rank's rows are its experts' batches in order, i.e. rows sorted by expert with
offs N, 2N, ..., so the same route / dispatch / combine move them (`dispatch_batches`: each
rank then holds (E/ep, rows of every rank, K), with any per-row (E, N, ·) operand the chain
reads; `combine_batches` returns the exit's (E, N, M)).

The experts are found as the tensor-parallel pass finds them (passes/sharding/): a chain of
grouped matmuls over 3-D expert parameters (transformers' grouped-matmul path: the gate/up
product of the rows sorted by expert, an elementwise gate, the down product), the first fed
by tokens, the last by the first, both grouped by one `offs` (cumulative rows per expert).
Between the two products every op is row-wise (the gate), so the rewrite is

    r = route(offs, ep_group)                       # counts all-to-all
    x_local = dispatch(x, r, ep_group)              # (rows for my E/ep experts, hidden)
    up = grouped_mm(x_local, w_up[mine], r.offs_local) ... down = grouped_mm(..., w_down[mine],
    r.offs_local)
    y = combine(down, r, ep_group)                  # (my rows, sorted by expert, hidden)

and the routing (top-k, sort, weights, the scatter back to tokens) stays as it was, on the
rank's own tokens. autopar/build.py runs it on every rank's full graph after the tensor and
context rewrites (`expert_parallel_pass`); each sliced parameter's get_attr nodes carry an
ExpertSlice (meta "autopar_ep_param"), from which autopar.compile describes the parameter
(autopar.runtime.params: split along dim 0 over the expert group).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.manager import Pass, run_passes
from autopar.passes.expert_chains import BmmChain, expert_bmm_chains, nodes_between
from autopar.passes.sharding import is_grouped_mm
from autopar.runtime import experts as X
from autopar.runtime.shard import UnboundGroup

EP_GROUP_ATTR = "ep_group"


@dataclass(frozen=True)
class ExpertSlice:
    """The experts [start, stop) of `experts` (dim 0) an expert parameter keeps on this rank."""
    experts: int
    start: int
    stop: int


def _offs(node: fx.Node) -> fx.Node:
    return node.args[2] if len(node.args) > 2 else node.kwargs["offs"]


def _param(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The get_attr parameter behind a grouped matmul's weight (through views / transposes)."""
    w = node.args[1]
    while isinstance(w, fx.Node) and w.op == "call_function" and w.all_input_nodes:
        w = w.all_input_nodes[0]
    return w if isinstance(w, fx.Node) and w.op == "get_attr" else None


def expert_chains(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(first, last) grouped matmul of each experts' chain, in graph order: the grouped
    matmuls over 3-D parameters that group their rows by one offs node (one MoE layer), the
    first reading the dispatched tokens, the last giving the experts' outputs; every op
    between them must be row-wise (the gate), which the rewrite does not check."""
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if is_grouped_mm(n) and _param(gm, n) is not None:
            by_offs.setdefault(_offs(n), []).append(n)
    return [(mms[0], mms[-1]) for mms in by_offs.values()]


def _slice_experts(gm: fx.GraphModule, attr: fx.Node, ep: int, ep_rank: int) -> ExpertSlice:
    """Keep this rank's E/ep experts of parameter `attr` (dim 0)."""
    owner_path, _, name = attr.target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    full = getattr(owner, name)
    experts = int(full.shape[0])
    if experts % ep:
        raise ValueError(f"ep={ep} with {experts} experts ({attr.target}): each rank holds "
                         f"E/ep whole experts, so ep must divide {experts}; pick an ep that "
                         f"divides it")
    n = experts // ep
    local = full.detach()[ep_rank * n:(ep_rank + 1) * n].clone()
    setattr(owner, name, torch.nn.Parameter(local, requires_grad=full.requires_grad))
    val = attr.meta.get(K.VAL)
    if val is not None:
        attr.meta[K.VAL] = torch.empty((n,) + tuple(val.shape[1:]), dtype=val.dtype,
                                       device="meta")
    return ExpertSlice(experts, ep_rank * n, (ep_rank + 1) * n)


def apply_expert_parallel(gm: fx.GraphModule, ep: int, ep_rank: int,
                          group: object = None) -> fx.GraphModule:
    """`expert_parallel_pass` on `gm` (in place) through run_passes (linted, recompiled); with
    ep = 1 the graph is returned unchanged."""
    return gm if ep == 1 else run_passes(gm, [expert_parallel_pass(ep, ep_rank, group)])


def _spread_experts(gm: fx.GraphModule, ep: int, ep_rank: int,
                    group: object = None) -> fx.GraphModule:
    """Spread the experts of `gm` over ep ranks (this one is `ep_rank`); see the module doc.

    Requires: a captured graph (meta "val" on every node); experts as grouped matmul chains
    over 3-D parameters, or batched ones (passes/expert_chains.py). Guarantees: each chain's
    rows dispatched before its first grouped matmul and combined after its last, the chain's
    offs replaced by the local ones (a batched chain: its rows and per-row operands dispatched
    as E/ep batches, its exit combined; one of fewer experts than ep divides left whole), each
    expert parameter holding this rank's experts [ep_rank·E/ep, (ep_rank+1)·E/ep) along dim 0;
    the exchanges read the graph attribute `ep_group` (gm.ep_group = group). With ep = 1 the
    graph is returned unchanged. Meta keys: reads "val"; writes "val" of the sliced parameters
    (the rows between dispatch and combine are data-dependent: their "val" keeps the rank's
    own row count); writes EP_PARAM (an ExpertSlice) on every get_attr of a sliced parameter.
    Raises ValueError (one line) when ep does not divide the experts.
    """
    if ep == 1:
        return gm
    chains, batched = expert_chains(gm), expert_bmm_chains(gm)
    if not chains and not batched:
        raise ValueError(f"ep={ep}: the graph has no experts (grouped or batched matmuls over "
                         f"3-D parameters) to spread over ranks; run with ep=1")
    g = gm.graph
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a plain attribute, as tp_group
        gm.ep_group = group if group is not None else UnboundGroup(ep)
    sliced: dict[str, ExpertSlice] = {}
    for first, last in chains:
        offs = _offs(first)
        with g.inserting_before(first):
            grp = g.get_attr(EP_GROUP_ATTR)
            r = g.call_function(X.route, (offs, grp))
            local_offs = g.call_function(X.local_offsets, (r,))
            x = g.call_function(X.dispatch, (first.args[0], r, grp))
        x.meta[K.VAL] = first.args[0].meta.get(K.VAL)
        local_offs.meta[K.VAL] = offs.meta.get(K.VAL)
        _dispatch_row_operands(g, first, last, r, grp)
        for mm in {first, last}:
            mm.args = (x if mm is first else mm.args[0], mm.args[1], local_offs) + mm.args[3:]
            mm.kwargs = {k: v for k, v in mm.kwargs.items() if k != "offs"}
            _slice_weight(gm, mm, ep, ep_rank, sliced)
        with g.inserting_after(last):
            y = g.call_function(X.combine, (last, r, grp))
        y.meta[K.VAL] = last.meta.get(K.VAL)
        last.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
    for chain in batched:
        # a chain of fewer experts than ep divides (Inkling's 2 shared beside 4 routed, at
        # ep = 4) stays whole on every rank, its weights reduced as dense ones
        if chain.experts % ep == 0:
            _spread_bmm_chain(gm, chain, ep, ep_rank, sliced)
    for n in g.nodes:
        if n.op == "get_attr" and n.target in sliced:
            n.meta[K.EP_PARAM] = sliced[n.target]
    return gm


def _slice_weight(gm: fx.GraphModule, mm: fx.Node, ep: int, ep_rank: int,
                  sliced: dict[str, ExpertSlice]) -> None:
    """Keep this rank's experts of product `mm`'s 3-D weight (once per parameter), the views
    between it and `mm` given its E/ep experts in their "val"."""
    attr = _param(gm, mm)
    if attr is None:
        raise ValueError(f"expert parallelism: {mm.name}'s weight is not a parameter; "
                         f"only experts held as 3-D parameters are spread: run ep=1")
    if attr.target not in sliced:
        sliced[attr.target] = _slice_experts(gm, attr, ep, ep_rank)
    for v in _views(attr, mm):
        v.meta[K.VAL] = torch.empty((attr.meta[K.VAL].shape[0],)
                                    + tuple(v.meta[K.VAL].shape[1:]),
                                    dtype=v.meta[K.VAL].dtype, device="meta")


def _spread_bmm_chain(gm: fx.GraphModule, chain: BmmChain, ep: int, ep_rank: int,
                      sliced: dict[str, ExpertSlice]) -> None:
    """One chain of expert bmms (passes/expert_chains.py): its (E, N, K) rows, and each per-row
    operand it reads from outside, go to their experts' ranks before the chain (each rank then
    holds (E/ep, rows of every rank, ·)); the exit's results come back as (E, N, M). The rows'
    count is read at run time (route)."""
    g = gm.graph
    local = chain.experts // ep
    where = _position(g)
    moved = {}
    with g.inserting_before(min(chain.entries, key=where)):
        grp = g.get_attr(EP_GROUP_ATTR)
        r = g.call_function(X.batch_route, (chain.rows, grp))
    for x in (chain.rows,) + chain.operands:     # each before the first op reading it
        with g.inserting_before(min((n for n in chain.inner if x in n.all_input_nodes),
                                    key=where)):
            moved[x] = g.call_function(X.dispatch_batches, (x, r, grp, local))
        moved[x].meta[K.VAL] = x.meta.get(K.VAL)
    for n in chain.inner:
        for x, m in moved.items():
            if x in n.all_input_nodes:
                n.replace_input_with(x, m)
    for mm in chain.bmms:
        _slice_weight(gm, mm, ep, ep_rank, sliced)
    last = chain.exit
    with g.inserting_after(last):
        y = g.call_function(X.combine_batches, (last, r, grp, chain.experts))
    y.meta[K.VAL] = last.meta.get(K.VAL)
    last.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)


def _position(g: fx.Graph):
    """A key ordering nodes of `g` as the graph runs them."""
    order = {n: i for i, n in enumerate(g.nodes)}
    return order.__getitem__


def _dispatch_row_operands(g: fx.Graph, first: fx.Node, last: fx.Node, r: fx.Node,
                           grp: fx.Node) -> None:
    """Per-row operands the chain reads but did not compute (GPT-OSS's per-expert bias
    gathered for each of the rank's sorted rows, added to the gate/up product) are dispatched
    with the rows, so they meet the rows of this rank's experts; their gradient comes back by
    the reverse exchange."""
    val = first.args[0].meta.get(K.VAL)
    rows = val.shape[0] if val is not None and val.dim() == 2 else None
    chain = nodes_between([first], last) - {first}   # the ops after the first to the last
    for n in [x for x in g.nodes if x in chain and x is not last]:
        for a in n.all_input_nodes:
            v = a.meta.get(K.VAL)
            if (a in chain or a is first or a.op != "call_function" or not isinstance(
                    v, torch.Tensor) or v.dim() != 2 or v.shape[0] != rows):
                continue
            with g.inserting_before(n):
                moved = g.call_function(X.dispatch, (a, r, grp))
            moved.meta[K.VAL] = v
            n.replace_input_with(a, moved)


def expert_parallel_pass(ep: int, ep_rank: int, group: Any = None) -> Pass:
    """The pass for the pass pipeline (autopar/build.py): group None leaves the graph attribute
    `ep_group` for the runtime to bind to this rank's expert group."""
    return Pass(name="expert_parallel",
                run=lambda gm: _spread_experts(gm, ep, ep_rank, group),
                reads=(K.VAL,), writes=(K.VAL, K.EP_PARAM))


def _views(attr: fx.Node, mm: fx.Node) -> list[fx.Node]:
    """The view / transpose nodes between parameter `attr` and grouped matmul `mm`."""
    out, w = [], mm.args[1]
    while isinstance(w, fx.Node) and w is not attr:
        out.append(w)
        w = w.all_input_nodes[0]
    return out
