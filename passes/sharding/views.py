"""Rule family: views and data movement — reshapes (the split dim mapped through, `map_reshape`),
expand, transposes, split / chunk / unbind, cat and stack, slices and index selections of whole
blocks, repeat_interleave. A fused output cut at non-block bounds raises Refine; a block that
cannot be split the way its consumer views it is held whole (tentatively).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.sharding.elementwise import pointwise_same_shape, replicated, split_operands
from autopar.passes.sharding.layout import (R, Conflict, Layout, Refine, Shard, Whole, cumsum,
                                            map_reshape, prod, union, unflattened_sizes)
from autopar.passes.sharding.ops import (chain_dim, is_inplace, norm_dim, packet, selected_range,
                                         shape)

if TYPE_CHECKING:
    from autopar.passes.sharding.propagator import Propagator

aten = torch.ops.aten


def reshape_rule(p: Propagator, node: fx.Node) -> Layout:
    src = node.args[0]
    lay = p.eff(node, src)
    if not isinstance(lay, Shard):
        return lay
    mapped = map_reshape(shape(src), shape(node), lay, p.t)
    if mapped is None:
        factors = unflattened_sizes(shape(src), shape(node), lay.dim)
        why = (f"; dim {lay.dim} ({shape(src)[lay.dim]}) unflattens into {factors} and a split "
               f"must fall on the leading factor (e.g. the key/value groups of a fused qkv "
               f"projection): t must divide {factors[0]}") if factors else ""
        conflict = Conflict(lay.origins, node,
                            f"{node.name}: reshape {list(shape(src))} -> {list(shape(node))} "
                            f"cannot keep dim {lay.dim} split in {p.t} (blocks {lay.blocks}): "
                            f"sizes do not divide by t={p.t}{why}", indivisible=True)
        _hold_whole_for_reshape(p, node, lay, conflict)
        _refine_for_reshape(p, node, lay, conflict)
        raise conflict
    return mapped


def complex_view_rule(p: Propagator, node: fx.Node) -> Layout:
    """view_as_complex (…, n, 2) -> (…, n) and view_as_real (…, n) -> (…, n, 2) (a rotary
    through complex numbers, Llama 4's): the leading dims keep their layout; a split of the
    (real, imaginary) pair itself cannot be kept."""
    src = node.args[0]
    lay = p.eff(node, src)
    if (isinstance(lay, Shard) and packet(node) is aten.view_as_complex
            and lay.dim == len(shape(src)) - 1):
        raise Conflict(lay.origins, node, f"{node.name}: view_as_complex cannot keep the "
                       f"(real, imaginary) pair (dim {lay.dim}) split in {p.t}")
    return lay


def repeat_rule(p: Propagator, node: fx.Node) -> Layout:
    """x.repeat(sizes): r copies of x along each dim (new leading dims for the extra sizes).
    A split dim repeated r times holds the same blocks r times over (each rank's local repeat
    is its part of every copy: Llama 4's (tokens, hidden) rows repeated once per expert).
    The context split's rule (sharding.context CONTEXT_RULES); the tensor split gathers a
    repeat's split input (cheaper than gathering its r copies after)."""
    src = node.args[0]
    lay = p.eff(node, src)
    if not isinstance(lay, Shard):
        return lay
    sizes = list(node.args[1])
    extra = len(sizes) - len(shape(src))
    r = int(sizes[lay.dim + extra])
    return replace(lay, dim=lay.dim + extra, blocks=lay.blocks * r,
                   whole=lay.whole * r, src=None if lay.src is None else lay.src * r)


def _hold_whole_for_reshape(p: Propagator, node: fx.Node, lay: Shard,
                            conflict: Conflict) -> None:
    """A fused output viewed into heads whose small blocks cannot be split by t (Falcon-7B's
    multi-query (B, T, (H+2)·d) -> (B, T, H+2, d): the one k and v head): hold those blocks
    whole (tentatively, Propagator.hold_whole) when that makes the view expressible."""
    src, dst = shape(node.args[0]), shape(node)
    for j in range(len(dst)):
        unit = prod(dst[j + 1:])
        flags = tuple(w or b % (p.t * unit) != 0 for b, w in zip(lay.blocks, lay.flags()))
        if flags == lay.flags():
            continue
        if map_reshape(src, dst, replace(lay, whole=flags), p.t) is not None:
            p.hold_whole(lay, conflict, [i for i, f in enumerate(flags) if f])


def _refine_for_reshape(p: Propagator, node: fx.Node, lay: Shard, conflict: Conflict) -> None:
    """A fused output unflattened as (k, size/k) (PyTorch's MultiheadAttention in-projection:
    (…, 3E) → (…, 3, E)) keeps its split only if each of the k parts is split on its own: raise
    a tentative Refine with every block cut into k equal parts when that makes the reshape
    expressible. Tentative, because the same shapes arise where the inner part must stay whole
    (k/v heads fewer than t: (…, kv·d) → (…, kv, d) would split the head dim d): if the refined
    split conflicts later, the driver undoes it and reports `conflict`."""
    src, dst = shape(node.args[0]), shape(node)
    origin = next(iter(lay.origins)) if len(lay.origins) == 1 else None
    seed = p.refine.get(origin) if origin else None
    if origin is None or lay.padded or not (seed is None or seed == lay.blocks):
        return
    for k in sorted({d for d in dst if d > 1}):
        if any(b % (k * p.t) for b in lay.blocks):
            continue
        finer = tuple(b // k for b in lay.blocks for _ in range(k))
        if map_reshape(src, dst, replace(lay, blocks=finer), p.t) is not None:
            raise Refine(origin, finer, fallback=conflict)


def expand_rule(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return lay
    return replace(lay, dim=lay.dim + len(shape(node)) - len(shape(node.args[0])))


def transpose_rule(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return lay
    return replace(lay, dim=chain_dim(node, lay.dim, forward=True))


def split_rule(p: Propagator, node: fx.Node) -> Any:
    """split/chunk: pieces along the split dim must be unions of whole blocks (refining the
    seed's blocks when they are not: fused qkv)."""
    src = node.args[0]
    lay = p.eff(node, src)
    vals = node.meta[K.VAL]
    if not isinstance(lay, Shard):
        return tuple(lay for _ in vals)
    nd = len(shape(src))
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
    if packet(node) is aten.unbind:
        dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
        if dim == lay.dim:
            raise Conflict(lay.origins, node, f"{node.name}: unbind along the split dim")
        return tuple(replace(lay, dim=lay.dim - (lay.dim > dim)) for _ in vals)
    if dim != lay.dim:
        return tuple(lay for _ in vals)
    sizes = [int(v.shape[dim]) for v in vals]
    cuts = set(cumsum(sizes))
    bounds = set(cumsum(list(lay.blocks)))
    if lay.padded or not cuts <= bounds:
        origin = next(iter(lay.origins)) if len(lay.origins) == 1 else None
        seed = p.refine.get(origin) if origin else None
        if origin and not lay.padded and (seed is None or seed == lay.blocks):
            merged = sorted(cuts | bounds)
            raise Refine(origin, tuple(b - a for a, b in zip([0] + merged, merged)))
        raise Conflict(lay.origins, node, f"{node.name}: split {sizes} cuts blocks "
                       f"{lay.blocks} of the split dim")
    pieces, start = [], 0
    offsets = [0] + cumsum(list(lay.blocks))
    for size in sizes:
        pieces.append(_pick_blocks(lay, [i for i, o in enumerate(offsets[:-1])
                                         if start <= o < start + size]))
        start += size
    return tuple(pieces)


def _pick_blocks(lay: Shard, idx: list[int]) -> Shard | Whole:
    """The blocks `idx` of `lay` (a split piece or a selected range of its split dim): Whole
    when every one is held whole (the replicated part of a mixed projection: k, v)."""
    whole = tuple(lay.flags()[i] for i in idx)
    if all(whole):
        return Whole(origins=lay.origins)
    return replace(lay, blocks=tuple(lay.blocks[i] for i in idx),
                   whole=whole if any(whole) else (),
                   src=tuple(lay.src[i] for i in idx) if lay.src is not None else None)


def cat_rule(p: Propagator, node: fx.Node) -> Layout:
    tensors = list(node.args[0])
    nd = len(shape(node))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), nd)
    tensors = [a for a in tensors if shape(a) and shape(a) != (0,)]
    shards = split_operands(p, node, tensors)
    if not shards:
        return R
    first = shards[0][1]
    if first.dim == dim:
        if len(shards) != len(tensors):
            raise Conflict(union([l for _, l in shards]), node,
                           f"{node.name}: cat along the split dim with replicated pieces")
        return replace(first, blocks=sum((l.blocks for _, l in shards), ()),
                       origins=union([l for _, l in shards]))
    return pointwise_same_shape(p, node, tensors, first)


def slice_rule(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return lay
    nd = len(shape(node.args[0]))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    if dim == lay.dim:
        if shape(node) == shape(node.args[0]):
            return lay  # a no-op slice (x[:, :T] with T the full size)
        conflict = Conflict(lay.origins, node, f"{node.name}: slices the split dim {dim}")
        sel = selected_range(p.gm, node)
        if sel is None:
            raise conflict
        return _select_blocks(p, lay, sel, conflict)
    if packet(node) is aten.select:
        return replace(lay, dim=lay.dim - (lay.dim > dim))
    return lay


def _select_blocks(p: Propagator, lay: Shard, sel: tuple[int, int], conflict: Conflict) -> Any:
    """The rows [a, b) of the split dim: whole blocks are kept (Whole when all are held whole);
    a selection that cuts blocks refines the seed at its bounds (as split does) and runs
    again."""
    a, b = sel
    bounds = [0] + cumsum(list(lay.blocks))
    if a in bounds and b in bounds and a < b:
        return _pick_blocks(lay, [i for i in range(len(lay.blocks))
                                  if a <= bounds[i] and bounds[i + 1] <= b])
    p.refine_at(lay, {a, b})
    raise conflict


def repeat_interleave_rule(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return replicated(p, node)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    reps = node.args[1]
    if dim is None or not isinstance(reps, int):
        raise Conflict(lay.origins, node, f"{node.name}: repeat_interleave without a dim")
    dim = norm_dim(dim, len(shape(node)))
    if dim != lay.dim:
        return lay
    return replace(lay, blocks=tuple(b * reps for b in lay.blocks))


def index_rule(p: Propagator, node: fx.Node) -> Layout:
    """x[..., idx, ...] with one index tensor (Falcon's qkv[:, :, :, [-2]]): the indexed dim
    is replaced by the index's dims; fine while that is not the split dim."""
    x, indices = node.args[0], list(node.args[1])
    lay = p.eff(node, x)
    tensors = [i for i, ix in enumerate(indices) if ix is not None]
    if not isinstance(lay, Shard):
        return replicated(p, node)
    d = tensors[0] if len(tensors) == 1 else None
    conflict = Conflict(lay.origins, node, f"{node.name}: indexes the split dim {lay.dim} "
                        f"(or several dims at once)")
    if d is not None and d == lay.dim and not lay.padded:
        sel = selected_range(p.gm, node)   # a constant run of rows: whole blocks of a fused
        if sel is not None:                # output (Falcon's multi-query k: [..., [-2], :])
            p.demand(node, indices[d], R)
            return _select_blocks(p, lay, sel, conflict)
    if d is None or d == lay.dim or lay.padded:
        raise conflict
    p.demand(node, indices[d], R)
    extra = len(shape(indices[d])) - 1
    return replace(lay, dim=lay.dim + (extra if lay.dim > d else 0))


def stack_rule(p: Propagator, node: fx.Node) -> Layout:
    """stack(xs, dim) = cat of xs unsqueezed at dim (GPT-J's rotate_every_two): the pieces
    must share one layout; the split dim shifts past the new one."""
    tensors = list(node.args[0])
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0),
                    len(shape(node)))
    shards = split_operands(p, node, tensors)
    if not shards:
        return R
    lay = pointwise_same_shape(p, node, tensors, shards[0][1])
    return replace(lay, dim=lay.dim + (lay.dim >= dim))


def gather_scatter_rule(p: Propagator, node: fx.Node) -> Any:
    """x.gather(d, idx) / x.scatter(d, idx, src or value) (scatter_add, scatter_reduce, in
    place or not): position for position along every dim but d, so a split along another dim
    (a router's per-token picks among its experts: transformers' DeepSeek-V3 group mask) is
    kept where x, idx and src agree on it; along d it conflicts. In place, x is written: it
    keeps its own layout (never converted: a conversion would write into a copy) and the
    others are demanded in it; whole, every operand is read whole."""
    x, idx = node.args[0], node.args[2]
    d = norm_dim(node.args[1], len(shape(x)))
    src = node.args[3] if len(node.args) > 3 else node.kwargs.get("src")
    operands = [a for a in (x, idx, src) if isinstance(a, fx.Node)]
    inplace = is_inplace(node.target)
    first = next((l for _, l in split_operands(p, node, operands)), None)
    lay = p.eff(node, x) if inplace else first
    if not isinstance(lay, Shard):
        return replicated(p, node)
    if lay.dim == d:
        raise Conflict(lay.origins, node, f"{node.name}: a gather / scatter along the split "
                                          f"dim (dim {d})")
    if any(len(shape(a)) != len(shape(x)) or shape(a)[lay.dim] != shape(x)[lay.dim]
           for a in operands):
        raise Conflict(lay.origins, node, f"{node.name}: a gather / scatter whose operands "
                                          f"differ in length along the split dim")
    for a in operands:
        if not (inplace and a is x):
            p.demand(node, a, lay)
    return lay
