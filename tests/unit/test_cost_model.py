"""Pure tests of cost/model.py and cost/hardware.py: formulas, limits, units, sources."""
from __future__ import annotations

import pytest

from autopar.cost import model as M
from autopar.cost.hardware import CLUSTER_NAMES, get_cluster, with_overrides
from autopar.cost.precision import fp8_weight_elems
from autopar.cost.profile import transformer_profile

A100 = get_cluster("dgx-a100-80gb")


def _gpt(**kw):
    args = dict(num_layers=8, hidden=1024, heads=16, seq_len=1024, vocab=51200)
    args.update(kw)
    return transformer_profile(**args)


def test_presets_are_sourced_and_unknown_name_lists_known():
    for name in CLUSTER_NAMES:
        cl = get_cluster(name)
        assert cl.name == name and cl.sources and cl.peak_flops > 0
    assert get_cluster(A100) is A100
    with pytest.raises(ValueError, match="dgx-a100-80gb"):
        get_cluster("dgx-z100")


def test_local_cpu_falls_back_without_calibration():
    cl = get_cluster("local-cpu")
    assert cl.peak_flops > 0 and cl.memory_bytes > 0 and cl.gpus_per_node >= 1


def test_gemm_efficiency_grows_with_shape_and_saturates():
    small = M.gemm_efficiency(A100, 128, 128, 128)
    big = M.gemm_efficiency(A100, 8192, 8192, 8192)
    assert small < 0.8 * big and big <= A100.gemm_max_efficiency
    # per-FLOP time falls with size: a micro-batch of 1 is slower per FLOP than of 8
    t1 = M.gemm_time_s(A100, 1, 256, 1024, 1024) / 256
    t8 = M.gemm_time_s(A100, 1, 2048, 1024, 1024) / 2048
    assert t8 < t1
    # skinny GEMMs are memory bound: traffic / HBM bandwidth dominates
    skinny = M.gemm_time_s(A100, 1, 1, 8192, 8192)
    assert skinny >= 8192 * 8192 * 2 / A100.hbm_bandwidth_Bps


def test_collective_formulas():
    nb = 1e9
    bw = A100.intra_node_bandwidth_Bps
    lat = A100.intra_node_latency_s
    assert M.allreduce_s(A100, nb, 8, False) == pytest.approx(lat + 2 * 7 / 8 * nb / bw)
    assert M.allgather_s(A100, nb, 8, False) == pytest.approx(lat + 7 / 8 * nb / bw)
    assert M.allreduce_s(A100, nb, 1, False) == 0.0
    assert M.p2p_s(A100, nb, True) == pytest.approx(
        A100.inter_node_latency_s + nb / A100.inter_node_bandwidth_Bps)


@pytest.mark.parametrize("stride,size,gpus,expected", [
    (1, 8, 64, False),   # t=8 tensor group: one node
    (1, 16, 64, True),   # t=16 spans two 8-GPU nodes
    (8, 4, 64, True),    # data group of t=8, d=4: ranks 0, 8, 16, 24
    (2, 4, 64, False),   # t=2, d=4: ranks 0, 2, 4, 6 in one node
    (1, 3, 64, True),    # t=3 groups straddle node boundaries
    (4, 2, 8, False),    # everything inside one node
])
def test_group_spans_nodes_golden(stride, size, gpus, expected):
    assert M.group_spans_nodes(A100, stride=stride, size=size, gpus=gpus) is expected


def test_config_validation():
    with pytest.raises(ValueError, match="v=2"):
        M.Config(t=1, p=2, d=1, v=2, schedule="1f1b")
    with pytest.raises(ValueError, match="recompute"):
        M.Config(t=1, p=1, d=1, recompute="some")
    with pytest.raises(ValueError, match="t=0"):
        M.Config(t=0, p=1, d=1)


def _equal_chunk_costs(p, v, m, layer_ns=1000):
    cfg = M.Config(t=1, p=p, d=1, v=v, num_microbatches=m,
                   schedule="interleaved-1f1b" if v > 1 else "1f1b")
    z = dict(embed_ns=0, head_ns=0, p2p_ns=0, dp_layer_ns=0, dp_first_ns=0, dp_last_ns=0,
             window_layer_ns=0, opt_layer_ns=0, opt_first_ns=0, opt_last_ns=0)
    return M.ConfigCosts(cfg=cfg, layer_compute_ns=layer_ns, layer_tp_ns=0, **z,
                         mem_layer_bytes=(0,) * p, mem_fixed_bytes=(0,) * p, capacity_bytes=1,
                         flops_per_step=1.0, model_flops_per_step=1.0,
                         mem_parts=(), mem_fixed_parts=(), layer_fwd_ns=layer_ns // 3)


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (8, 1, 64), (4, 2, 8), (8, 3, 64), (2, 4, 4)])
def test_pipeline_closed_form_is_exact_for_equal_chunks(p, v, m):
    cc = _equal_chunk_costs(p, v, m)
    y = [v * 2] * p                 # 2 layers per chunk on every rank
    ideal = m * 2 * v * 1000        # m micro-batches of the rank's work
    assert M.step_time_ns(cc, y) == pytest.approx(ideal * (1 + (p - 1) / (v * m)))


def test_pipeline_uneven_chunks_max_loaded_rank():
    cc = _equal_chunk_costs(3, 1, 10)
    y = [1, 3, 2]                   # loads 1000, 3000, 2000
    assert M.step_time_ns(cc, y) == (10 - 1) * 3000 + 6000


def test_activation_memory_matches_2205_05198():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    prof = _gpt(num_layers=2, hidden=h, heads=a, seq_len=s)
    none = M.layer_activation_bytes(prof, t, b, "none", False)
    assert none == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-6)
    sp = M.layer_activation_bytes(prof, t, b, "none", True)
    assert sp == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t, rel=1e-6)
    sel_sp = M.layer_activation_bytes(prof, t, b, "selective", True)
    assert sel_sp == pytest.approx(s * b * h * 34 / t, rel=1e-6)
    assert M.layer_activation_bytes(prof, t, b, "full", False) == 2 * s * b * h


def test_memory_per_zero_level_and_inflight():
    prof = _gpt()
    kw = dict(t=1, p=4, d=4, v=1, micro_batch_size=1, num_microbatches=8, schedule="1f1b")
    c0 = M.config_costs(prof, A100, M.Config(zero=0, **kw))
    c1 = M.config_costs(prof, A100, M.Config(zero=1, **kw))
    w, g, o, act = c0.mem_parts[1]
    assert (w + g + o) / M.shard_params_elems(prof, 1)[0] == pytest.approx(18)
    w1, g1, o1, _ = c1.mem_parts[1]
    assert (w1 + g1 + o1) / M.shard_params_elems(prof, 1)[0] == pytest.approx(6 + 12 / 4)
    # 1F1B: rank r holds p - r micro-batches
    acts = [c0.mem_parts[r][3] for r in range(4)]
    assert acts[0] == pytest.approx(4 * acts[3]) and acts[1] == pytest.approx(3 * acts[3])
    gp = M.config_costs(prof, A100, M.Config(zero=0, **{**kw, "schedule": "gpipe"}))
    assert gp.mem_parts[3][3] == pytest.approx(8 * acts[3])
    il = M.config_costs(prof, A100, M.Config(zero=0, **{**kw, "schedule": "interleaved-1f1b",
                                                          "v": 2}))
    # interleaved first stage: p·(1 + (p-1)/(p·v)) micro-batches' worth of l/p layers
    assert il.mem_parts[0][3] == pytest.approx(acts[3] * (1 + 3 / (4 * 2)) * 4 / 1, rel=0.2)


def test_one_backward_fills_the_sharded_gradients_as_it_frees_the_activations():
    """ZeRO-2/3 with one micro-batch and one chunk a rank: the accumulators (and the
    reduce-scatter buffer) fill as the backward frees the activations, so a layer is priced
    the larger of the two; with two micro-batches the second's activations sit beside the
    first's gradients, and with two chunks the first chunk's gradients beside the second's
    activations: both summed."""
    prof = _gpt()
    block = M.shard_params_elems(prof, 1)[0]
    kw = dict(t=1, p=1, d=4, v=1, micro_batch_size=1, schedule="1f1b", zero=3)
    one = M.config_costs(prof, A100, M.Config(num_microbatches=1, **kw)).mem_parts[0]
    two = M.config_costs(prof, A100, M.Config(num_microbatches=2, **kw)).mem_parts[0]
    fresh = two[1] - 4 / 4 * block                      # 4(pending + 1) B a parameter
    assert fresh == pytest.approx(8 * block)
    assert one[3] == pytest.approx(two[3])              # 1F1B at p = 1: one in flight
    assert one[1] == pytest.approx(4 / 4 * block + max(0.0, fresh - one[3]))
    assert sum(one) < sum(two)
    bf = dict(kw, v=2, schedule="breadth-first")
    chunks = M.config_costs(prof, A100, M.Config(num_microbatches=1, **bf)).mem_parts[0]
    st = M.weight_gather_stats(M.Config(num_microbatches=1, **bf))
    assert chunks[1] == pytest.approx((4 / 4 + 4 * (st.peak_pending + 1) / 2) * block)


def test_an_fp32_run_holds_4_byte_weights_and_no_master_beside_a_whole_one():
    """An fp32 run (compile's default precision, `autopar tune`'s plans): the weight is 4 B
    where a rank holds it whole and is its own master where the optimizer is not sharded
    (ZeRO-0: 4 + 4 + 8 = 16 B, not bf16's 2 + 4 + 12); ZeRO-1's shard keeps an fp32 master
    (4 + 4 + 12/d); ZeRO-2/3 gather 4-byte weights. tests/numerics/test_runtime_memory.py
    measures the runtime against these."""
    prof, fp32 = _gpt(), _gpt().with_training_bytes(4)
    block = M.shard_params_elems(prof, 1)[0]
    kw = dict(t=1, p=4, d=4, v=1, micro_batch_size=1, num_microbatches=8, schedule="1f1b")
    for zero, want in ((0, 16), (1, 8 + 12 / 4)):
        w, g, o, _ = M.config_costs(fp32, A100, M.Config(zero=zero, **kw)).mem_parts[1]
        assert (w, g) == pytest.approx((4 * block, 4 * block))
        assert (w + g + o) / block == pytest.approx(want)
    kw = dict(kw, p=1, v=4, schedule="breadth-first")
    st = M.weight_gather_stats(M.Config(zero=3, **kw))
    w16 = M.config_costs(prof, A100, M.Config(zero=3, **kw)).mem_parts[0][0]
    w32 = M.config_costs(fp32, A100, M.Config(zero=3, **kw)).mem_parts[0][0]
    assert (w16 / block, w32 / block) == pytest.approx((2 * st.peak_gathered / 4,
                                                        4 * st.peak_gathered / 4))


def test_sharded_weights_memory_is_what_the_bf16_runtime_holds():
    """ZeRO-3 / ZeRO-2 under bf16 (autopar/runtime/zero3_chunks.py): at rest only the fp32 master
    shard, its fp32 gradient and Adam's m, v (16/d B per parameter, no 16-bit weight copy);
    while running, the plan's gathered chunks in bf16 (2 B) and the fp32 gradient accumulators
    of its chunks with unreduced gradients plus one fp32 reduce-scatter buffer (4 B each)."""
    prof = _gpt()
    d, v = 4, 4
    kw = dict(t=1, p=1, d=d, v=v, micro_batch_size=1, num_microbatches=8,
              schedule="breadth-first")
    block = M.shard_params_elems(prof, 1)[0]
    for zero in (2, 3):
        cfg = M.Config(zero=zero, **kw)
        st = M.weight_gather_stats(cfg)
        w, g, o, _ = M.config_costs(prof, A100, cfg).mem_parts[0]
        assert w / block == pytest.approx(2 * st.peak_gathered / v)       # gathered bf16 only
        assert g / block == pytest.approx(4 / d + 4 * (st.peak_pending + 1) / v)
        assert o / block == pytest.approx(12 / d)                         # master, m, v
    assert (M.weight_gather_stats(M.Config(zero=3, **kw)).peak_gathered
            < M.weight_gather_stats(M.Config(zero=2, **kw)).peak_gathered == v)
    # FP8 (cost/precision.py): the blocks' FP8 weights gathered in 1 byte, in memory and on
    # the wire (runtime/zero3_chunks.py Fp8Gather); the rest (norms, biases) in 2
    h100 = get_cluster("dgx-h100-80gb")
    fp8, cfg = prof.with_gemm_precision("fp8", h100), M.Config(zero=3, **kw)
    share = fp8_weight_elems(fp8, 1) / block
    assert 0.99 < share < 1                                        # a GPT block's linears
    st = M.weight_gather_stats(cfg)
    bf16_cc, fp8_cc = M.config_costs(prof, h100, cfg), M.config_costs(fp8, h100, cfg)
    assert fp8_cc.mem_parts[0][0] / block == pytest.approx((2 - share) * st.peak_gathered / v)
    assert bf16_cc.mem_parts[0][0] / block == pytest.approx(2 * st.peak_gathered / v)
    assert 0 < fp8_cc.dp_layer_ns < 0.8 * bf16_cc.dp_layer_ns      # gathers halved, not R
    # rowwise FP8 gathers its weights in bf16 (cast along two axes): priced as bf16's
    rowwise = M.config_costs(prof.with_gemm_precision("fp8", h100, "rowwise"), h100, cfg)
    assert rowwise.mem_parts[0][0] / block == pytest.approx(2 * st.peak_gathered / v)


def test_prediction_terms_add_up_and_flops_definitions():
    prof = _gpt(num_layers=12)
    cfg = M.Config(t=2, p=2, d=2, v=2, micro_batch_size=2, num_microbatches=8,
                   schedule="interleaved-1f1b", recompute="full", sequence_parallel=True)
    pr = M.predict(prof, A100, cfg, [3, 3, 3, 3])
    assert sum(pr.terms().values()) == pytest.approx(pr.step_time_s, rel=1e-9)
    assert pr.memory.total_bytes == pytest.approx(pr.memory_bytes_per_gpu)
    # tflops counts recompute (4 passes of the blocks), mfu does not (3 passes)
    assert pr.tflops_per_gpu * 1e12 / A100.peak_flops > pr.mfu
    assert 0 < pr.bubble_fraction < 1
    with pytest.raises(ValueError, match="layers_per_chunk"):
        M.predict(prof, A100, cfg, [3, 3, 3])


def test_recompute_and_sequence_parallel_tradeoffs():
    prof = _gpt(num_layers=8, hidden=4096, heads=32, seq_len=2048)
    base = dict(t=8, p=1, d=1, micro_batch_size=2, num_microbatches=4)
    pr = {rc: M.predict(prof, A100, M.Config(recompute=rc, **base)) for rc in M.RECOMPUTE}
    assert pr["none"].step_time_s < pr["selective"].step_time_s < pr["full"].step_time_s
    assert (pr["full"].memory.activations_bytes < pr["selective"].memory.activations_bytes
            < pr["none"].memory.activations_bytes)
    # op (every other GEMM's output kept) lies between selective and full on both counts
    assert pr["selective"].step_time_s < pr["op"].step_time_s < pr["full"].step_time_s
    assert (pr["full"].memory.activations_bytes < pr["op"].memory.activations_bytes
            < pr["selective"].memory.activations_bytes)
    sp = M.predict(prof, A100, M.Config(recompute="selective", sequence_parallel=True, **base))
    assert sp.memory.activations_bytes < pr["selective"].memory.activations_bytes


def test_dp_comm_uses_inter_node_link_when_group_spans_nodes():
    prof = _gpt()
    inside = M.config_costs(prof, A100, M.Config(t=1, p=1, d=8, num_microbatches=1))
    across = M.config_costs(prof, with_overrides(A100, gpus_per_node=4),
                            M.Config(t=1, p=1, d=8, num_microbatches=1))
    assert across.dp_layer_ns > 5 * inside.dp_layer_ns



def test_tp_overlap_exposes_only_what_the_gemm_cannot_hide():
    """cost/overlap.py: a collective pipelined with its GEMM in k pieces exposes comm/k plus
    the excess over the GEMM; the presets keep TP communication exposed (their calibrated
    runs did), and a cluster that overlaps prices less TP time, never less than 1/k of the
    forward's, with the same compute."""
    from autopar.cost.overlap import (ROW_PIECES, block_tp_exposed_s, hidden_behind_s,
                                      pipelined_exposed_s)
    from autopar.runtime.collectives import ROW_CHUNKS
    assert ROW_PIECES == ROW_CHUNKS
    assert pipelined_exposed_s(4.0, 4.0, 4) == pytest.approx(1.0)
    assert pipelined_exposed_s(4.0, 1.0, 4) == pytest.approx(1.0 + 0.75 * 3.0)
    assert pipelined_exposed_s(4.0, 9.0, 1) == 4.0 and hidden_behind_s(2.0, 3.0) == 0.0
    assert block_tp_exposed_s(4.0, 2.0, 4.0, 1.0, 4, forward_passes=2) == pytest.approx(3.0)
    # what hides still costs 1 - overlap of its time: of 10 s, 3 exposed, 7 hidden
    assert block_tp_exposed_s(4.0, 2.0, 4.0, 1.0, 4, 2, overlap=0.5) == pytest.approx(6.5)
    assert block_tp_exposed_s(4.0, 2.0, 4.0, 1.0, 4, 2, overlap=0.0) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="overlap"):
        block_tp_exposed_s(4.0, 2.0, 4.0, 1.0, 4, 2, overlap=1.5)
    with pytest.raises(ValueError, match="pieces"):
        pipelined_exposed_s(1.0, 1.0, 0)
    assert not any(get_cluster(n).tp_overlap for n in CLUSTER_NAMES)
    prof = transformer_profile(num_layers=4, hidden=4096, heads=32, seq_len=2048, vocab=51200)
    cfg = M.Config(t=8, p=1, d=1, v=1, micro_batch_size=1, num_microbatches=4,
                   schedule="1f1b", recompute="none", zero=0)
    h100 = get_cluster("dgx-h100-80gb")
    exposed = M.predict(prof, h100, cfg)
    hidden = M.predict(prof, with_overrides(h100, tp_overlap=True), cfg)
    free = M.predict(prof, with_overrides(h100, tp_overlap=True, tp_comm_overlap=1.0), cfg)
    assert hidden.compute_s == exposed.compute_s == free.compute_s
    assert exposed.tp_comm_s / ROW_PIECES / 2 < free.tp_comm_s < hidden.tp_comm_s
    assert hidden.tp_comm_s < exposed.tp_comm_s
    assert hidden.step_time_s < exposed.step_time_s


def test_a_tied_table_is_held_once_at_p_1_and_copied_at_p_2():
    """A tied word embedding: the last stage's copy exists only at p > 1; at p = 1 the one rank
    holds the (vocab-padded) table once, so its parameters are the model's."""
    from autopar.cost.shares import padded_vocab, rank_params
    prof = transformer_profile(num_layers=4, hidden=256, heads=4, seq_len=128, vocab=1000)
    assert prof.tied_embeddings
    one, two = (rank_params(prof, M.Config(t=1, p=p, d=1)) for p in (1, 2))
    table = padded_vocab(1000, 1) * 256
    assert two.head - one.head == table
    pad = (padded_vocab(1000, 1) - 1000) * 256
    assert one.block * 4 + one.embedding + one.head == prof.params_elems + pad


@pytest.mark.parametrize("attention", ["flash", "materialized"])
def test_op_recompute_keeps_every_other_gemm_output_and_reruns_the_rest(attention):
    """op (passes/recompute.py op_policy) on GPT's block (qkv, scores, context, proj, fc_in,
    fc_out): keeps qkv's and fc_in's outputs (and a fused kernel's), reruns proj and a
    written-out attention core, never the last GEMM (early stop); priced accordingly."""
    from autopar.cost.compute import flops_per_seq
    from autopar.cost.shares import op_checkpoint
    prof = _gpt(num_layers=2, hidden=256, heads=4, seq_len=512).with_attention(attention)
    blk, e, b = prof.block, prof.activation_bytes_per_elem, 2
    names = [g.name for g in blk.gemms]
    kept, again = op_checkpoint(prof, blk)
    want_kept = {"qkv", "fc_in"} | ({"context"} if attention == "flash" else set())
    want_again = {"proj"} | ({"scores", "context"} if attention == "materialized" else set())
    assert {names[i] for i in kept} == want_kept and {names[i] for i in again} == want_again
    out = sum(g.batch * g.m * g.n * e for g in blk.gemms if g.name in want_kept)
    assert M.layer_activation_bytes(prof, 1, b, "op", False) == b * (blk.input_bytes + out)
    rec = flops_per_seq(prof, 1, "op")[1]
    assert rec == prof.num_layers * sum(g.fwd_flops for g in blk.gemms if g.name in want_again)


def test_op_recompute_pays_the_selective_checkpoints_per_op_work_on_an_eager_host():
    """Cluster.checkpoint_op_s (calibrate: PyTorch's selective checkpoint per forward op) is
    added to an op-recomputed block once per forward op, where ops run eagerly; a fused GPU
    stack's host work hides behind its kernels."""
    import dataclasses
    from autopar.cost.compute import block_times_s, forward_ops
    prof = _gpt(num_layers=2, hidden=256, heads=4, seq_len=512)
    for kind, paid in (("eager", True), ("fused", False)):
        cl = dataclasses.replace(get_cluster("local-cpu"), elementwise=kind, checkpoint_op_s=0.0)
        p = prof.for_cluster(cl)
        base = block_times_s(p, cl, 1, 2, "op", False, False)[0]
        more = block_times_s(p, dataclasses.replace(cl, checkpoint_op_s=2e-5), 1, 2, "op",
                             False, False)[0]
        assert more - base == pytest.approx(forward_ops(p.block) * 2e-5 if paid else 0.0)
        assert forward_ops(p.block) > 0
        full = block_times_s(p, dataclasses.replace(cl, checkpoint_op_s=2e-5), 1, 2, "full",
                             False, False)[0]
        assert full == block_times_s(p, cl, 1, 2, "full", False, False)[0]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_an_eager_runtime_pays_each_further_micro_batchs_gradient_accumulation(zero):
    """Each micro-batch after the first adds its weight gradients into the accumulators of
    every weight the rank holds (read both, write one: 12 B a weight in fp32) — m − 1 times a
    step, at every ZeRO level, only where ops run eagerly (a fused stack accumulates inside
    the weight-gradient GEMM). On 2 local CPU ranks a 4-layer GPT's 3 extra accumulations
    cost ~1 ms of a 60 ms step, unpriced before."""
    import dataclasses

    from autopar.cost.compute import GRAD_ACCUMULATE_BYTES
    from autopar.cost.shares import rank_params
    prof = _gpt(num_layers=4, hidden=256, heads=4, seq_len=256).with_training_bytes(4)
    for kind in ("eager", "fused"):
        cl = dataclasses.replace(get_cluster("local-cpu"), elementwise=kind)
        p = prof.for_cluster(cl)
        opt = {}
        for mb in (1, 4):   # 4 sequences a replica: 4 micro-batches of 1, or 1 of 4
            cfg = M.Config(t=1, p=1, d=2, micro_batch_size=mb, num_microbatches=4 // mb,
                           zero=zero)
            opt[mb] = M.predict(p, cl, cfg).optimizer_s
        params = rank_params(M.rank_profile(p, cl, cfg), cfg)
        held = 4 * params.block + params.embedding + params.head
        extra = 3 * held * (GRAD_ACCUMULATE_BYTES + 4) / (cl.hbm_bandwidth_Bps
                                                           * cl.elementwise_efficiency)
        assert opt[1] - opt[4] == pytest.approx(extra if kind == "eager" else 0.0, rel=1e-6)


def test_the_searchs_least_tail_stays_under_every_micro_batch_count():
    """The search bounds a sharded-weight configuration's tail once for every b and m sharing
    its key (cost/search.py `_least_tail_s`); with gradient accumulation priced per further
    micro-batch on an eager host, that bound takes one micro-batch's, so it stays under the
    tail of a configuration with fewer micro-batches than the one it was computed from."""
    import dataclasses

    from autopar.cost.memo import CostMemo
    from autopar.cost.search import _least_tail_s
    from autopar.cost.step import total_tail_ns
    cl = dataclasses.replace(get_cluster("local-cpu"), elementwise="eager")
    prof = _gpt(num_layers=4, hidden=256, heads=4, seq_len=256).with_training_bytes(4) \
        .for_cluster(cl)
    cfgs = [M.Config(t=1, p=1, d=2, micro_batch_size=4 // m, num_microbatches=m, zero=3)
            for m in (4, 1)]
    least = [_least_tail_s(prof, cl, cfg, CostMemo()) for cfg in cfgs]
    assert least[0] == pytest.approx(least[1])
    for cfg in cfgs:
        tail_s = total_tail_ns(M.config_costs(prof, cl, cfg), prof.num_layers) / 1e9 / cfg.p
        assert least[0] <= tail_s


@pytest.mark.parametrize("attention", ["flash", "materialized"])
def test_a_checkpointed_region_pays_torch_utils_checkpoints_own_work_on_an_eager_host(attention):
    """Cluster.checkpoint_region_s (calibrate: torch.utils.checkpoint per region beyond its
    recomputation) is added once a block under full and op, once per attention core under
    selective, never without recompute, and only where ops run eagerly."""
    import dataclasses
    from autopar.cost.compute import block_times_s
    prof = _gpt(num_layers=2, hidden=256, heads=4, seq_len=512)
    for kind, paid in (("eager", True), ("fused", False)):
        cl = dataclasses.replace(get_cluster("local-cpu"), elementwise=kind,
                                 attention=attention, checkpoint_region_s=0.0)
        more = dataclasses.replace(cl, checkpoint_region_s=3e-4)
        p = prof.for_cluster(cl)
        for mode in ("none", "full", "selective", "op"):
            if mode == "op" and attention == "materialized":
                continue
            extra = (block_times_s(p, more, 1, 2, mode, False, False)[0]
                     - block_times_s(p, cl, 1, 2, mode, False, False)[0])
            want = 3e-4 if paid and mode != "none" else 0.0   # GPT: one attention core
            assert extra == pytest.approx(want, abs=1e-12), (kind, mode)
