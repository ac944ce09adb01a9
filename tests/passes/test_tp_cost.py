"""The tensor-parallel pass's replicated fallbacks and inserted collectives are priced per t.

A Llama-style block with grouped-query attention keeps its k/v projections replicated when t
exceeds the key/value heads (passes/tensor_parallel.py); passes/tp_cost.py states that as a
correction of the structural profile and cost/model.py prices it: the k/v GEMMs whole, their
weights whole, the gradients of the sliced k/v all-gathered. Without fallbacks nothing changes.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from autopar.cost import model as M
from autopar.cost.hardware import get_cluster, with_overrides
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve, tensor_degrees
from autopar.examples.gpt import lm_cross_entropy
from autopar.passes.capture import capture
from autopar.passes.layers import find_layers
from autopar.passes.graph_profile import profile_from_graph
from autopar.passes.tp_cost import tp_corrections, with_tp_corrections

import models

A100 = get_cluster("dgx-a100-80gb")
# GEMM time = FLOPs / (peak · e_max) exactly: no shape efficiency, launch or HBM term
FLOP_BOUND = with_overrides(A100, name="flop-bound", gemm_half_dim=1e-9, kernel_launch_s=0.0,
                            hbm_bandwidth_Bps=1e30)
S, H, HEADS, FFN, LAYERS = 16, 64, 4, 96, 2


def _llama(kv: int):
    return models.llama_style(vocab=128, seq=S, layers=LAYERS, hidden=H, heads=HEADS,
                              kv_heads=kv, ffn=FFN)


@functools.lru_cache(maxsize=None)
def _captured(kv: int):
    torch.manual_seed(0)
    model = _llama(kv)
    ids = torch.randint(0, 128, (2, S))
    cap = capture(model, (ids,), lm_cross_entropy, ids, repeat_limit=2)
    structure = find_layers(cap)
    return cap, structure, profile_from_graph(cap, structure)


@functools.lru_cache(maxsize=None)
def _profiles(kv: int):
    """(structural profile, the same with the pass's corrections at t = 2, 4)."""
    cap, structure, prof = _captured(kv)
    return prof, with_tp_corrections(prof, cap, structure, [2, 4])


def _gemm_names(prof, idx):
    return [prof.block.gemms[i].name for i in idx]


# ----- (a) grouped-query attention, t > kv heads --------------------------------------------------

def test_kv_projections_replicated_when_t_exceeds_kv_heads():
    prof, fixed = _profiles(kv=2)
    assert prof.kv_heads == 2 and prof.tp_fallbacks == ()
    assert {(c.t, c.sequence_parallel) for c in fixed.tp_fallbacks} == {
        (2, False), (2, True), (4, False), (4, True)}
    assert fixed.tp_correction(2) is None
    assert _sp_norm_weights(fixed.tp_correction(2, True).block) == [H, H]   # only SP's norms
    c = fixed.tp_correction(4)
    assert _gemm_names(prof, c.block.replicated_gemms) == ["attn.k_proj", "attn.v_proj"]
    kv_dim = H // HEADS * 2
    assert c.block.params_elems == 2 * H * kv_dim          # k_proj and v_proj weights
    assert c.embedding.empty and c.head.empty
    assert len(c.fallbacks) == 2 * LAYERS and all("cannot keep dim" in f for f in c.fallbacks)
    # the replicated k / v reach attention sliced by heads: their gradient is all-gathered
    assert [(x.kind, x.elems, x.backward) for x in c.block.collectives] == \
        [("all-gather", S * H, True)] * 2
    # attention saves k / v only after the slice: no activation stays whole
    assert c.block.act_split_bytes == 0 and c.block.act_attention_bytes == 0
    assert c.block.allreduce_elems_removed == 0 and c.block.other_split_bytes > 0
    # sequence parallelism: the replicated k / v also read an all-gather of the sequence
    csp = fixed.tp_correction(4, True)
    assert csp.block.replicated_gemms == c.block.replicated_gemms
    assert [(x.kind, x.elems, x.backward) for x in csp.block.collectives if x.per_sequence] == \
        [("all-gather", S * H, False)] + [("all-gather", S * H, True)] * 2
    # ... and the two RMSNorm weights, read by sequence shards, all-reduce their gradients
    assert _sp_norm_weights(csp.block) == [H, H]


def _sp_norm_weights(fix):
    """Sizes of the replicated parameters whose gradient sequence parallelism all-reduces
    (the runtime's copy_to_tp on a weight a sequence shard reads), once per micro-batch."""
    assert all(x.kind == "all-reduce" and x.backward and "copy_to_tp" in x.what
               for x in fix.collectives if not x.per_sequence)
    return [x.elems for x in fix.collectives if not x.per_sequence]


def test_fallback_compute_priced_from_the_gemm_shapes():
    prof, fixed = _profiles(kv=2)
    t, cl = 4, FLOP_BOUND
    cfg = M.Config(t=t, p=1, d=1)
    comp0, tp0, *edges0 = M.load_parts_s(prof, cl, cfg)
    comp1, tp1, *edges1 = M.load_parts_s(fixed, cl, cfg)
    kv = [g for g in prof.block.gemms if g.name in ("attn.k_proj", "attn.v_proj")]
    assert [(g.m, g.n, g.k, g.tp_split) for g in kv] == [(S, H // 2, H, "n")] * 2
    # forward + 2 backward GEMMs of each, now whole instead of 1/t
    extra_flops = 3 * sum(2 * g.m * g.n * g.k for g in kv) * (1 - 1 / t)
    assert comp1 - comp0 == pytest.approx(extra_flops / (cl.peak_flops * cl.gemm_max_efficiency),
                                          rel=1e-6)
    assert comp1 > comp0
    e = prof.activation_bytes_per_elem
    assert tp1 - tp0 == pytest.approx(2 * M.allgather_s(cl, S * H * e, t, False), rel=1e-9)
    assert edges1 == edges0
    # on the real cluster too: a slower step, more tensor-parallel communication
    a, b = M.predict(prof, A100, cfg), M.predict(fixed, A100, cfg)
    assert b.step_time_s > a.step_time_s and b.tp_comm_s > a.tp_comm_s
    assert b.compute_s >= a.compute_s


def test_fallback_memory_counts_kv_weights_whole():
    prof, fixed = _profiles(kv=2)
    t = 4
    c = fixed.tp_correction(t)
    per_layer = c.block.params_elems * (1 - 1 / t)
    assert (M.shard_params_elems(fixed, t)[0] - M.shard_params_elems(prof, t)[0]
            == pytest.approx(per_layer))
    assert M.shard_params_elems(fixed, t)[1:] == M.shard_params_elems(prof, t)[1:]
    cfg = M.Config(t=t, p=1, d=1, zero=0)
    a, b = M.predict(prof, A100, cfg), M.predict(fixed, A100, cfg)
    # 2 + 4 + 12 bytes (16-bit weights, fp32 grads, Adam) per parameter, every layer
    assert b.memory_bytes_per_gpu - a.memory_bytes_per_gpu == pytest.approx(
        18 * per_layer * LAYERS)
    assert b.memory.activations_bytes == a.memory.activations_bytes
    # t = 2 splits everything: nothing changes
    cfg2 = M.Config(t=2, p=1, d=1)
    assert M.predict(prof, A100, cfg2) == M.predict(fixed, A100, cfg2)


def test_a_deferred_w_keeps_the_replicated_gemms_outputs_whole():
    """Zero-bubble's deferred W keeps the gradient at each weight GEMM's output: a k/v
    projection the pass keeps whole (t = 4 > 2 kv heads) has its whole output on every rank,
    not 1/t of it; at t = 2 nothing is replicated and nothing changes."""
    from autopar.cost.memory import pending_w_layer_bytes
    prof, fixed = _profiles(kv=2)
    t, b = 4, 2
    whole = fixed.tp_correction(t).block.replicated_gemms
    e = prof.activation_bytes_per_elem
    outputs = sum(prof.block.gemms[i].batch * prof.block.gemms[i].m * prof.block.gemms[i].n
                  for i in whole)
    assert outputs > 0
    assert (pending_w_layer_bytes(fixed, t, b, False) - pending_w_layer_bytes(prof, t, b, False)
            == pytest.approx(b * e * outputs * (1 - 1 / t)))
    assert pending_w_layer_bytes(fixed, 2, b, False) == pending_w_layer_bytes(prof, 2, b, False)
    zb = M.Config(t=t, p=2, d=1, v=2, schedule="interleaved-zb", micro_batch_size=b,
                  num_microbatches=4)
    assert (M.predict(fixed, A100, zb).memory.activations_bytes
            > M.predict(prof, A100, zb).memory.activations_bytes)


def test_analysis_can_be_rerun_for_any_t():
    """The pass writes only meta: analysing t = 4, 2, 4 in any order gives the same answers."""
    cap, structure, prof = _captured(kv=2)
    once = tp_corrections(cap, structure, prof, [4, 2])
    again = tp_corrections(cap, structure, prof, [2], sequence_parallel=(True,)) + \
        tp_corrections(cap, structure, prof, [4])
    key = {(c.t, c.sequence_parallel): c for c in once}
    assert all(key[(c.t, c.sequence_parallel)] == c for c in again)


# ----- (b) no fallbacks ---------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [
    M.Config(t=2, p=1, d=1), M.Config(t=4, p=1, d=1, sequence_parallel=True),
    M.Config(t=4, p=2, d=1, num_microbatches=4, recompute="selective"),
    M.Config(t=2, p=2, d=2, v=1, num_microbatches=2, recompute="full", zero=1,
             sequence_parallel=True),
])
def test_no_fallbacks_no_change(cfg):
    """Without SP nothing changes; with SP only the norms' gradient all-reduces are added
    (the runtime's copy_to_tp on every replicated weight a sequence shard reads)."""
    prof, fixed = _profiles(kv=HEADS)
    assert len(fixed.tp_fallbacks) == 4
    assert all(c.empty for c in fixed.tp_fallbacks if not c.sequence_parallel)
    assert fixed.notes == prof.notes
    if not cfg.sequence_parallel:
        assert fixed.tp_correction(cfg.t, cfg.sequence_parallel) is None
        assert M.predict(fixed, A100, cfg) == M.predict(prof, A100, cfg)
        assert M.config_costs(fixed, A100, cfg) == M.config_costs(prof, A100, cfg)
        return
    corr = fixed.tp_correction(cfg.t, True)
    assert _sp_norm_weights(corr.block) == [H, H] and _sp_norm_weights(corr.head) == [H]
    assert corr.block == dataclasses.replace(corr.block.__class__(),
                                             collectives=corr.block.collectives)
    got, base = M.predict(fixed, A100, cfg), M.predict(prof, A100, cfg)
    assert got.tp_comm_s > base.tp_comm_s and got.step_time_s > base.step_time_s


def test_textbook_profile_has_no_corrections():
    prof = transformer_profile(num_layers=2, hidden=128, heads=8, kv_heads=2, seq_len=64,
                               vocab=256)
    assert prof.tp_fallbacks == () and prof.tp_correction(8) is None


# ----- (c) the solver ------------------------------------------------------------------------------

def test_solver_avoids_a_t_whose_fallbacks_cost_more():
    """4 GPUs, 2 sequences per step: the structural profile prices t = 4 as the fastest; with
    the k/v projections replicated and their gradients gathered, t = 2 × d = 2 wins. (c = 1
    pinned: the question is which t, not whether a sequence split beats both.)"""
    prof, fixed = _profiles(kv=2)
    assert tensor_degrees(prof, A100, 4) == [2, 4]
    plain = solve(prof, A100, gpus=4, global_batch_size=2, c=1)
    priced = solve(fixed, A100, gpus=4, global_batch_size=2, c=1)
    assert plain.t == 4 and priced.t < plain.t
    pinned_plain = solve(prof, A100, gpus=4, global_batch_size=2, t=4)
    pinned = solve(fixed, A100, gpus=4, global_batch_size=2, t=4)
    assert pinned.predicted.step_time_s > pinned_plain.predicted.step_time_s
    assert priced.predicted.step_time_s < pinned.predicted.step_time_s
    # the solver's number is the cost model's (one source of truth)
    assert pinned.predicted == M.predict(fixed, A100, M.Config(
        t=4, p=pinned.p, d=pinned.d, v=pinned.v, micro_batch_size=pinned.micro_batch_size,
        num_microbatches=pinned.num_microbatches, schedule=pinned.schedule,
        recompute=pinned.recompute, sequence_parallel=pinned.sequence_parallel,
        zero=pinned.zero), [s.last_layer - s.first_layer for s in pinned.stages])


def test_parallelize_prices_the_fallbacks():
    import autopar
    torch.manual_seed(0)
    model = _llama(kv=2)
    ids = torch.randint(0, 128, (2, S))
    prog = autopar.parallelize(model, gpus=4, example_inputs=(ids,),   # c = 1: which t
                               loss_fn=autopar.cross_entropy, global_batch_size=2, c=1)
    prof = prog.profile
    assert {c.t for c in prof.tp_fallbacks} == {2, 4}
    assert prof.tp_correction(4) is not None and prof.tp_correction(2) is None
    assert any("t=4" in n and "fallback" in n for n in prof.notes)
    assert prog.plan.t == 2
    structural = dataclasses.replace(prof, tp_fallbacks=())
    cfg = M.Config(t=4, p=1, d=1)
    assert M.predict(prof, A100, cfg).step_time_s > M.predict(structural, A100, cfg).step_time_s


def test_mean_over_the_split_dim_priced_as_a_small_all_reduce_each_way():
    # OLMo-2 RMS-normalises q and k over all heads (the split dim): per block, each norm's
    # (T, 1) statistic is all-reduced forward, and the gradient of the rsqrt computed from it
    # (which scales the split q / k) is all-reduced backward; nothing falls back
    model = models.build("hf_olmo2", seed=0)
    ids = torch.randint(0, 64, (2, 8))
    cap = capture(model, (ids,), lm_cross_entropy, ids, repeat_limit=2)
    structure = find_layers(cap)
    prof = profile_from_graph(cap, structure)
    for corr in tp_corrections(cap, structure, prof, [2]):
        assert not corr.fallbacks and not corr.block.replicated_gemms
        got = sorted((c.kind, c.elems, c.backward) for c in corr.block.collectives
                     if c.per_sequence)
        assert got == [("all-reduce", 8, False)] * 2 + [("all-reduce", 8, True)] * 2, \
            (corr.sequence_parallel, corr.block.collectives)
        # SP: the post-norms' weights (hidden 32), read by sequence shards, all-reduce their
        # gradients; without SP nothing replicated is read by a split op
        assert _sp_norm_weights(corr.block) == ([32, 32] if corr.sequence_parallel else [])


def test_only_an_unsettled_propagation_is_priced_structurally(monkeypatch):
    """A model the sharding rules cannot settle (PropagationError) is planned on, that t priced
    structurally and noted; any other error in the analysis is a bug and propagates."""
    from autopar.passes import tp_cost
    from autopar.passes.tensor_parallel import PropagationError
    cap, structure, prof = _captured(kv=2)

    def unsettled(gm, t, **kw):
        raise PropagationError(f"tensor_parallel: propagation loops at x (t={t})")

    monkeypatch.setattr(tp_cost, "propagate_sharding", unsettled)
    fixed = with_tp_corrections(prof, cap, structure, [2])
    assert fixed.tp_fallbacks == ()
    assert any("t=2: pass analysis failed (PropagationError: tensor_parallel: propagation "
               "loops at x (t=2)); priced structurally" in n for n in fixed.notes)

    def bug(gm, t, **kw):
        raise KeyError("a propagation bug")

    monkeypatch.setattr(tp_cost, "propagate_sharding", bug)
    with pytest.raises(KeyError, match="a propagation bug"):
        with_tp_corrections(prof, cap, structure, [2])


def test_a_t_the_pass_refuses_to_build_is_never_offered():
    """DiffLlama with 2 kv heads: at t = 2 its value projection's blocks (1, 1) cannot split
    and the lost split feeds no split work, which building the program refuses
    (`lost_region_refusal`, strict). The planning analysis asks the same rule: t = 2 is noted
    and refused (`tp_refused`), the free plan does not take it, and pinning it is one line
    naming the node and the fix; the build's error names the same node."""
    import autopar
    from autopar.passes.tensor_parallel import propagate_sharding
    model = models.build("hf_diffllama", seed=0)
    ids = torch.randint(0, 64, (2, 8))
    prog = autopar.parallelize(model, gpus=2, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=4)
    assert prog.plan.t == 1 and [t for t, _ in prog.profile.tp_refused] == [2]
    assert any("t=2: not offered, the pass refuses it" in n for n in prog.profile.notes)
    with pytest.raises(ValueError, match=r"^solve: t=2: the tensor-parallel pass refuses t=2: "
                       r"cannot split (\w+) across t=2 ranks.*leave t unpinned") as planned:
        autopar.parallelize(model, gpus=2, example_inputs=(ids,), t=2,
                            loss_fn=autopar.cross_entropy, global_batch_size=4)
    node = planned.value.args[0].split("cannot split ")[1].split()[0]
    cap = capture(model, (ids,), lm_cross_entropy, ids)
    with pytest.raises(ValueError, match=f"tensor_parallel: cannot split {node} across t=2"):
        propagate_sharding(cap.gm, 2)


def test_multi_query_whole_kv_rows_priced_as_replicated_parameters():
    """GPT-BigCode's c_attn split in part (q by heads, the one k/v head whole on every rank):
    no GEMM falls back, its k/v rows (weight and bias) are the parameters kept whole and its
    k/v columns the GEMM columns computed whole, at every t (the same whatever t)."""
    model = models.hf_bigcode(seq=S)
    ids = torch.randint(0, 64, (2, S))
    cap = capture(model, (ids,), lm_cross_entropy, ids, repeat_limit=2)
    structure = find_layers(cap)
    prof = profile_from_graph(cap, structure)
    fixed = with_tp_corrections(prof, cap, structure, [2, 4])
    hidden, d = 32, 8
    for t in (2, 4):
        c = fixed.tp_correction(t)
        assert c is not None and not c.fallbacks
        assert c.block.replicated_gemms == ()
        assert c.block.params_elems == 2 * d * hidden + 2 * d
        c_attn = [i for i, g in enumerate(fixed.block.gemms) if g.name == "attn.c_attn"]
        assert c.block.whole_columns == ((c_attn[0], 2 * d),)
    # the k/v columns run whole on every rank: forward + 2 backward GEMMs of them, not 1/t
    t, cl = 4, FLOP_BOUND
    cfg = M.Config(t=t, p=1, d=1)
    g = fixed.block.gemms[c_attn[0]]
    extra_flops = 3 * 2 * g.m * (2 * d) * g.k * (1 - 1 / t)
    comp0, comp1 = M.load_parts_s(prof, cl, cfg)[0], M.load_parts_s(fixed, cl, cfg)[0]
    assert comp1 - comp0 == pytest.approx(extra_flops / (cl.peak_flops * cl.gemm_max_efficiency),
                                          rel=1e-6)
