"""Partial sums: which ops are linear in a Partial operand (its output stays a summand per rank,
reduced once, later) and the Partial they make. Megatron reduces a row-parallel product right
away; keeping the sum unreduced through linear ops merges reductions (parallel attention + MLP
branches summed first, a mixture of experts reduced once after the routing weights) and
carries a bias or a dropout's noise to be applied once, after the reduction.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autopar.passes.sharding.layout import Partial, Replicate
from autopar.passes.sharding.ops import (RESHAPES, dropout_is_identity, packet, shape,
                                         tensor_args)

aten = torch.ops.aten


def keeps_partial(node: fx.Node, lays: list[Any]) -> bool:
    """Whether `node` is linear in its Partial operands (`lays`: its tensor operands' layouts in
    order), so its output stays a Partial, reduced later, once."""
    args = tensor_args(node)
    if not any(isinstance(l, Partial) for l in lays):
        return False
    op = packet(node)
    if op in RESHAPES or op in {aten.alias, aten.clone, aten.contiguous, aten.to,
                                 aten._to_copy, aten.type_as}:
        lay = lays[0] if isinstance(lays[0], Partial) else Partial()
        if lay.masked:          # bias·noise has the value's full shape: no reshape
            return shape(node) == shape(args[0])
        return not lay.biases or shape(node)[-1:] == shape(args[0])[-1:]
    if op in {aten.add, aten.add_, aten.sub} and len(args) == 2 \
            and node.kwargs.get("alpha", 1) == 1:
        # Σa + Σb = Σ(a + b): parallel attention / MLP branches (Falcon, GPT-NeoX) sum
        # before one reduction; a subtrahend's bias would need negating, so none there.
        # Only when the sum is each operand's one use: an operand reduced for another
        # user anyway (a sequential block's residual, also read by the next norm) saves
        # nothing, and the residual stream stays replicated as in Megatron.
        return (all(isinstance(l, Partial) for l in lays)
                and all(len(a.users) == 1 for a in args)
                and (op is not aten.sub or not lays[1].pending))
    # dropout of probability 0 (GPT-J's and GPT-NeoX's defaults) or not training is the
    # identity: a bias still to be added passes through it as through a view
    if op is aten.dropout and dropout_is_identity(node):
        return True
    # dropout of a biased sum: the biases are masked by the same noise (see Partial),
    # once; the rewriter draws the noise on the replicated stream
    if op is aten.dropout and len(args) == 1 and lays[0].biases and not lays[0].masked:
        return True
    # scaling by a number, or dropout with the replicated stream (every rank the same
    # mask: the sum's mask), is linear: unless a bias is still to be added
    if op in {aten.mul, aten.div, aten.neg, aten.dropout} and len(args) == 1:
        return not lays[0].pending
    # linear in the one Partial operand, the others replicated (no bias pending): each
    # expert's output scaled by its routing weight (mul), the rows picked back in token
    # order (index) and the k experts of a token summed (sum over a dim) — a mixture of
    # experts reduces once, after all of it, as a dense MLP after its row-parallel product.
    # Only for the Partial's one use: one reduced for another user anyway (an RMSNorm's
    # input, also read by its statistic) would be reduced twice.
    if op in {aten.mul, aten.index, aten.sum} and isinstance(lays[0], Partial) \
            and not lays[0].pending and len(args[0].users) == 1 \
            and all(isinstance(l, Replicate) for l in lays[1:]):
        return op is not aten.mul or len(args) == 2
    return False


def partial_sum(node: fx.Node, parts: list[Partial]) -> Partial:
    """The Partial `node` makes of its Partial operands `parts` (kept: `keeps_partial`): the
    biases still to be added carried on; a dropout of a biased sum masks them by its noise."""
    if packet(node) is aten.dropout and parts[0].biases and not dropout_is_identity(node):
        return Partial(masked=tuple((b, node.name) for b in parts[0].biases))
    return Partial(tuple(b for l in parts for b in l.biases),
                   tuple(m for l in parts for m in l.masked))
