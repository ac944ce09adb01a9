"""Tensor-parallel layouts and the per-op rules that propagate them through an ATen graph.

A layout says how the tensor-parallel ranks 0..t-1 hold a value of the single-device program:

  Replicate()                 every rank holds the whole value
  Shard(dim, blocks)          dimension `dim` is cut into consecutive blocks of global sizes
                              `blocks` (sum = the dim's size); rank r holds the r-th 1/t of EVERY
                              block, concatenated. One block is the plain Megatron split; a fused
                              qkv output (B, T, 3C) is Shard(2, (C, C, C)) so that q, k and v
                              are each split by heads. `padded` > 0: the dim is padded to that
                              global size first (vocab padding), rank r holds rows
                              [r·padded/t, (r+1)·padded/t).
                              `whole` (a flag per block): blocks every rank holds whole (a
                              mixed projection: q split by heads, the one k/v head of
                              multi-query attention replicated); rank r holds the r-th 1/t of
                              each other block and all of these, in block order.
  Whole()                     every rank holds the whole value, computed inside a split region
                              (a mixed projection's replicated part, and what is computed from
                              it): its gradient on each rank is a summand — only this rank's
                              heads read it — summed where it leaves the region (the
                              projection's f and copy_to_tp_parts on its weight rows).
  Partial(biases, masked)     every rank holds a summand; the value is the sum over ranks
                              (a row-parallel product). `biases` names the bias nodes still
                              to be added once, after the reduction; two Partials summed stay
                              Partial (parallel attention + MLP branches: one reduction).
                              A dropout of a biased Partial stays Partial: the summands take
                              its noise (drawn once, on the replicated stream) and `masked`
                              pairs each bias with that dropout, added as bias·noise.

Propagation runs forward in topological order. A weight matmul whose input is replicated is a
column-parallel *candidate*: its output is seeded Shard(last) with the candidate's name as
`origin`. Rules carry shards through elementwise ops, reshapes (the split dim is mapped through
the reshape; see `map_reshape`), transposes, split/chunk/cat, attention, reductions over other
dims, until a matmul contracts over the split dim (row-parallel → Partial). A value that would
have to be gathered back raises `Conflict(origins)`: the driver turns those candidates off and
runs again (replicated fallback), so only regions that close cheaply stay split. A split that
cuts a fused output at non-block boundaries raises `Refine(origin, blocks)` and the driver
re-seeds that candidate with finer blocks. A block whose piece cannot be split the way its
consumer needs (one k/v head where attention splits heads) raises a tentative
`Refine(origin, blocks, whole=...)`: that block is held whole (Whole) while the rest stays
split; if that conflicts later, the driver undoes it and the candidate falls back.

The same engine runs in a context mode (`ContextPropagator`, `context_layouts`; context.py,
docs/DESIGN.md §6.1): over the context ranks (t := c) on the captured graph, the inputs'
tokens seeded as a sequence Shard, no column candidates; whole operands meeting the rank's
tokens resolve to a selection at its global positions, attention reads its keys and values
whole, a sum over the tokens is summed over the context ranks where read whole, a sort along
them (a mixture of experts' routing) orders the rank's own rows (Rows, Counts), and what this
engine would gather along the tokens is refused in one line.

The package, one job per module:
  layout.py       the layout algebra (Replicate, Shard, Whole, Partial; Conflict, Refine;
                  map_reshape)
  ops.py          what a node is: its op, shape, tensor operands, op families, graph queries
  rules.py        the op-rule table (ATen op -> rule); the rules by family in elementwise.py,
                  views.py, reductions.py and products.py
  partials.py     which ops keep a Partial unreduced, and the Partial they make
  propagator.py   the propagator (one forward pass under fixed disabled candidates)
  context.py      the context mode (ContextPropagator, context_layouts, context_refusal) and
                  its rules as pure functions; context_verdict, the feasibility query
"""
from __future__ import annotations

from autopar.passes.sharding.context import (CONTEXT_RULES, METHOD_FIX, METHODS, NO_LAYOUT,
                                             SUBMODULE_CALL, ContextPropagator, ContextVerdict,
                                             context_layouts, context_refusal, context_verdict,
                                             dropout_refusal, loss_refusal, method_refusal,
                                             seq_dim_refusal)
from autopar.passes.sharding.layout import (R, Conflict, Layout, Partial, Refine, Replicate,
                                            Shard, Whole, is_split, map_reshape,
                                            unflattened_sizes)
from autopar.passes.sharding.ops import (GROUPED_MM, MATMUL_OPS, NEW_FACTORIES, NLL_OPS, NO_VALUE,
                                         SIZE_ARG_OPS,
                                         SPLIT_OPS, ancestors, dropout_is_identity,
                                         fed_by_grouped_mm, is_expert_bmm,
                                         is_grouped_mm, is_pointwise,
                                         is_router, is_tensor, norm_dim, packet, reaches,
                                         reduce_dims, selected_range, shape, source_line)
from autopar.passes.sharding.propagator import Propagator
from autopar.passes.sharding.rules import RULES, rule_for

__all__ = [
    "CONTEXT_RULES", "METHOD_FIX", "METHODS", "NO_LAYOUT", "SUBMODULE_CALL",
    "ContextPropagator", "ContextVerdict", "context_layouts", "context_refusal",
    "context_verdict", "dropout_refusal", "loss_refusal", "method_refusal", "seq_dim_refusal",
    "R", "Conflict", "Layout", "Partial", "Refine", "Replicate", "Shard", "Whole", "is_split",
    "map_reshape", "unflattened_sizes",
    "GROUPED_MM", "MATMUL_OPS", "NEW_FACTORIES", "NLL_OPS", "NO_VALUE", "SIZE_ARG_OPS",
    "SPLIT_OPS", "ancestors",
    "dropout_is_identity", "fed_by_grouped_mm", "is_expert_bmm",
    "is_grouped_mm", "is_pointwise", "is_router",
    "is_tensor", "norm_dim", "packet", "reaches", "reduce_dims", "selected_range", "shape", "source_line",
    "Propagator", "RULES", "rule_for",
]
