"""Rule family: elementwise ops and ops with no rule. A pointwise op keeps its operands' common
split (broadcasting replicated ones, slicing them locally where they meet the split dim); an op
no rule knows is computed whole from replicated inputs. A buffer made from a value
(x.new_empty(sizes) and its kin) reads none of its values: split like it where it has its
shape along the split dim, whole otherwise; a copy into a buffer (dst.copy_(src), a slice of
it being written) keeps the buffer's layout, its source demanded in it.

Each rule reads its inputs' layouts with p.eff, may p.demand layouts of inputs (deciding a
parameter's split, or putting a conversion on the edge), and returns the output's layout.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from autopar.passes.sharding.layout import R, Conflict, Layout, Shard, Whole, union
from autopar.passes.sharding.ops import (TRANSPARENT, is_tensor, like, packet, shape,
                                         tensor_args)

if TYPE_CHECKING:
    from autopar.passes.sharding.propagator import Propagator


def replicated(p: Propagator, node: fx.Node) -> Any:
    """An op with no rule: computed whole on every rank, from replicated inputs."""
    for arg in tensor_args(node):
        p.demand(node, arg, R)
    return like(node, R)


def split_operands(p: Propagator, node: fx.Node,
                   args: list[fx.Node]) -> list[tuple[fx.Node, Shard]]:
    """The operands among `args` that `node` sees split, with their Shard."""
    return [(a, p.eff(node, a)) for a in args if isinstance(p.eff(node, a), Shard)]


def pointwise_rule(p: Propagator, node: fx.Node) -> Layout:
    """out[i] = f(a[i], b[i], ...) with broadcasting: all split operands must agree on the
    (right-aligned) output dim; replicated operands broadcast along it or are sliced locally."""
    out_shape = shape(node)
    if out_shape is None:
        return replicated(p, node)
    nd = len(out_shape)
    args = tensor_args(node)
    shards = split_operands(p, node, args)
    if not shards:
        return R
    dims = {l.dim + nd - len(shape(a)) for a, l in shards}
    first = shards[0][1]
    origins = union([l for _, l in shards])
    if len(dims) > 1 or any(l.blocks != first.blocks or l.padded != first.padded
                            for _, l in shards):
        raise Conflict(origins, node, f"{node.name}: operands split differently "
                       f"({', '.join(f'{a.name}: {l}' for a, l in shards)})")
    od = dims.pop()
    if first.padded and packet(node) not in TRANSPARENT:
        raise Conflict(origins, node, f"{node.name}: elementwise op on a padded vocab dim")
    target = replace(first, dim=od, origins=origins, seq=any(l.seq for _, l in shards))
    for a in args:
        if isinstance(p.eff(node, a), Shard):
            continue
        i = od - (nd - len(shape(a)))
        if i < 0 or shape(a)[i] == 1:
            if not isinstance(p.eff(node, a), Whole):   # Whole broadcast: a summand gradient
                p.demand(node, a, R)  # broadcast along the split dim: nothing to do
        else:
            p.demand(node, a, replace(target, dim=i))
    return target


def pointwise_same_shape(p: Propagator, node: fx.Node, args: list, first: Shard) -> Layout:
    origins = union([l for _, l in split_operands(p, node, args)])
    target = replace(first, origins=origins)
    for a in args:
        p.demand(node, a, target)
    return target


def new_factory_rule(p: Propagator, node: fx.Node) -> Layout:
    """x.new_empty(sizes) / new_zeros / new_ones / new_full: a fresh buffer; x gives only its
    dtype and device, so nothing is demanded of it. The buffer is split like x where it has x's
    rank and the length of x's split dim (the shape taken from x: the local sizes are x's,
    as transformers' DeepSeek-V3 `expand_kv` builds its keys from kv_b_proj's output), whole
    otherwise. Its fill is the same on every rank and at every position, so either is exact."""
    x, out = node.args[0], shape(node)
    lay = p.eff(node, x)
    if isinstance(lay, Shard) and not lay.padded and out is not None \
            and len(out) == len(shape(x)) and out[lay.dim] == shape(x)[lay.dim]:
        return lay
    return R


def copy_rule(p: Propagator, node: fx.Node) -> Any:
    """dst.copy_(src) (and the functional copy): the result is dst's, in dst's layout — dst is
    written in place, so it is never converted (a conversion would write into a copy and the
    buffer would stay unwritten); src, only read, is demanded in dst's layout, whole along a
    dim it broadcasts (its length 1, or missing)."""
    dst, src = node.args[0], node.args[1]
    lay = p.eff(node, dst)
    if is_tensor(src):
        want: Layout = R
        if isinstance(lay, Shard):
            i = lay.dim - (len(shape(dst)) - len(shape(src)))
            if i >= 0 and shape(src)[i] != 1:
                want = replace(lay, dim=i)
        p.demand(node, src, want)
    return lay
