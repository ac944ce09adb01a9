"""Rule family: norms, softmax, reductions and losses. A statistic over other dims keeps the split;
over the split dim a sum becomes Partial, a norm of a column-parallel output distributes its
statistics (role split_norm), a mean of one becomes Partial (role partial_mean), and
log_softmax → nll_loss or cross_entropy over a vocab split is the vocab-parallel cross-entropy
(role vocab_ce); anything else over the split dim conflicts.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autopar.passes.sharding.elementwise import replicated
from autopar.passes.sharding.layout import R, Conflict, Layout, Partial, Shard
from autopar.passes.sharding.ops import (NLL_OPS, TRANSPARENT, is_pointwise, like, norm_dim,
                                         packet, reduce_dims, shape, tensor_args)

if TYPE_CHECKING:
    from autopar.passes.sharding.propagator import Propagator

aten = torch.ops.aten


def norm_rule(p: Propagator, node: fx.Node) -> Any:
    """layer_norm / rms_norm: fine while the split dim is not one of the normalised dims; over
    a plainly split last dim the statistics are distributed (shard.tp_norm, role 'split_norm':
    the mean and the variance for LayerNorm, the mean square for RMSNorm, each one small
    all-reduce) and the weight and bias are split like x's last dim."""
    x = node.args[0]
    lay = p.eff(node, x)
    normalized = node.args[1]
    over_split = isinstance(lay, Shard) and lay.dim >= len(shape(x)) - len(normalized)
    if over_split and _splittable_norm(node, lay) and _fed_by_column(p, x):
        for a in tensor_args(node)[1:]:
            p.demand(node, a, replace(lay, dim=0))
        p.role[node] = "split_norm"
        return lay
    for a in tensor_args(node)[1:]:
        p.demand(node, a, R)
    if over_split:
        raise Conflict(lay.origins, node, f"{node.name}: normalises over the split dim")
    return like(node, lay)


def _fed_by_column(p: Propagator, x: fx.Node) -> bool:
    """x is a column-parallel output through one-input elementwise ops only (BERT's transform:
    dense → gelu → LayerNorm). A norm of anything else split (a residual stream a fallen-back
    projection left split) conflicts instead: distributing it would carry the split on into
    the stream, where a replicated region is cheaper."""
    n = x
    while p.role.get(n) != "column":
        ins = tensor_args(n) if n.op == "call_function" else []
        if len(ins) != 1 or not (is_pointwise(n) or packet(n) in TRANSPARENT):
            return False
        n = ins[0]
    return True


def _splittable_norm(node: fx.Node, lay: Shard) -> bool:
    """layer_norm / rms_norm over the last dim only, split plainly (not the sequence, no
    vocab padding) — the norm shard.tp_norm computes with all-reduced statistics."""
    return (packet(node) in {aten.layer_norm, aten.rms_norm} and len(node.args[1]) == 1
            and lay.dim == len(shape(node.args[0])) - 1 and not lay.seq and not lay.padded)


def softmax_rule(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if isinstance(lay, Shard) and norm_dim(node.args[1], len(shape(node))) == lay.dim:
        if _feeds_only_nll(node, lay):
            return lay  # log_softmax → nll_loss: one vocab-parallel cross-entropy (see nll_rule)
        raise Conflict(lay.origins, node, f"{node.name}: softmax over the split dim")
    return lay


def _feeds_only_nll(node: fx.Node, lay: Shard) -> bool:
    """log_softmax over the class dim whose every user is an unweighted nll_loss of it."""
    if packet(node) not in {aten.log_softmax, aten._log_softmax} or lay.seq or not node.users:
        return False
    class_dim = 1 if len(shape(node)) >= 2 else 0
    return lay.dim == class_dim and all(
        packet(u) in NLL_OPS and u.args[0] is node and _nll_weight(u) is None for u in node.users)


def _nll_weight(node: fx.Node) -> Any:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")


def nll_rule(p: Propagator, node: fx.Node) -> Layout:
    """nll_loss(log_softmax(logits split over the vocab)) = cross_entropy(logits): the same
    vocab-parallel cross-entropy; the log_softmax becomes dead code."""
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return replicated(p, node)
    if not _feeds_only_nll(node.args[0], lay):
        raise Conflict(lay.origins, node, f"{node.name}: nll_loss of a split value that is not "
                       f"a log_softmax over the vocab (or with class weights)")
    p.demand(node, node.args[1], R)
    p.role[node] = "vocab_ce"
    return R


def reduce_rule(p: Propagator, node: fx.Node) -> Any:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return like(node, lay)
    dims, keep = reduce_dims(node)
    if lay.dim in dims:
        if packet(node) is aten.sum and not lay.padded:
            return Partial()
        # only of a column-parallel output (OLMo-2's q/k RMSNorm over all heads): a mean of a
        # residual stream a projection left split (a dense MLP whose up projection fell back
        # making its down projection a column candidate) conflicts, as a norm does there
        if packet(node) is aten.mean and not lay.padded and not lay.seq \
                and _fed_by_column(p, node.args[0]):
            p.role[node] = "partial_mean"  # mean(x_local)/t per rank; summed = the global mean
            return Partial()
        if packet(node) is aten.mean and not lay.padded and not lay.seq:
            raise Conflict(lay.origins, node, f"{node.name}: a mean over the split dim of a "
                           f"value no column-parallel projection produced (a residual stream "
                           f"would stay split)")
        raise Conflict(lay.origins, node, f"{node.name}: reduces over the split dim")
    new_dim = lay.dim if keep else lay.dim - sum(d < lay.dim for d in dims)
    return like(node, replace(lay, dim=new_dim))


def cross_entropy_rule(p: Propagator, node: fx.Node) -> Layout:
    """cross_entropy(logits split over the vocab) → vocab-parallel cross-entropy (Replicate)."""
    logits = node.args[0]
    lay = p.eff(node, logits)
    if not isinstance(lay, Shard):
        return replicated(p, node)
    class_dim = 1 if len(shape(logits)) >= 2 else 0
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if lay.dim != class_dim or lay.seq:
        return replicated(p, node)
    if weight is not None or smoothing:
        raise Conflict(lay.origins, node, f"{node.name}: cross-entropy with "
                       f"{'class weights' if weight is not None else 'label smoothing'} has no "
                       f"vocab-parallel form here; the LM head stays replicated")
    p.demand(node, node.args[1], R)
    p.role[node] = "vocab_ce"
    return R
