"""The router's load-balancing statistics over every rank that splits the micro-batch.

transformers' load-balancing loss (Switch Transformer's E·Σ_e f_e·P_e, autopar/losses.py) is a
nonlinear function of batch statistics: f_e, the fraction of the tokens routed to expert e,
counted by `histc` over the forward's tokens, times P_e, the mean router probability. Under
data (and context) parallelism each rank counts only its own tokens, so a rank's loss is not
the micro-batch's. The exact split: f_e from the counts summed over the c·d ranks that split
the micro-batch (averaged: each rank divides by its own token count, so the mean over ranks of
the local counts over the local rows is the global fraction); P_e stays local. The counts are
not differentiable, so the gradient flows through P_e alone, and the mean over the ranks of
E·Σ_e f_e·P_e(rank) — what data parallelism averages — is the micro-batch's loss, its
gradient the micro-batch's gradient.
Under context parallelism the rank's tokens are a part of each sequence while the model divides
by its whole sequences' row count: the context pass sums the rank's counts and probability sums
over the c context ranks (passes/context_parallel.py `context_sum`, after this pass's mean, so
the count read is c · the mean over the c·d ranks: the replica's), exact as well (tested at
c = 2 × ep = 2, tests/numerics/test_router_loss.py).

A count is a load-balancing statistic, not a routing step, when nothing it feeds grows past
its own size: it only meets per-expert vectors and scalars on its way to the loss. The counts
that route tokens (histc → cumsum → a grouped matmul's offsets, or an index) feed per-token
tensors and stay local.

`router_stats_pass(c·d)` (in a pass list)
Requires: a rank's full graph with meta "val" (the capture's).
Guarantees: each statistic count `s` (aten.histc / bincount whose descendants all hold at most
  as many elements as it) is replaced for its users by
  autopar.runtime.experts.mean_over(s, data_group), the
  graph attribute `data_group` bound by the runtime to the rank's c·d data group
  (autopar.compile; None: one rank, the identity). Routing counts are untouched.
Reads meta "val"; writes "val" of the nodes it adds (the count's).
"""
from __future__ import annotations

import warnings
import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.manager import Pass
from autopar.runtime.experts import mean_over
from autopar.runtime.shard import UnboundGroup

DATA_GROUP_ATTR = "data_group"
_COUNTS = (torch.ops.aten.histc.default, torch.ops.aten.bincount.default)


def _numel(node: fx.Node) -> int | None:
    val = node.meta.get(K.VAL)
    return val.numel() if isinstance(val, torch.Tensor) else None


def _only_statistics(count: fx.Node) -> bool:
    """Every value `count` feeds holds at most as many elements as it (per-expert vectors and
    scalars: the loss), none a per-token tensor or an index of one."""
    size, todo, seen = _numel(count), list(count.users), set()
    while todo:
        n = todo.pop()
        if n in seen or n.op == "output":
            continue
        seen.add(n)
        k = _numel(n)
        if k is None and not n.users:   # a check export inserted (_assert_tensor_metadata)
            continue
        if k is None or size is None or k > size:
            return False
        todo.extend(n.users)
    return True


def statistic_counts(gm: fx.GraphModule) -> list[fx.Node]:
    """The load-balancing counts of `gm` (module docstring), in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _COUNTS
            and _only_statistics(n)]


def reduce_router_stats(gm: fx.GraphModule, ranks: int) -> fx.GraphModule:
    """Average each load-balancing count over the `data_group` ranks, `ranks` of them (module
    docstring)."""
    counts = statistic_counts(gm)
    if not counts:
        return gm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a plain attribute, as tp_group
        gm.data_group = UnboundGroup(ranks)   # the runtime binds the real group
    g = gm.graph
    for count in counts:
        with g.inserting_before(count):
            grp = g.get_attr(DATA_GROUP_ATTR)
        with g.inserting_after(count):
            mean = g.call_function(mean_over, (count, grp))
        mean.meta[K.VAL] = count.meta.get(K.VAL)
        count.replace_all_uses_with(mean, delete_user_cb=lambda u: u is not mean)
    g.lint()
    gm.recompile()
    return gm


def router_stats_pass(ranks: int) -> Pass:
    """The pass for the pass pipeline (autopar/build.py), `ranks` = c·d."""
    return Pass(name="router_stats", run=lambda gm: reduce_router_stats(gm, ranks),
                reads=(K.VAL,), writes=(K.VAL,))
