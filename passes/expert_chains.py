"""Experts run as batched matmuls (sharding.is_expert_bmm: Llama 4's routed experts, Inkling's
shared ones): which bmms form one experts' chain that expert parallelism can spread whole.

A chain reads one (E, N, K) rows tensor (every entry bmm the same node: Inkling's gate and up
products read one expanded input), passes only through ops that keep the rows in the experts'
(E, N, ·) batches, and leaves by one exit bmm (the down product). Per-row operands it reads
from outside (Inkling's (E, N, 1) router gains) travel with the rows. Anything else (two
exits, entries on different rows) is not a chain: its bmms stay where they are and are not
priced as experts, so the planner never offers an ep the pass could not build. Pure graph
analysis, shared by the profile (passes/graph_facts.py) and the rewrite
(passes/expert_parallel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.sharding import MATMUL_OPS, is_expert_bmm, packet, shape
from autopar.passes.sharding.ops import param_root


@dataclass(frozen=True)
class BmmChain:
    """One experts' chain of batched matmuls: `rows` (E, N, K) read by `entries`, `bmms` all
    of its products, `inner` the ops from the entries to `exit` (the bmms included), `operands`
    the per-row (E, N, ·) values the inner ops read from outside. Every tuple in graph order
    (the rewrite issues one all-to-all per operand: every rank in the same order)."""
    rows: fx.Node
    entries: tuple[fx.Node, ...]
    bmms: tuple[fx.Node, ...]
    exit: fx.Node
    inner: tuple[fx.Node, ...]
    operands: tuple[fx.Node, ...]

    @property
    def experts(self) -> int:
        return int(self.rows.meta[K.VAL].shape[0])


def _batched(val, experts: int, rows: int | None = None) -> bool:
    """A value (or a tuple of values: a chunk's) laid out (experts, rows, ·)."""
    if isinstance(val, (list, tuple)):
        return bool(val) and all(_batched(v, experts, rows) for v in val)
    return (isinstance(val, torch.Tensor) and val.dim() == 3 and int(val.shape[0]) == experts
            and (rows is None or int(val.shape[1]) == rows))


def _upstream(n: fx.Node, experts: int) -> set[fx.Node]:
    """The expert bmms reached upstream of bmm n's rows through batch-keeping non-matmul ops."""
    out, seen, todo = set(), set(), [n.args[0]]
    while todo:
        x = todo.pop()
        if (not isinstance(x, fx.Node) or x in seen or x.op != "call_function"
                or not _batched(x.meta.get(K.VAL), experts)):
            continue
        seen.add(x)
        if is_expert_bmm(x):
            out.add(x)
        elif packet(x) not in MATMUL_OPS:
            todo.extend(x.all_input_nodes)
    return out


def nodes_between(entries: list[fx.Node], exit_: fx.Node) -> set[fx.Node]:
    """The call_function nodes on a path from an entry to the exit (both included)."""
    down, todo = set(), list(entries)
    while todo:
        n = todo.pop()
        if n in down or n.op != "call_function":
            continue
        down.add(n)
        if n is not exit_:
            todo.extend(n.users)
    up, todo = set(), [exit_]
    while todo:
        n = todo.pop()
        if n in up or n not in down:
            continue
        up.add(n)
        todo.extend(n.all_input_nodes)
    return up


def expert_bmm_chains(gm: fx.GraphModule) -> list[BmmChain]:
    """The experts' chains of batched matmuls in `gm`, in graph order (module docstring)."""
    bmms = [n for n in gm.graph.nodes if is_expert_bmm(n)]
    experts = {n: shape(param_root(n.args[1]))[0] for n in bmms}
    ups = {n: _upstream(n, experts[n]) for n in bmms}
    parent = {n: n for n in bmms}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            n = parent[n]
        return n

    first_on: dict[fx.Node, fx.Node] = {}      # rows -> the first entry bmm reading them
    for n in bmms:
        links = set(ups[n])
        if not ups[n]:
            links.add(first_on.setdefault(n.args[0], n))
        for u in links:
            parent[find(n)] = find(u)
    comps: dict[fx.Node, list[fx.Node]] = {}
    for n in bmms:
        comps.setdefault(find(n), []).append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    chains = []
    for members in comps.values():
        chain = _chain(members, ups, order)
        if chain is not None:
            chains.append(chain)
    return chains


def _chain(members: list[fx.Node], ups: dict, order: dict) -> BmmChain | None:
    """The BmmChain of one connected set of expert bmms, or None when it is not one."""
    entries = [n for n in members if not ups[n]]
    fed = set().union(*(ups[n] for n in members))
    exits = [n for n in members if n not in fed]
    if len({n.args[0] for n in entries}) != 1 or len(exits) != 1:
        return None
    rows, exit_ = entries[0].args[0], exits[0]
    val = rows.meta.get(K.VAL)
    inner = nodes_between(entries, exit_)
    if not set(members) <= inner:
        return None
    experts, n_rows = int(val.shape[0]), int(val.shape[1])
    within, inner = inner, sorted(inner, key=order.__getitem__)
    operands = []
    for n in inner:
        for a in n.all_input_nodes:
            if (a not in within and a is not rows and param_root(a) is None
                    and a not in operands and _batched(a.meta.get(K.VAL), experts, n_rows)):
                operands.append(a)
    for n in inner:                  # the chain's values leave only through the exit
        if n is not exit_ and any(u not in within for u in n.users):
            return None
    return BmmChain(rows=rows, entries=tuple(entries), bmms=tuple(members), exit=exit_,
                    inner=tuple(inner), operands=tuple(operands))
