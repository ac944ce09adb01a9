"""Graph profile vs the textbook profile (2104.04473 / 2205.05198), and planning speed.

Both price a GPU stack: elementwise chains fused into single kernels (passes/graph_profile.py
`_Fusion`; the twin's bytes are stated the same way, cost/profile.py `transformer_profile`),
the loss in fp32, attention materialized (region fields) or as one fused kernel
(`RegionProfile.fused`). Differences the graph measures and the textbook omits, each asserted
exactly below (s tokens, h hidden, a heads, 2-byte activations, the tiny models captured on the
CPU with dropout 0 and an example batch of 2):
  - layer-norm statistics (mean, rstd: s floats each per norm) are saved: +4·s bytes per norm;
  - the embedding saves its int64 indices (token ids s·8 bytes, position ids s·8); the head its
    int64 targets (s·8) and the loss's fp32 total weight (4 bytes over the example batch of 2);
  - with dropout 0 nothing saves or writes dropout masks: the textbook's 2·s·h mask bytes per
    block (replicated), s·h in the embedding, and 3·a·s² of the attention (mask + dropout
    output) vanish; dropout with p = 0 returns its input (no traffic);
  - a CPU capture's sdpa output is already laid out (B, L, H, E): the 2·s·h relayout copy the
    textbook counts for materialized attention (and a meta capture has) is absent;
  - the head reads its int64 targets and writes the scalar loss (8·s + 2 bytes per sequence).
transformers GPT-2's NewGELU (eight elementwise ops) fuses like the GeLU of the examples' GPT:
the same bytes and activations.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from autopar.cost.profile import transformer_profile
from autopar.examples.gpt import GPT, gpt_preset, lm_cross_entropy
from autopar.passes.capture import capture
from autopar.passes.layers import find_layers
from autopar.passes.graph_profile import profile_from_graph

from models import (HEADS, HIDDEN, LAYERS, SEQ, VOCAB, captured, hf_bloom, hf_gpt2, pass_batch,
                    pass_model)

S, H, A = SEQ, HIDDEN, HEADS


def _profile(name, repeat_limit=None):
    _, cap = captured(name, repeat_limit)
    return profile_from_graph(cap, find_layers(cap), name=name)


def _textbook(**kw):
    return transformer_profile(num_layers=LAYERS, hidden=H, heads=A, seq_len=S, vocab=VOCAB, **kw)


def _check_flops_and_params(p, t):
    assert (p.hidden, p.heads, p.kv_heads, p.vocab, p.ffn, p.num_layers, p.seq_len) == \
        (t.hidden, t.heads, t.kv_heads, t.vocab, t.ffn, t.num_layers, t.seq_len)
    assert p.fwd_flops_per_seq() == t.fwd_flops_per_seq()
    for a, b in ((p.embedding, t.embedding), (p.block, t.block), (p.head, t.head)):
        assert a.fwd_flops == b.fwd_flops, a.kind
        assert (a.params_split_elems, a.params_replicated_elems) == \
            (b.params_split_elems, b.params_replicated_elems), a.kind
        assert [g.tp_split for g in a.gemms if g.batch == 1 or g.tp_split != "batch"] == \
            [g.tp_split for g in b.gemms if g.batch == 1 or g.tp_split != "batch"], a.kind
        assert a.tp_allreduce_elems == b.tp_allreduce_elems, a.kind
        assert a.input_bytes == b.input_bytes, a.kind
    assert p.tied_embeddings and t.tied_embeddings


def _check_against_twin(p, t):
    norm_stats = 4 * S  # per layer norm: mean + rstd, s values at 2 bytes
    b, tb = p.block, t.block
    assert b.act_replicated_bytes == tb.act_replicated_bytes - 2 * S * H  # no dropout masks
    assert b.act_split_bytes == tb.act_split_bytes + 2 * norm_stats
    assert b.act_attention_bytes == tb.act_attention_bytes - 3 * A * S * S  # softmax only
    # non-GEMM traffic: no dropout masks (2·s·h bytes), no relayout of the attention output
    assert b.other_bytes == tb.other_bytes - 2 * S * H - 2 * S * H * 2
    assert b.other_split_bytes == tb.other_split_bytes - 2 * S * H * 2
    # today's stacks: the fused attention kernel saves q, k, v, its output (the projection's
    # input) and the logsumexp; the GeLU's and the norms' outputs are recomputed from their
    # (kept) inputs: the same differences from the twin as above
    f, tf = b.fused, tb.fused
    assert f.act_split_bytes == b.act_split_bytes - S * 4 * H * 2  # the GeLU output
    assert f.act_replicated_bytes == b.act_replicated_bytes - 2 * S * H * 2  # norm outputs
    assert f.act_split_bytes == tf.act_split_bytes + 2 * norm_stats
    assert f.act_replicated_bytes == tf.act_replicated_bytes - 2 * S * H
    assert tf.act_attention_bytes == f.act_attention_bytes == 4 * A * S
    (call,), (tcall,) = f.calls, tf.calls
    assert call == dataclasses.replace(tcall, materialized_bytes=tcall.materialized_bytes
                                       - 2 * S * H * 2)  # (no relayout in a CPU capture)
    e, te = p.embedding, t.embedding
    assert e.act_replicated_bytes == te.act_replicated_bytes - S * H
    assert e.act_split_bytes == 2 * S * 8  # token and position indices (int64)
    h, th = p.head, t.head
    assert h.act_replicated_bytes == th.act_replicated_bytes
    # fp32 log-probabilities as the textbook; + final-norm stats; + int64 targets;
    # + the loss's fp32 total weight (4 bytes over the example batch of 2)
    assert h.act_split_bytes == th.act_split_bytes + norm_stats + S * 8 + 2
    assert h.other_bytes == th.other_bytes + S * 8 + 1  # reads targets, writes the loss
    assert h.other_split_bytes == th.other_split_bytes + S * 8 + 1


def test_gpt_matches_textbook():
    p, t = _profile("gpt"), _textbook()
    _check_flops_and_params(p, t)
    _check_against_twin(p, t)
    # token rows (read + write 4·s·h) and their indices, position rows and indices, read once
    # per captured batch of 2 (they do not depend on it), their sum (reads 2·s·h + s·h,
    # writes 2·s·h): the textbook's 7·s·h·2 + s·h mask bytes, less the mask and the dropout
    e, te = p.embedding, t.embedding
    assert e.other_bytes == (4 * S * H + 8 * S) + (4 * S * H + 8 * S) / 2 + 5 * S * H + 8 * S / 2
    assert te.other_bytes == 15 * S * H


def test_hf_gpt2_matches_textbook():
    p, t = _profile("hf_gpt2"), _textbook()
    _check_flops_and_params(p, t)
    _check_against_twin(p, t)


def test_gpt_with_dropout_matches_textbook_masks():
    model = pass_model("gpt", dropout=0.1)
    ids, tgt = pass_batch()
    cap = capture(model, (ids,), lm_cross_entropy, tgt, repeat_limit=2)
    p, t = profile_from_graph(cap, find_layers(cap)), _textbook()
    assert p.block.act_replicated_bytes == t.block.act_replicated_bytes  # 1-byte masks
    assert p.embedding.act_replicated_bytes == t.embedding.act_replicated_bytes
    # sdpa's math path keeps its dropout mask at 2 bytes (the textbook's fused kernel: 1)
    assert p.block.act_attention_bytes == t.block.act_attention_bytes + A * S * S


def test_llama_style_dims_and_flops():
    p = _profile("llama_style")
    t = _textbook(kv_heads=2, ffn=80, gated_mlp=True, tied_embeddings=False)
    assert (p.kv_heads, p.ffn, p.heads, p.hidden, p.tied_embeddings) == (2, 80, A, H, False)
    assert p.fwd_flops_per_seq() == t.fwd_flops_per_seq()
    assert [g.tp_split for g in p.block.gemms] == ["n", "n", "n", "batch", "batch", "k",
                                                   "n", "n", "k"]
    # no biases; RMSNorm has a weight only: two norms of h each
    assert p.block.params_replicated_elems == 2 * H
    assert p.head.params_split_elems == VOCAB * H  # untied LM head, vocab-parallel


def test_hf_llama_and_bert_profiles():
    llama = _profile("hf_llama")
    assert (llama.kv_heads, llama.ffn, llama.num_layers) == (2, 80, LAYERS)
    bert = _profile("hf_bert")
    assert (bert.heads, bert.ffn, bert.hidden) == (A, 4 * H, H)
    # BERT's MLM head has a dense transform (replicated) before the vocab projection
    assert [g.tp_split for g in bert.head.gemms] == [None, "n"]


def test_truncated_capture_profiles_like_full_capture():
    full, cut = _profile("gpt"), _profile("gpt", 2)
    assert cut.num_layers == full.num_layers == LAYERS
    assert cut.block == full.block and cut.embedding == full.embedding and cut.head == full.head


def test_plan_175b_from_meta_timing():
    """Not a timed assertion: prints the end-to-end time of capture + layers + profile."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(gpt_preset("gpt3-175b"))
    ids = torch.empty(1, 2048, dtype=torch.long, device="meta")
    t1 = time.perf_counter()
    cap = capture(model, (ids,), lm_cross_entropy, repeat_limit=2)
    s = find_layers(cap)
    p = profile_from_graph(cap, s, name="gpt3-175b")
    t2 = time.perf_counter()
    print(f"\n175B meta: build {t1 - t0:.2f} s, capture+layers+profile {t2 - t1:.2f} s")
    t = transformer_profile(num_layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)
    assert p.num_layers == 96 and p.fwd_flops_per_seq() == t.fwd_flops_per_seq()
    assert p.block.params_elems == t.block.params_elems


def _hf_profile(model):
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    cap = capture(model, (ids,), lm_cross_entropy)
    return profile_from_graph(cap, find_layers(cap))


def test_heads_of_attention_written_out_with_matmuls():
    """Without scaled_dot_product_attention the heads come from the scores GEMM q·kᵀ: BLOOM
    (ALiBi through baddbmm on (B·heads, T, d), fused qkv) and GPT-2 with eager attention
    ((B, heads, T, d) matmuls). Before, such models profiled as 1 head and the solver refused
    every t > 1."""
    bloom = _hf_profile(hf_bloom())
    assert (bloom.heads, bloom.kv_heads, bloom.hidden, bloom.ffn) == (4, 4, 32, 128)
    gpt2 = _hf_profile(hf_gpt2(heads=8, dropout=0.1, attn_dropout=0.1,
                               attn_implementation="eager"))
    assert (gpt2.heads, gpt2.kv_heads, gpt2.ffn) == (8, 8, 128)


def test_a_model_as_wide_as_its_sequence_keeps_its_attention_bytes_apart():
    """Hidden = sequence (a 2048-wide model at sequence 2048): a token × hidden activation
    (b, s, h) has the scores' trailing (s, s) shape. Only the attention's own tensors are
    attention bytes (what selective recompute frees): the softmax on the math path, the
    logsumexp of a fused kernel; the norms' and GEMMs' inputs were counted there before, so
    selective recompute of a model as wide as its sequence priced them as freed (measured on
    an H100, benchmarks/gpu.py 2026-11-26: the allocator held the same bytes as without)."""
    from models import gpt
    s = h = 32
    torch.manual_seed(0)
    model = gpt(vocab=VOCAB, seq=s, hidden=h, heads=A, layers=2, dropout=0.0)
    ids, tgt = pass_batch(seq=s)
    cap = capture(model, (ids,), lm_cross_entropy, tgt, repeat_limit=2)
    p = profile_from_graph(cap, find_layers(cap))
    t = transformer_profile(num_layers=2, hidden=h, heads=A, seq_len=s, vocab=VOCAB)
    assert p.block.act_attention_bytes == t.block.act_attention_bytes - 3 * A * s * s
    assert p.block.fused.act_attention_bytes == 4 * A * s


def test_each_region_counts_its_parameter_tensors_and_the_optimizer_pays_for_its_share():
    """The optimizer pays per tensor it steps, beyond the elements (AdamW runs each tensor's
    update as its own ops on a CPU): the graph profile counts each region's parameter tensors
    as the module holds them (a GPT block's: two norms, four projections, weight and bias
    each), and the cost model charges `Cluster.optimizer_tensor_s` for each under ZeRO-0 and
    for 1/d of them under ZeRO-1..3 (a rank's shard is stepped as one segment per parameter
    piece it holds)."""
    import dataclasses

    import pytest

    from autopar.cost.compute import optimizer_step_s
    from autopar.cost.config import Config
    from autopar.cost.hardware import get_cluster
    from autopar.cost.shares import rank_params
    model, cap = captured("gpt")
    p = profile_from_graph(cap, find_layers(cap), name="gpt")
    assert p.block.param_tensors == len(list(model.transformer.h[0].parameters())) == 12
    assert p.embedding.param_tensors == 2      # token and position tables (the head ties)
    assert p.head.param_tensors == 2           # the final norm's weight and bias
    base = get_cluster("dgx-a100-80gb")
    per_tensor = dataclasses.replace(base, optimizer_tensor_s=1e-5)
    for zero, extra in ((0, 1e-5), (1, 0.5e-5), (3, 0.5e-5)):
        cfg = Config(t=1, p=1, d=2, zero=zero)
        params = rank_params(p, cfg)
        with_t = optimizer_step_s(per_tensor, cfg, params, p)
        without = optimizer_step_s(base, cfg, params, p)
        assert [a - b for a, b in zip(with_t, without)] == pytest.approx(
            [12 * extra, 2 * extra, 2 * extra], abs=1e-12)
