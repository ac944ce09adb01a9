"""Rule family: products — weight matmuls (column-parallel candidates, row-parallel when the
input is split over the contraction dim), grouped expert matmuls, activation products
(attention's q·kᵀ / p·v, baddbmm), embeddings (vocab-parallel, or per-head bias tables split by
columns) and scaled-dot-product attention (split by heads).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autopar.passes.sharding.elementwise import replicated
from autopar.passes.sharding.layout import (R, Conflict, Layout, Partial, Shard, Whole,
                                            round_up, union)
from autopar.passes.sharding.ops import (ancestors, fed_by_grouped_mm, is_router,
                                         matmul_operands, param_root, shape)

if TYPE_CHECKING:
    from autopar.passes.sharding.propagator import Propagator

aten = torch.ops.aten


def matmul_rule(p: Propagator, node: fx.Node) -> Layout:
    """Weight matmuls: column-parallel candidates, row-parallel when the input is split over the
    contraction dim. Activation products (attention): split batch dims must agree."""
    x, w, bias, w_k, w_n = matmul_operands(node)
    if w is None:
        return _batched_matmul(p, node)
    xl = p.eff(node, x)
    k_dim = len(shape(x)) - 1
    out_nd = len(shape(node))
    wl = p.get(w)
    if isinstance(xl, Shard) and xl.dim == k_dim and not xl.seq and isinstance(wl, Shard) \
            and wl.dim == w_n and node.name not in p.off:
        # the weight is already split along its output (a vocabulary table tied to the
        # vocab-parallel embedding: BERT's MLM decoder after its split transform + LayerNorm):
        # gather the input if that pays, and stay vocab-parallel
        why = f"{node.name} reads a weight split along its output"
        if p.gather_split_input(node, x, why):
            xl = R
        else:
            p.demand(node, x, R)
    if isinstance(xl, Shard) and xl.dim == k_dim and not xl.seq:
        p.demand(node, w, replace(xl, dim=w_k))
        if bias is not None:
            p.demand(node, bias, R)
        p.role[node] = "row"
        return Partial((bias.name,) if bias is not None else ())
    # an output too narrow to split and smaller than one padding quantum (Qwen2-MoE's
    # one-wide shared-expert gate) stays replicated: padding it would cost more, as for a
    # small embedding table
    narrow = shape(w)[w_n] % p.t and shape(w)[w_n] < p.vocab_multiple \
        and node.name not in p.refine
    if node.name not in p.off and not (isinstance(xl, Shard) and not xl.seq) \
            and not is_router(node) and not narrow:
        return _column(p, node, (x, w, bias), w_n)
    p.demand(node, w, R)
    if bias is not None:
        p.demand(node, bias, R)
    if isinstance(xl, Shard) and xl.seq:
        # A replicated (fallen-back) weight matmul in a sequence-parallel region reads the
        # all-gathered full sequence, as the column-parallel ones do: its output may feed work
        # that mixes positions (k/v of attention when t > kv_heads), which a sequence split
        # cannot serve. Its weight gradient is then whole on every rank (no all-reduce).
        p.demand(node, x, R)
        return R
    if isinstance(xl, Shard):
        return replace(xl, dim=xl.dim + out_nd - len(shape(x)))
    return R


def _column(p: Propagator, node: fx.Node, xwb: tuple, w_n: int) -> Layout:
    """Weight matmul `node` of a replicated input as a column-parallel candidate: the weight
    split along its output dim `w_n` in the seed's blocks (refined / held whole by the driver;
    one indivisible block padded to a multiple of t, as a vocabulary), the output split along
    its last dim."""
    x, w, bias = xwb
    n_size = shape(w)[w_n]
    blocks = p.refine.get(node.name, (n_size,))
    whole = p.whole.get(node.name, ())
    padded = 0
    if len(blocks) == 1 and n_size % p.t:
        padded = round_up(n_size, p.vocab_multiple * p.t)
    elif any(b % p.t for b, held in zip(blocks, whole or (False,) * len(blocks)) if not held):
        raise Conflict(frozenset({node.name}), node,
                       f"{node.name}: output blocks {blocks} do not divide by t={p.t}",
                       indivisible=True)
    lay = Shard(w_n, blocks, padded, origins=frozenset({node.name}), whole=whole,
                src=tuple(range(len(blocks))))
    p.demand(node, x, R)
    p.demand(node, w, lay)
    if bias is not None:
        p.demand(node, bias, replace(lay, dim=0))
    p.role[node] = "column"
    return replace(lay, dim=len(shape(node)) - 1)


def grouped_mm_rule(p: Propagator, node: fx.Node) -> Layout:
    """Expert tensor parallelism: every expert's FFN split as a dense MLP is. A grouped matmul
    of replicated rows by a 3-D weight is a column-parallel candidate (w split along its output
    dim, each expert's columns alike; the gate/up halves refined into blocks by the chunk that
    follows); one whose rows are split over the contraction dim is row-parallel (w split along
    its contraction dim) and its output Partial, reduced once after the routing weights and the
    sum over the k chosen experts (Propagator._keeps_partial). The group offsets, the router and
    top-k stay replicated."""
    x, w = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    if not (param_root(w) and shape(w) and len(shape(w)) == 3 and shape(x)
            and len(shape(x)) == 2) or node.kwargs.get("bias") is not None:
        return replicated(p, node)
    xl = p.eff(node, x)
    if isinstance(xl, Shard) and xl.dim == 1 and not xl.seq:
        p.demand(node, w, replace(xl, dim=1))
        p.demand(node, offs, R)
        p.role[node] = "row"
        return Partial()
    # the experts' down projection is row-parallel or replicated, never a column candidate
    # (its gate/up fallen back: the experts stay whole, not split along the hidden dim)
    if node.name not in p.off and not isinstance(xl, Shard) and not fed_by_grouped_mm(node):
        blocks = p.refine.get(node.name, (shape(w)[2],))
        if any(b % p.t for b in blocks):
            raise Conflict(frozenset({node.name}), node,
                           f"{node.name}: expert output blocks {blocks} do not divide by "
                           f"t={p.t}", indivisible=True)
        lay = Shard(2, blocks, origins=frozenset({node.name}))
        p.demand(node, x, R)
        p.demand(node, w, lay)
        p.demand(node, offs, R)
        p.role[node] = "column"
        return replace(lay, dim=1)
    return replicated(p, node)


def _batched_matmul(p: Propagator, node: fx.Node, a: Any = None, b: Any = None) -> Layout:
    if a is None:
        a, b = node.args[0], node.args[1]
    la, lb = p.eff(node, a), p.eff(node, b)
    na, nb, nd = len(shape(a)), len(shape(b)), len(shape(node))
    if isinstance(la, Shard) and la.seq and param_root(b) is not None:
        # a weight's batched product in a sequence-parallel region (Llama 4's experts' bmm)
        # reads the all-gathered sequence, as a weight matmul does (matmul_rule), so its
        # weight keeps its tensor split
        p.demand(node, a, R)
        la = R
    if not isinstance(la, Shard) and not isinstance(lb, Shard):
        p.demand(node, a, R); p.demand(node, b, R)
        return R
    if isinstance(la, Shard) and isinstance(lb, Shard) and la.dim == na - 1 \
            and lb.dim == nb - 2 and la.blocks == lb.blocks:
        return Partial()  # contraction over the split dim
    # a split batch dim: the other operand must be split (or broadcast) along the same dim
    for lay, nsrc in ((la, na), (lb, nb)):
        if isinstance(lay, Shard) and nsrc >= 3 and lay.dim < nsrc - 2:
            od = lay.dim + nd - nsrc
            target = replace(lay, dim=od, origins=union([l for l in (la, lb)
                                                          if isinstance(l, Shard)]))
            for arg, n_arg in ((a, na), (b, nb)):
                i = od - (nd - n_arg)
                if i < 0 or shape(arg)[i] == 1:
                    if not isinstance(p.eff(node, arg), Shard):
                        p.demand(node, arg, R)
                else:
                    p.demand(node, arg, replace(target, dim=i))
            return target
    if isinstance(la, Shard) and la.dim == na - 2:
        p.demand(node, b, R)
        return replace(la, dim=nd - 2)
    if isinstance(lb, Shard) and lb.dim == nb - 1:
        p.demand(node, a, R)
        return replace(lb, dim=nd - 1)
    return replicated(p, node)


def baddbmm_rule(p: Propagator, node: fx.Node) -> Layout:
    """baddbmm(input, b1, b2) = beta·input + alpha·(b1 @ b2) (BLOOM's ALiBi attention scores):
    the product as a batched matmul; `input` is added elementwise, so it must follow the
    product's layout (sliced, or broadcast along the split dim)."""
    inp, b1, b2 = node.args[:3]
    lay = _batched_matmul(p, node, b1, b2)
    if isinstance(lay, Partial):
        raise Conflict(union([l for l in (p.eff(node, b1), p.eff(node, b2))
                               if isinstance(l, Shard)]), node,
                       f"{node.name}: baddbmm contracts over the split dim and adds an input")
    if not isinstance(lay, Shard):
        p.demand(node, inp, R)
        return lay
    i = lay.dim - (len(shape(node)) - len(shape(inp)))
    if i < 0 or shape(inp)[i] == 1:
        p.demand(node, inp, R)
    else:
        p.demand(node, inp, replace(lay, dim=i))
    return lay


def embedding_rule(p: Propagator, node: fx.Node) -> Layout:
    """Vocab-parallel embedding: rank r holds rows [r·V/t, (r+1)·V/t), looks up the ids it owns
    (others → 0) and the partial results are summed (Partial).

    A table of per-head attention biases (T5's relative position bias: ids computed from
    positions, not read from the inputs, and the lookup feeds an attention mask) splits by
    columns instead: rank r holds its heads' columns and looks up all ids, Shard(last dim),
    with no reduction; the attention takes the bias split by heads."""
    w, ids = node.args[0], node.args[1]
    if node.name in p.off or not param_root(w):
        p.demand(node, w, R)
        lay = p.eff(node, ids)
        return lay if isinstance(lay, Shard) else R
    cols = shape(w)[1]
    if cols % p.t == 0 and not _reads_inputs(ids) and _feeds_attention_mask(node):
        origin = frozenset({node.name})
        p.demand(node, ids, R)
        p.demand(node, w, Shard(1, (cols,), origins=origin))
        return Shard(len(shape(node)) - 1, (cols,), origins=origin)
    vocab = shape(w)[0]
    if vocab % p.t and vocab < p.vocab_multiple:
        p.demand(node, w, R)  # a small table (e.g. token types): padding would cost more
        return R
    p.demand(node, ids, R)
    padded = round_up(vocab, p.vocab_multiple * p.t) if vocab % p.t else 0
    p.demand(node, w, Shard(0, (vocab,), padded, origins=frozenset({node.name})))
    p.role[node] = "vocab_embedding"
    return Partial()


def _reads_inputs(node: fx.Node) -> bool:
    """Whether `node` depends on a graph input (token ids do; positions from arange do not)."""
    return any(n.op == "placeholder" for n in ancestors(node))


_MASK_HOPS = 16   # ops between a bias lookup and the attention it masks (T5: permute, add, ...)


def _feeds_attention_mask(node: fx.Node) -> bool:
    """Whether `node`'s value reaches the attn_mask of a scaled-dot-product attention within
    _MASK_HOPS ops (through views and additions: a bias added to the scores)."""
    frontier, seen = [node], {node}
    for _ in range(_MASK_HOPS):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.target is aten.scaled_dot_product_attention.default:
                    mask = u.args[3] if len(u.args) > 3 else u.kwargs.get("attn_mask")
                    if mask is n:
                        return True
                elif u not in seen:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


def sdpa_rule(p: Propagator, node: fx.Node) -> Layout:
    """Attention is independent per head: q, k, v split along the heads dim (ndim-3); the mask
    broadcasts over heads or is sliced."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    lays = [p.eff(node, a) for a in (q, k, v)]
    shards = [l for l in lays if isinstance(l, Shard)]
    if not shards:
        return replicated(p, node)
    hd = len(shape(q)) - 3
    origins = union(shards)
    if any(l.dim != hd or l.seq for l in shards):
        # blame the inputs split wrongly (a separate k projection of fewer heads than t, split
        # along the head dim), not the query split by heads beside them
        wrong = union([l for l in shards if l.dim != hd or l.seq])
        conflict = Conflict(wrong if wrong and any(l.dim == hd and not l.seq for l in shards)
                            else origins, node,
                            f"{node.name}: attention split along a non-head dim")
        for l in shards:
            if l.dim != hd and not l.seq:   # k/v of fewer heads than t: held whole instead
                p.hold_whole(l, conflict)
        raise conflict
    gqa = bool(node.kwargs.get("enable_gqa", False))
    q_local = shape(q)[hd] // p.t if isinstance(lays[0], Shard) else None
    for arg in (q, k, v):
        if isinstance(p.eff(node, arg), Whole) and q_local and (
                shape(arg)[hd] == 1 or (gqa and q_local % shape(arg)[hd] == 0)):
            continue    # whole k/v heads shared by the local query heads (broadcast / GQA)
        if not isinstance(p.eff(node, arg), Shard):
            heads = shape(arg)[hd]
            if heads % p.t:
                raise Conflict(origins, node, f"{node.name}: {heads} heads of {arg.name} do not "
                               f"divide by t={p.t}", indivisible=True)
            p.demand(node, arg, Shard(hd, (heads,), origins=origins))
    if isinstance(mask, fx.Node):
        i = hd - (len(shape(q)) - len(shape(mask)))
        if i < 0 or shape(mask)[i] == 1:
            p.demand(node, mask, R)
        else:
            p.demand(node, mask, Shard(i, (shape(mask)[i],), origins=origins))
    ql = lays[0] if isinstance(lays[0], Shard) else p.eff(node, q)
    return replace(ql, origins=origins)
