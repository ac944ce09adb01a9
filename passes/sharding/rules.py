"""The tensor-parallel op rules in one table: ATen op (its overload packet) -> rule.

A rule is `rule(p: Propagator, node) -> layout of node`: it reads its inputs' layouts with
`p.eff`, may `p.demand` a layout of an input (deciding a parameter's split, or putting a
conversion on the edge), may set `p.role[node]`, and raises `Conflict` (a split that would have
to be gathered) or `Refine` (a fused output cut at non-block bounds). To teach the engine an op:
write its rule in the family module it belongs to (elementwise, views, reductions, products) and
add a row here; a test in tests/unit/test_sharding_rules.py per family.

An op with no row: grouped matmuls (matched by name, not packet) go to `grouped_mm_rule`,
pointwise ops (torch.Tag.pointwise) to `pointwise_rule`, the rest are computed replicated.
The context mode's rows (passes/sharding/context.py `CONTEXT_RULES`) take precedence there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from autopar.passes.sharding.elementwise import (copy_rule, new_factory_rule, pointwise_rule,
                                                replicated)
from autopar.passes.sharding.ops import (MATMUL_OPS, NEW_FACTORIES, NLL_OPS, REDUCE_DIM, SOFTMAX,
                                         SPLIT_OPS, is_grouped_mm, is_pointwise, packet)
from autopar.passes.sharding.products import (baddbmm_rule, embedding_rule, grouped_mm_rule,
                                              matmul_rule, sdpa_rule)
from autopar.passes.sharding.reductions import (cross_entropy_rule, nll_rule, norm_rule,
                                                reduce_rule, softmax_rule)
from autopar.passes.sharding.views import (cat_rule, expand_rule, gather_scatter_rule, index_rule,
                                           complex_view_rule, repeat_interleave_rule, reshape_rule,
                                           slice_rule,
                                           split_rule, stack_rule, transpose_rule)

if TYPE_CHECKING:
    from autopar.passes.sharding.propagator import Propagator

aten = torch.ops.aten

Rule = Callable[["Propagator", fx.Node], Any]

RULES: dict[Any, Rule] = {
    **{op: reshape_rule for op in (aten.view, aten.reshape, aten._unsafe_view, aten.flatten,
                               aten.unflatten, aten.squeeze, aten.unsqueeze)},
    aten.view_as_complex: complex_view_rule, aten.view_as_real: complex_view_rule,
    aten.expand: expand_rule, aten.broadcast_to: expand_rule,
    aten.index: index_rule, aten.stack: stack_rule, aten.baddbmm: baddbmm_rule,
    aten.transpose: transpose_rule, aten.t: transpose_rule, aten.permute: transpose_rule,
    aten.numpy_T: transpose_rule, aten.mT: transpose_rule,
    **{op: split_rule for op in SPLIT_OPS},
    aten.cat: cat_rule,
    aten.slice: slice_rule, aten.select: slice_rule, aten.narrow: slice_rule,
    aten.repeat_interleave: repeat_interleave_rule,
    aten.layer_norm: norm_rule, aten.native_layer_norm: norm_rule, aten.rms_norm: norm_rule,
    **{op: softmax_rule for op in SOFTMAX},
    **{op: reduce_rule for op in REDUCE_DIM},
    **{op: matmul_rule for op in MATMUL_OPS},
    aten.embedding: embedding_rule,
    aten.scaled_dot_product_attention: sdpa_rule,
    aten.cross_entropy_loss: cross_entropy_rule,
    **{op: nll_rule for op in NLL_OPS},
    **{op: new_factory_rule for op in NEW_FACTORIES},
    aten.copy_: copy_rule, aten.copy: copy_rule,
    **{op: gather_scatter_rule for op in (aten.gather, aten.scatter, aten.scatter_,
                                          aten.scatter_add, aten.scatter_add_,
                                          aten.scatter_reduce, aten.scatter_reduce_)},
}


def rule_for(node: fx.Node) -> Rule:
    """The rule of `node`'s op: its row, else the grouped-matmul, pointwise or replicated one.
    A reduction's elementwise overloads (`torch.min(x, y)`: aten.min.other, as Apertus's
    xIELU activation clamps) are pointwise, not the packet's reduction."""
    if is_grouped_mm(node):
        return grouped_mm_rule
    if packet(node) in REDUCE_DIM and is_pointwise(node):
        return pointwise_rule
    handler = RULES.get(packet(node))
    if handler is not None:
        return handler
    return pointwise_rule if is_pointwise(node) else replicated
