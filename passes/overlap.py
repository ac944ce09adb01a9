"""Overlap tensor-parallel communication with GEMMs: the column-parallel input gradient's
reduction with the weight-gradient GEMMs, and each row-parallel GEMM with its reduction.

Math (Megatron-LM's asynchronous tensor-parallel all-reduce; 2205.05198 §4.2.2 for SP): for
column-parallel projections y_i = x·W_iᵀ that read one f(x), the backward is

    dx = all-reduce_t( Σ_i dy_i·W_i )      (SP: reduce-scatter along the sequence)
    dW_i = dy_iᵀ·x                          (local, needs no other rank)

so the reduction of dx can be in flight while the dW_i GEMMs run. Eager autograd cannot do
that across nodes: f's backward blocks until the reduction is done and the dW GEMMs (inside
each linear's backward) ran before it. This pass fuses f with the projections into one
`collectives.column_parallel` call whose backward launches the reduction asynchronously,
computes every dW_i and db_i, then waits.

`overlap_tp_backward(gm) -> gm` (`OVERLAP_PASS` in a pass list)
Requires: gm from passes.tensor_parallel.apply_tensor_parallel (collectives are call_function
  nodes on the `tp_group` get_attr); meta[VAL] on values.
Guarantees: every `copy_to_tp(x, group)` / `all_gather_sp(x, group, dim)` whose users are all
  projections of it — aten.linear(f, W[, b]), aten.matmul(f, W) with a 2-D W (Falcon's x @ w.T),
  or aten.mm(f, W) / aten.addmm(b, f, W) (GPT-2's Conv1D) — is replaced by one
  `column_parallel(x, group, layouts, weights, biases, sp_dim)` node and a getitem per
  projection; the numbers (forward and gradients) are unchanged; f nodes with
  any other user are left as they are.
  Every `reduce_from_tp(y, group)` / `reduce_scatter_to_sp(y, group, dim)` whose y is a
  bias-free projection linear(x, W) / mm(x, W) / matmul(x, W) (possibly through a dropout of
  p = 0) read by nothing else becomes one `row_parallel(x, group, layout, W, sp_dim)` node: the
  collective matmul, its reduction pipelined with the GEMM's row pieces (same numbers).
Reads node.meta (keys of passes/meta.py): VAL. Writes: the new nodes' meta (copied from the f
  node and from each projection: VAL, REGION, STACK_TRACE, NN_MODULE_STACK; a row_parallel
  node the reduction's); gm.meta[OVERLAP] = the number of entries and exits fused.
Not for schedules that split the backward into B and W (interleaved-zb): B would run the fused
  backward whole and W would run it again.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.manager import Pass, run_passes
from autopar.runtime import collectives as C

_ATEN = torch.ops.aten
_SOURCES = {C.copy_to_tp, C.all_gather_sp}
_ROW_SINKS = {C.reduce_from_tp, C.reduce_scatter_to_sp}


def _projection(user: fx.Node, f: fx.Node) -> tuple[str, fx.Node, fx.Node | None] | None:
    """(layout, weight, bias) when `user` projects f with a weight, else None."""
    args = user.args
    if user.target is _ATEN.linear.default and args[0] is f and f not in args[1:] \
            and not user.kwargs:
        return "linear", args[1], args[2] if len(args) > 2 else None
    if user.target in (_ATEN.mm.default, _ATEN.matmul.default) and args[0] is f \
            and args[1] is not f and _dims(args[1]) == 2:
        return "mm", args[1], None
    if user.target is _ATEN.addmm.default and args[1] is f and f not in (args[0], args[2]) \
            and not user.kwargs:
        return "mm", args[2], args[0]
    return None


def _dims(node: object) -> int | None:
    val = node.meta.get(K.VAL) if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _sp_dim(f: fx.Node) -> int | None:
    if f.target in (C.copy_to_tp, C.reduce_from_tp):
        return None
    return f.args[2] if len(f.args) > 2 else f.kwargs.get("dim", 1)


def _fuse(graph: fx.Graph, f: fx.Node, order: dict[fx.Node, int]) -> bool:
    users = list(f.users)
    projections = [_projection(u, f) for u in users]
    if not users or len(f.args) < 2 or any(p is None for p in projections):
        return False
    layouts = tuple(p[0] for p in projections)
    weights = tuple(p[1] for p in projections)
    biases = tuple(p[2] for p in projections)
    # the fused node goes before the first projection, so every weight / bias it reads must be
    # defined by then (a weight computed later, e.g. a transpose right before its own use,
    # leaves this f unfused rather than reordering the graph)
    first = min(users, key=order.__getitem__)
    if any(order[a] > order[first] for a in weights + biases if a is not None):
        return False
    with graph.inserting_before(first):
        fused = graph.call_function(C.column_parallel, (f.args[0], f.args[1], layouts, weights,
                                                        biases, _sp_dim(f)))
    fused.meta.update({k: v for k, v in f.meta.items() if k != K.VAL})
    fused.meta[K.VAL] = tuple(u.meta.get(K.VAL) for u in users)
    with graph.inserting_before(first):     # all getitems before any user is erased
        items = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(users))]
    for item, u in zip(items, users):
        item.meta.update(u.meta)
        u.replace_all_uses_with(item)
        graph.erase_node(u)
    graph.erase_node(f)
    return True


def _row_source(reduce: fx.Node) -> tuple[list[fx.Node], str, fx.Node, fx.Node] | None:
    """(nodes replaced, layout, x, W) when the reduction `reduce` sums one bias-free weight
    projection x·Wᵀ / x·W (through a dropout of p = 0, the identity), read by it alone."""
    chain, src = [], reduce.args[0] if reduce.args else None
    if isinstance(src, fx.Node) and src.target is _ATEN.dropout.default \
            and len(src.users) == 1 and src.args[1:2] == (0.0,):
        chain.append(src)
        src = src.args[0]
    if not isinstance(src, fx.Node) or len(src.users) != 1 or src.kwargs:
        return None
    args = src.args
    if src.target is _ATEN.linear.default and (len(args) == 2 or args[2] is None) \
            and args[0] is not args[1]:
        return [reduce, *chain, src], "linear", args[0], args[1]
    if src.target in (_ATEN.mm.default, _ATEN.matmul.default) and args[0] is not args[1] \
            and _dims(args[1]) == 2:
        return [reduce, *chain, src], "mm", args[0], args[1]
    return None


def _fuse_row(graph: fx.Graph, reduce: fx.Node) -> bool:
    found = _row_source(reduce)
    if found is None or len(reduce.args) < 2:
        return False
    nodes, layout, x, w = found
    sp_dim = None if reduce.target is C.reduce_from_tp else _sp_dim(reduce)
    with graph.inserting_before(reduce):
        fused = graph.call_function(C.row_parallel, (x, reduce.args[1], layout, w, sp_dim))
    fused.meta.update(reduce.meta)
    reduce.replace_all_uses_with(fused)
    for node in nodes:                       # the reduction first: users before producers
        graph.erase_node(node)
    return True


def _fuse_entries(gm: fx.GraphModule, rows: bool = True) -> fx.GraphModule:
    fused = 0
    # positions of the original nodes, numbered once: fusing inserts nodes but never moves an
    # original one, and only originals (users, weights, biases) are compared
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _SOURCES:
            fused += _fuse(gm.graph, node, order)
        elif rows and node.op == "call_function" and node.target in _ROW_SINKS:
            fused += _fuse_row(gm.graph, node)
    gm.meta[K.OVERLAP] = fused
    return gm


OVERLAP_PASS = Pass("overlap_tp_backward", _fuse_entries, reads=(K.VAL,),
                    writes=(K.REGION, K.VAL, K.OVERLAP))
# FP8 builds: the column-parallel fusion only. passes/fp8.py turns plain linears and
# column-parallel groups into FP8 GEMMs; a row-parallel collective matmul in FP8 is not built,
# so its projection stays a linear (an FP8 GEMM) followed by its reduction.
OVERLAP_COLUMNS_PASS = Pass("overlap_tp_backward_columns",
                            lambda gm: _fuse_entries(gm, rows=False), reads=(K.VAL,),
                            writes=(K.REGION, K.VAL, K.OVERLAP))


def overlap_tp_backward(gm: fx.GraphModule) -> fx.GraphModule:
    """Fuse each column-parallel entry with its projections (see the module docstring);
    linted and recompiled (passes.manager.run_passes)."""
    return run_passes(gm, [OVERLAP_PASS])
