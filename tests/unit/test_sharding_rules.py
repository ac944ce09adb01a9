"""The sharding engine's op rules, one family at a time (passes/sharding/rules.py's table), on
small ATen graphs built by hand with meta tensors (no capture, no process group): elementwise,
views, reductions, products, and the context mode's rules."""
from __future__ import annotations

import ast
import operator
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch.fx.node import map_arg

from autopar.passes import meta as K
from autopar.passes.sharding import (RULES, Conflict, ContextPropagator, Partial, Propagator,
                                     R, Refine, Shard, rule_for)
from autopar.passes.sharding.elementwise import pointwise_rule, replicated
from autopar.passes.sharding.reductions import reduce_rule, softmax_rule
from autopar.passes.sharding.views import reshape_rule, split_rule, transpose_rule
from autopar.passes.tensor_parallel import propagate_sharding

aten = torch.ops.aten
B, T, C, N = 2, 4, 8, 16


class _Graph:
    """An ATen graph built op by op; every value's meta VAL computed on meta tensors."""

    def __init__(self):
        self.g, self.root = fx.Graph(), torch.nn.Module()

    def input(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> fx.Node:
        n = self.g.placeholder(name)
        n.meta[K.VAL] = torch.empty(shape, dtype=dtype, device="meta")
        return n

    def param(self, name: str, *shape: int) -> fx.Node:
        self.root.register_parameter(name, torch.nn.Parameter(torch.empty(shape, device="meta")))
        n = self.g.get_attr(name)
        n.meta[K.VAL] = torch.empty(shape, device="meta")
        return n

    def op(self, target, *args, **kwargs) -> fx.Node:
        n = self.g.call_function(target, args, kwargs)
        vals = map_arg((args, kwargs), lambda a: a.meta[K.VAL])
        n.meta[K.VAL] = target(*vals[0], **vals[1])
        return n

    def module(self, out: fx.Node) -> fx.GraphModule:
        self.g.output(out)
        return fx.GraphModule(self.root, self.g)


def _engine(gm: fx.GraphModule, t: int = 2) -> Propagator:
    """The engine at t; a split value the graph returns is all-gathered (a machine balance of
    0 FLOP/byte: the gather always pays), so a region may end split at the output."""
    return Propagator(gm, t, off=set(), refine={}, sequence_parallel=False, seq_len=None,
                      vocab_multiple=1, flop_per_byte=0.0)


def _mlp(act=aten.gelu.default) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """x (B, T, C) -> linear(w1: N×C) -> act -> · scale (N,) -> linear(w2: C×N, bias b2)."""
    G = _Graph()
    x, w1, s, w2, b2 = (G.input("x", B, T, C), G.param("w1", N, C), G.param("s", N),
                        G.param("w2", C, N), G.param("b2", C))
    up = G.op(aten.linear.default, x, w1)
    h = G.op(act, up)
    hs = G.op(aten.mul.Tensor, h, s)
    down = G.op(aten.linear.default, hs, w2, b2)
    return G.module(down), dict(x=x, w1=w1, s=s, w2=w2, b2=b2, up=up, h=h, hs=hs, down=down)


# ----- the table ------------------------------------------------------------------------------

def test_the_table_dispatches_each_op_to_its_family_and_the_rest_replicated():
    gm, n = _mlp()
    assert all(isinstance(op, torch._ops.OpOverloadPacket) for op in RULES)
    assert rule_for(n["up"]) is RULES[aten.linear]
    assert rule_for(n["h"]) is pointwise_rule          # gelu: tagged pointwise, no row
    G = _Graph()
    idx = G.op(aten.argsort.default, G.input("x", B, T))
    assert rule_for(idx) is replicated                  # no row, not pointwise


# ----- elementwise and products: a Megatron MLP --------------------------------------------------

def test_a_column_then_row_pair_keeps_the_middle_split_and_ends_partial():
    gm, n = _mlp()
    p = _engine(gm).run()
    assert p.role[n["up"]] == "column" and p.role[n["down"]] == "row"
    assert p.layout[n["h"]] == Shard(2, (N,)) and p.layout[n["hs"]] == Shard(2, (N,))
    assert p.layout[n["s"]] == Shard(0, (N,))           # the scale sliced like its operand
    assert p.layout[n["w1"]] == Shard(0, (N,)) and p.layout[n["w2"]] == Shard(1, (N,))
    assert p.layout[n["down"]] == Partial(("b2",))      # the bias added once, after the sum
    assert p.layout[n["b2"]] == R
    out = next(iter(n["down"].users))
    assert p.convert[out] == {n["down"]: R}             # reduced at the output


def test_pointwise_operands_split_along_different_dims_conflict():
    G = _Graph()
    a, b = G.input("a", B, N), G.input("b", B, N)
    add = G.op(aten.add.Tensor, a, b)
    p = _engine(G.module(add))
    p.layout.update({a: Shard(1, (N,), origins=frozenset({"a"})),
                     b: Shard(0, (B,), origins=frozenset({"b"}))})
    with pytest.raises(Conflict, match="operands split differently") as err:
        pointwise_rule(p, add)
    assert err.value.origins == {"a", "b"}


# ----- views ---------------------------------------------------------------------------------

def test_a_split_dim_maps_through_a_reshape_and_a_transpose():
    G = _Graph()
    x = G.input("x", B, T, N)
    heads = G.op(aten.view.default, x, [B, T, 4, N // 4])
    moved = G.op(aten.transpose.int, heads, 1, 2)
    p = _engine(G.module(moved))
    p.layout[x] = Shard(2, (N,))
    p.layout[heads] = reshape_rule(p, heads)
    assert p.layout[heads] == Shard(2, (4,))            # split by heads
    assert transpose_rule(p, moved) == Shard(1, (4,))


def test_a_split_cutting_a_fused_output_inside_a_block_refines_its_seed():
    G = _Graph()
    qkv = G.input("qkv", B, T, 3 * C)
    parts = G.op(aten.split.Tensor, qkv, C, -1)
    p = _engine(G.module(parts))
    p.layout[qkv] = Shard(2, (3 * C,), origins=frozenset({"proj"}), src=(0,))
    with pytest.raises(Refine) as err:
        split_rule(p, parts)
    assert (err.value.origin, err.value.blocks) == ("proj", (C, C, C))
    p.layout[qkv] = Shard(2, (C, C, C), origins=frozenset({"proj"}), src=(0, 1, 2))
    assert split_rule(p, parts) == tuple(Shard(2, (C,)) for _ in range(3))


# ----- reductions ----------------------------------------------------------------------------

def test_a_sum_over_the_split_dim_is_partial_a_softmax_over_it_conflicts():
    G = _Graph()
    x = G.input("x", B, N)
    total = G.op(aten.sum.dim_IntList, x, [1])
    other = G.op(aten.sum.dim_IntList, x, [0])
    soft = G.op(aten._softmax.default, x, 1, False)
    p = _engine(G.module(soft))
    p.layout[x] = Shard(1, (N,), origins=frozenset({"w"}))
    assert reduce_rule(p, total) == Partial()
    assert reduce_rule(p, other) == Shard(0, (N,))
    with pytest.raises(Conflict, match="softmax over the split dim"):
        softmax_rule(p, soft)


def test_a_reduction_s_elementwise_overload_is_pointwise():
    """torch.min(x, eps) (aten.min.other: Apertus's xIELU clamps its column-parallel MLP
    activation so) is elementwise: it keeps the column split, and the MLP stays column then
    row; min.dim over a dim is still the reduction's."""
    G = _Graph()
    x, w1, eps, w2 = G.input("x", B, T, C), G.param("w1", N, C), G.param("eps"), \
        G.param("w2", C, N)
    up = G.op(aten.linear.default, x, w1)
    low = G.op(aten.min.other, up, eps)
    down = G.op(aten.linear.default, low, w2)
    red = G.op(aten.min.dim, up, 1)
    assert rule_for(low) is pointwise_rule and rule_for(red) is reduce_rule
    p = _engine(G.module(down)).run()
    assert p.layout[low] == Shard(2, (N,)) and p.layout[eps] == R
    assert p.role[up] == "column" and p.role[down] == "row"


def test_a_norm_over_a_column_parallel_output_distributes_its_statistics():
    G = _Graph()
    x, w, g = G.input("x", B, T, C), G.param("w", N, C), G.param("g", N)
    h = G.op(aten.linear.default, x, w)
    normed = G.op(aten.rms_norm.default, h, [N], g)
    p = _engine(G.module(normed)).run()
    assert p.role[normed] == "split_norm" and p.layout[g] == Shard(0, (N,))


# ----- products ------------------------------------------------------------------------------

def test_attention_splits_by_heads_and_an_indivisible_head_count_falls_back():
    G = _Graph()
    x, wq = G.input("x", B, T, C), G.param("wq", C, C)
    q = G.op(aten.linear.default, x, wq)
    heads = G.op(aten.view.default, q, [B, T, 2, C // 2])
    qh = G.op(aten.transpose.int, heads, 1, 2)                  # (B, 2, T, C/2)
    attn = G.op(aten.scaled_dot_product_attention.default, qh, qh, qh)
    gm = G.module(attn)
    p = _engine(gm, t=2).run()
    assert p.role[q] == "column" and p.layout[attn] == Shard(1, (2,))
    # t=4 > 2 heads: the driver refines, the refined split conflicts at attention, q falls back
    info = propagate_sharding(gm, 4, strict=False).meta[K.TP_INFO]
    assert [f.node for f in info.fallbacks] == [q.name] and info.column == []
    assert "do not divide by t=4" in info.fallbacks[0].reason
    assert attn.meta[K.TP_LAYOUT] == R



def test_a_buffer_made_like_a_split_value_is_split_and_copies_write_into_it():
    """x.new_empty(sizes of x, but its last dim) takes x's head split (DeepSeek-V3's key
    buffer); each slice copy writes into it unconverted, a replicated source (one key part for
    every head, expanded) sliced locally to the rank's heads; a new_zeros of another rank is
    whole and reads nothing of x."""
    G = _Graph()
    x, w, r = G.input("x", B, T, C), G.param("w", C, C), G.input("r", B, 1, T, 2)
    heads = G.op(aten.transpose.int, G.op(aten.view.default, G.op(aten.linear.default, x, w),
                                          [B, T, 2, C // 2]), 1, 2)      # (B, 2, T, 4)
    buf = G.op(aten.new_empty.default, heads, [B, 2, T, C // 2 + 2])
    rot = G.op(aten.expand.default, r, [-1, 2, -1, -1])
    writes = [G.op(aten.copy_.default, G.op(aten.slice.Tensor, buf, 3, 0, C // 2), heads),
              G.op(aten.copy_.default, G.op(aten.slice.Tensor, buf, 3, C // 2), rot)]
    bias = G.op(aten.new_zeros.default, heads, [C // 2 + 2])
    p = _engine(G.module(G.op(aten.add.Tensor, buf, bias))).run()
    assert p.layout[buf] == p.layout[heads] == Shard(1, (2,), origins=p.layout[heads].origins)
    assert all(p.layout[w] == p.layout[buf] and w.args[0] not in p.convert.get(w, {})
               for w in writes)
    assert p.convert[writes[1]] == {rot: p.layout[buf]}    # the shared part: the rank's heads
    assert p.layout[bias] == R and heads not in p.convert.get(bias, {})


def test_context_mode_keeps_a_per_token_scatter_and_refuses_one_along_the_tokens():
    """A router's group mask: zeros_like(scores).scatter_(-1, topk indices, 1) writes each
    token's own row, so the rank's tokens stay split (the mask written unconverted); gather
    along the features likewise; a scatter along the tokens is refused in one line."""
    G = _Graph()
    x, w = G.input("x", B, T, C), G.param("w", C, C)
    h = G.op(aten.linear.default, x, w)
    idx = G.op(operator.getitem, G.op(aten.topk.default, h, 2), 1)
    idx.meta[K.VAL] = torch.empty(B, T, 2, dtype=torch.long, device="meta")
    mask = G.op(aten.scatter_.value, G.op(aten.zeros_like.default, h), 2, idx, 1.0)
    picked = G.op(aten.gather.default, h, 2, idx)
    p = _context_walk(G.module(G.op(aten.mul.Tensor, mask, h)))
    tokens = Shard(1, (T,), seq=True)
    assert p.layout[mask] == p.layout[picked] == tokens and mask not in p.convert
    G = _Graph()
    h = G.input("x", B, T, C)
    idx = G.input("i", B, T, C, dtype=torch.long)
    along = G.op(aten.scatter.value, h, 1, idx, 1.0)
    with pytest.raises(ValueError, match=r"^context parallelism: node scatter_value .*"
                                         r"a gather / scatter along the sequence \(dim 1\); .*c=1$"):
        _context_walk(G.module(along))


def _context_walk(gm: fx.GraphModule) -> ContextPropagator:
    """The context mode over every node but the output (which would read the tokens whole)."""
    p = ContextPropagator(gm, 2, T)
    for n in gm.graph.nodes:
        if n.op != "output":
            p.visit(n)
    return p

# ----- the context mode ----------------------------------------------------------------------

def _tokens_graph(op, *args) -> tuple[fx.GraphModule, fx.Node, fx.Node]:
    """x (B, T, C) -> linear -> op(h, *args) -> a token-mean cross-entropy against (B, T)
    targets: the loss whole, everything before it on the rank's tokens."""
    G = _Graph()
    x, w, tgt = G.input("x", B, T, C), G.param("w", C, C), G.input("tgt", B, T, dtype=torch.long)
    h = G.op(aten.linear.default, x, w)
    y = G.op(op, h, *args)
    logits = G.op(aten.view.default, y, [B * T, C])
    loss = G.op(aten.cross_entropy_loss.default, logits, G.op(aten.view.default, tgt, [B * T]))
    return G.module(loss), x, y


def test_context_mode_keeps_token_wise_ops_on_the_rank_s_tokens():
    gm, x, y = _tokens_graph(aten._softmax.default, -1, False)  # softmax over features
    p = ContextPropagator(gm, 2, T).run()
    assert p.layout[x] == Shard(1, (T,), seq=True) == p.layout[y]
    loss = next(n for n in gm.graph.nodes if n.target is aten.cross_entropy_loss.default)
    assert p.role[loss] == "context_loss" and p.layout[loss] == R


def test_context_mode_refuses_an_op_along_the_sequence_in_one_line():
    gm, _, _ = _tokens_graph(aten.cumsum.default, 1)
    with pytest.raises(ValueError, match=r"^context parallelism: node cumsum_default "
                                         r"\(aten.cumsum\) .*along the sequence; .*c=1$"):
        ContextPropagator(gm, 2, T).run()


def test_context_mode_reads_keys_and_values_whole_at_attention():
    G = _Graph()
    x = G.input("x", B, T, 2 * C)
    heads = G.op(aten.view.default, x, [B, T, 2, C])
    q = G.op(aten.transpose.int, heads, 1, 2)                   # (B, H, T, E): tokens dim 2
    kv = G.op(aten.transpose.int, heads, 1, 2)
    attn = G.op(aten.scaled_dot_product_attention.default, q, kv, kv)
    p = ContextPropagator(G.module(attn), 2, T)
    p.layout.update({x: Shard(1, (T,), seq=True)})
    for n in (heads, q, kv):
        p.visit(n)
    p.visit(attn)
    assert p.layout[q] == Shard(2, (T,), seq=True) == p.layout[attn]
    assert p.gathered[attn] == [kv, kv] and p.convert[attn] == {kv: R}


def test_context_mode_repeats_the_rank_s_rows_per_expert_and_views_them_as_batches():
    """Llama 4's experts: the (B·T, C) rows repeated once per expert (E = 4) and viewed
    (E, B·T, C): the rank's tokens stay local, each expert's batch holding its B blocks."""
    G = _Graph()
    x = G.input("x", B * T, C)
    rep = G.op(aten.repeat.default, x, [4, 1])
    batches = G.op(aten.view.default, rep, [4, B * T, C])
    p = ContextPropagator(G.module(batches), 2, T)
    p.layout.update({x: Shard(0, (T,) * B, seq=True)})
    p.visit(rep)
    p.visit(batches)
    assert p.layout[rep] == Shard(0, (T,) * B * 4, seq=True)
    assert p.layout[batches] == Shard(1, (T,) * B, seq=True)


def test_a_vector_norm_over_the_features_keeps_the_rank_s_tokens():
    """torch.linalg.vector_norm(x, dim=-1, keepdim=True) (Inkling 2's normalisation): its dims
    follow the `ord` argument, so it reduces like a sum over them — token-wise under the
    context split, and over the split dim it conflicts (not a silent Partial)."""
    from autopar.passes.sharding import reduce_dims
    G = _Graph()
    x = G.input("x", B, T, C)
    norm = G.op(aten.linalg_vector_norm.default, x, 2, [-1], True)
    assert reduce_dims(norm) == ([2], True)
    p = _context_walk(G.module(norm))
    assert p.layout[norm] == Shard(1, (T,), seq=True)
    e = _engine(G.module(norm))
    e.layout[x] = Shard(2, (C,), origins=frozenset({"x"}))
    with pytest.raises(Conflict, match="reduces over the split dim"):
        rule_for(norm)(e, norm)


def test_complex_views_keep_the_leading_split_and_refuse_the_pair():
    """A rotary through complex numbers (view_as_complex of (…, d/2, 2), view_as_real back):
    the heads' split passes through both; a split of the (real, imaginary) pair conflicts."""
    G = _Graph()
    x = G.input("x", B, T, 4, C // 2, 2)
    z = G.op(aten.view_as_complex.default, x)
    back = G.op(aten.view_as_real.default, z)
    p = _engine(G.module(back))
    p.layout.update({x: Shard(2, (4,), origins=frozenset({"x"}))})
    assert rule_for(z)(p, z) == Shard(2, (4,))
    p.layout[z] = Shard(2, (4,))
    assert rule_for(back)(p, back) == Shard(2, (4,))
    p.layout[x] = Shard(4, (2,), origins=frozenset({"x"}))
    with pytest.raises(Conflict, match="cannot keep the \\(real, imaginary\\) pair"):
        rule_for(z)(p, z)


def test_no_module_imports_a_private_name_of_the_engine():
    """The package's modules talk through public names only (and so does every importer)."""
    root = Path(__file__).resolve().parents[2]
    private = [f"{path.relative_to(root)}:{node.lineno}: {a.name}"
               for d in ("passes", "autopar", "cost", "tests") for path in (root / d).rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                   "autopar.passes.sharding")
               for a in node.names if a.name.startswith("_")]
    assert private == []


def test_inplace_ops_are_found_without_the_torch_213_tag():
    """torch 2.11 (the GPU image's) has no torch.Tag.inplace: the c = 2 plan failed there with
    an AttributeError. The schema rule finds every op the tag marks (and a few list ops more)."""
    import torch
    from autopar.passes.sharding.ops import is_inplace, schema_inplace
    if not hasattr(torch.Tag, "inplace"):
        pytest.skip(f"torch {torch.__version__} has no torch.Tag.inplace to compare against")
    aten, tagged, extra = torch.ops.aten, 0, []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload)
            if torch.Tag.inplace in op.tags:
                tagged += 1
                assert schema_inplace(op), op
            elif schema_inplace(op):
                extra.append(str(op))
    assert tagged > 100 and len(extra) <= 10, extra
    assert is_inplace(aten.add_.Tensor) and not is_inplace(aten.add.Tensor)
    assert not is_inplace(len)
