"""The attention kernel as part of the hardware model (`Cluster.attention`), fused-kernel pricing,
the graph's view of attention calls and masks, and the per-rank memory of plan.explain()."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.cost import model as M
from autopar.cost.hardware import CLUSTER_NAMES, Cluster, get_cluster
from autopar.cost.profile import (ATTENTION_KINDS, AttentionCall, causal_tile_fraction,
                                  transformer_profile)
from autopar.cost.solver import solve
from autopar.passes.capture import capture
from autopar.passes.layers import find_layers
from autopar.passes.graph_profile import profile_from_graph
from autopar.plan import Plan

H100 = get_cluster("dgx-h100-80gb")


def _gpt():  # 8K tokens: the s² terms dominate the materialized attention
    return transformer_profile(num_layers=8, hidden=2048, heads=16, seq_len=8192, vocab=51200)


# ----- the hardware model ----------------------------------------------------------------------
def test_presets_default_to_flash_and_the_kind_can_be_replaced():
    """Every preset runs fused attention (torch's CPU kernel is one too); the GPU presets fuse
    elementwise chains as the calibrated stacks did, local-cpu runs them as autopar's runtime
    does, op by op."""
    for name in CLUSTER_NAMES:
        cl = get_cluster(name)
        assert cl.attention == "flash" and cl.attention in ATTENTION_KINDS, name
        assert cl.elementwise == ("eager" if name == "local-cpu" else "fused"), name
    mat = dataclasses.replace(get_cluster("dgx-a100-80gb"), attention="materialized")
    assert mat.attention == "materialized" and mat.peak_flops == 312e12


def test_unknown_attention_kind_names_value_rule_and_fix():
    with pytest.raises(ValueError) as err:
        dataclasses.replace(H100, attention="sparse")
    msg = str(err.value)
    assert "'sparse'" in msg and "'flash'" in msg and "'materialized'" in msg
    assert "dataclasses.replace" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="flash_fwd_efficiency"):
        dataclasses.replace(H100, flash_fwd_efficiency=1.5)
    with pytest.raises(ValueError, match="attention='sparse'"):
        _gpt().with_attention("sparse")


def test_cli_unknown_attention_is_one_line_error(capsys):
    from autopar.cli import main
    assert main(["plan", "gpt-1.7b", "--gpus", "32", "--attention", "sparse"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopar: error: Cluster.attention='sparse'") and "\n" not in err


def test_h200_is_the_h100_with_more_memory():
    h200 = get_cluster("dgx-h200-141gb")
    assert (h200.peak_flops, h200.gemm_max_efficiency, h200.intra_node_bandwidth_Bps) == (
        H100.peak_flops, H100.gemm_max_efficiency, H100.intra_node_bandwidth_Bps)
    assert h200.memory_bytes == 141e9 and h200.hbm_bandwidth_Bps == 4.8e12
    assert any("H200" in s and "141 GB" in s for s in h200.sources)
    assert any("fitted" in s and "Llama 3" in s for s in H100.sources)


# ----- fused-kernel pricing ----------------------------------------------------------------------
def test_causal_tile_fraction():
    assert causal_tile_fraction(8192, 8192) == pytest.approx(65 / 128)
    assert causal_tile_fraction(128, 128) == 1.0
    assert causal_tile_fraction(256, 256) == 0.75
    # fewer queries than keys (bottom-right aligned): the last queries see every key
    assert causal_tile_fraction(128, 512) == 1.0


def test_fused_kernel_time_causal_backward_and_length():
    def call(L, active):
        return AttentionCall(heads=16, kv_heads=16, q_len=L, kv_len=L, head_dim=128,
                             v_head_dim=128, active_fraction=active, gemms=(1, 2),
                             materialized_bytes=0)
    launch = H100.kernel_launch_s
    dense_f, dense_b = (x - launch for x in M.fused_attention_time_s(H100, call(8192, 1.0), 1, 1))
    causal_f, causal_b = (x - launch
                          for x in M.fused_attention_time_s(H100, call(8192, 0.5), 1, 1))
    assert causal_f == pytest.approx(dense_f / 2, rel=1e-3)  # masked tiles skipped
    flops = 4 * 16 * 8192 * 8192 * 128
    length = 8192 / (8192 + H100.flash_half_len)
    assert dense_f == pytest.approx(
        flops / (H100.peak_flops * H100.flash_fwd_efficiency * length), rel=1e-3)
    assert dense_b == pytest.approx(
        2.5 * flops / (H100.peak_flops * H100.flash_bwd_efficiency * length), rel=1e-3)
    # per FLOP, short keys run slower (per-block work exposed); split over t, 1/t of the time
    short = (M.fused_attention_time_s(H100, call(512, 1.0), 1, 1)[0] - launch) / (512 ** 2)
    assert short > 1.3 * dense_f / 8192 ** 2
    assert M.fused_attention_time_s(H100, call(8192, 1.0), 1, 8)[0] - launch == pytest.approx(
        dense_f / 8, rel=1e-3)


def test_fused_kernel_time_per_flop_falls_with_the_head_dim_where_calibrated():
    """flash_half_head_dim D_half: a head of D runs at D/(D + D_half) of the rate per FLOP;
    0 (the presets) leaves the head dim out."""
    def call(D):
        return AttentionCall(heads=16, kv_heads=16, q_len=4096, kv_len=4096, head_dim=D,
                             v_head_dim=D, active_fraction=1.0, gemms=(1, 2),
                             materialized_bytes=0)

    def per_flop(cluster, D):
        return [(x - cluster.kernel_launch_s) / call(D).fwd_flops
                for x in M.fused_attention_time_s(cluster, call(D), 1, 1)]
    assert per_flop(H100, 64) == pytest.approx(per_flop(H100, 128), rel=1e-9)
    tuned = dataclasses.replace(H100, flash_half_head_dim=32.0)
    for small, large in zip(per_flop(tuned, 32), per_flop(tuned, 128)):
        assert small / large == pytest.approx((128 / 160) / (32 / 64), rel=1e-6)
    with pytest.raises(ValueError, match="flash_half_head_dim=-1.0: must be >= 0"):
        dataclasses.replace(H100, flash_half_head_dim=-1.0)


def test_flash_drops_the_score_memory_and_traffic():
    prof = _gpt()
    cfg = M.Config(t=1, p=1, d=1, micro_batch_size=1, num_microbatches=1, recompute="none")
    mat = M.predict(prof, dataclasses.replace(H100, attention="materialized"), cfg)
    fl = M.predict(prof, H100, cfg)
    s, a, layers = 8192, 16, 8
    # 5·a·s² bytes per layer (2205.05198) become the logsumexp (4·a·s)
    assert mat.memory.activations_bytes - fl.memory.activations_bytes > 0.9 * layers * 5 * a * s * s
    assert fl.compute_s < mat.compute_s and fl.attention == "flash"
    flash = prof.with_attention("flash")
    assert flash.with_attention("flash") is flash
    assert flash.block.other_bytes == prof.block.other_bytes - (3 * a * s * s + 2 * s * 2048) * 2
    with pytest.raises(ValueError, match="already priced with 'flash'"):
        flash.with_attention("materialized")


def test_selective_recompute_under_flash_saves_little_and_costs_a_kernel_forward():
    prof = _gpt().with_attention("flash")
    kw = dict(t=1, b=1, sp=False, tp_inter=False)
    none = M.block_times_s(prof, H100, kw["t"], kw["b"], "none", kw["sp"], kw["tp_inter"])
    sel = M.block_times_s(prof, H100, kw["t"], kw["b"], "selective", kw["sp"], kw["tp_inter"])
    (call,) = prof.block.fused.calls
    k_fwd = M.fused_attention_time_s(H100, call, 1, 1)[0]
    assert sel[0] - none[0] == pytest.approx(k_fwd, rel=0.01)  # + rewriting the logsumexp
    saved = (M.layer_activation_bytes(prof, 1, 1, "none", False)
             - M.layer_activation_bytes(prof, 1, 1, "selective", False))
    assert saved == 4 * 16 * 8192  # the logsumexp only
    plan = solve(_gpt(), H100, gpus=8, global_batch_size=64, t=1, p=1)
    assert plan.recompute == "none"


# ----- the graph's view -------------------------------------------------------------------------
def _captured(model, seq):
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    cap = capture(model, (ids,), autopar.cross_entropy, torch.zeros_like(ids), repeat_limit=2)
    return profile_from_graph(cap, find_layers(cap))


def test_transformers_llama_mask_read_gqa_unrepeated_and_norm_outputs_recomputed():
    from transformers import LlamaConfig, LlamaForCausalLM
    h, s = 64, 512
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=h, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=s,
            use_cache=False))
    prof = _captured(model, s)
    (call,) = prof.block.fused.calls
    # transformers passes a boolean causal mask (not is_causal) when traced: read on the CPU
    assert call.active_fraction == causal_tile_fraction(s, s) == 0.625
    assert (call.heads, call.kv_heads, call.head_dim) == (8, 2, 8)  # k, v un-repeated
    f, b = prof.block.fused, prof.block
    assert f.act_attention_bytes == 4 * 8 * s  # fp32 logsumexp
    assert b.act_attention_bytes == 8 * s * s * 2  # the math path's 16-bit softmax
    # flash saves k and v un-repeated (the math path saves them repeated 4x); today's stacks
    # recompute both RMSNorm outputs (2·s·h·2 bytes) and SwiGLU's product (s·96·2)
    assert b.act_split_bytes - f.act_split_bytes > 0
    assert b.act_replicated_bytes - f.act_replicated_bytes == 2 * s * h * 2


class _MaskedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, T, 3, 4, 8).unbind(2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + y.transpose(1, 2).reshape(B, T, 32)


class _PaddedAttention(torch.nn.Module):
    """Blocks of attention whose mask depends on the input ids (padding)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(_MaskedBlock() for _ in range(2))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids):
        x = self.emb(ids)
        mask = (ids > 0)[:, None, None, :]  # (B, 1, 1, S): keys that are not padding
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def test_mask_that_depends_on_the_inputs_is_priced_dense_and_noted():
    ids = torch.ones(1, 256, dtype=torch.long)
    cap = capture(_PaddedAttention(), (ids,), autopar.cross_entropy, torch.ones_like(ids),
                  repeat_limit=2)
    prof = profile_from_graph(cap, find_layers(cap))
    (call,) = prof.block.fused.calls
    assert call.active_fraction == 1.0
    assert any("cannot be read at planning time" in n for n in prof.notes)


# ----- memory by pipeline rank ------------------------------------------------------------------
def test_explain_prints_every_pipeline_rank_memory_and_json_keeps_it():
    prof = transformer_profile(num_layers=32, hidden=4096, heads=32, seq_len=4096, vocab=128256)
    plan = solve(prof, H100, gpus=64, global_batch_size=256, t=8, p=4, v=1, schedule="1f1b")
    ranks = plan.predicted.rank_memory
    assert len(ranks) == 4 and plan.predicted.memory == max(ranks, key=lambda m: m.total_bytes)
    assert ranks[0].total_bytes > ranks[1].total_bytes  # embedding + most in flight
    text = plan.explain()
    assert "by pipeline rank" in text
    for r in range(4):
        assert f"rank {r} " in text
    back = Plan.from_json(plan.to_json())
    assert back.predicted.rank_memory == ranks and back.predicted.attention == "flash"


def test_cluster_field_defaults_keep_user_clusters_working():
    cl = Cluster(name="mine", gpus_per_node=4, peak_flops=1e14, memory_bytes=4e10,
                 hbm_bandwidth_Bps=1e12, intra_node_bandwidth_Bps=1e11,
                 intra_node_latency_s=1e-5, inter_node_bandwidth_Bps=1e10,
                 inter_node_latency_s=2e-5, gemm_max_efficiency=0.7, gemm_half_dim=64)
    assert cl.attention == "flash" and 0 < cl.flash_bwd_efficiency <= 1
