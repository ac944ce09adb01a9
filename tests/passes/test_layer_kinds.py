"""Stacks of several kinds of block (issue 31): found from the module structure and the graph,
each kind profiled once, the stack priced as the sum of its layers' kinds and cut into
pipeline stages by cost (cost/kinds.py), at a scale where the kinds' costs differ."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.api import parallelize
from autopar.cost.hardware import get_cluster
from autopar.cost.kinds import plan_config, stage_layers
from autopar.cost.model import load_costs

import models


def test_stage_layers_cut_by_cost():
    """Chunks counted in mean layers become real layers by cumulative cost: 3 light then
    heavy layers (weights 1 and 3), 2 chunks of 4 mean layers: the cut is nearest half of
    the total (9 of 18: after 3 light + 2 heavy layers), not after 4 layers."""
    assert stage_layers([4, 4], [1, 1, 1, 3, 3, 3, 3, 3]) == [5, 3]
    assert stage_layers([0, 8, 0], [1] * 8) == [0, 8, 0]    # edge-only chunks stay empty


def test_stage_layers_bisection_equals_the_scan():
    """The cut's nearest boundary by bisection is the scan's (the least index nearest the
    target), on random stacks of kinds, zero-weight layers and empty chunks included."""
    import random
    from autopar.cost.kinds import _nearest
    rng = random.Random(0)
    for _ in range(3000):
        prefix = [0.0]
        for _ in range(rng.randint(1, 30)):
            prefix.append(prefix[-1] + rng.choice([0.0, 1.0, 2.0, 7.5]))
        lo = rng.randint(0, len(prefix) - 1)
        hi = rng.randint(lo, len(prefix) - 1)
        target = rng.uniform(-1.0, prefix[-1] + 1.0)
        scan = min(range(lo, hi + 1), key=lambda i: abs(prefix[i] - target))
        assert _nearest(prefix, target, lo, hi) == scan, (prefix, target, lo, hi)


def _plan(name: str, layers: int, **config):
    with torch.device("meta"):
        model = models.build(name, seed=0, layers=layers, vocab=32000, seq=4096, hidden=2048,
                             heads=16, kv_heads=4, ffn=5632, **config)
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    prog = parallelize(model, 1024, example_inputs=(ids,), loss_fn=autopar.cross_entropy,
                       global_batch_size=1024, cluster="dgx-h100-80gb", p=4, v=1, t=2)
    return prog.plan, prog.profile


def _stage_times_ns(plan, profile) -> list[float]:
    lc = load_costs(profile.for_cluster(get_cluster(plan.cluster)), get_cluster(plan.cluster),
                    plan_config(plan))
    return [st.layers_ms * 1e6 + (lc.embed_ns if st.embedding else 0)
            + (lc.head_ns if st.head else 0) for st in plan.stages]


def _check_balanced(plan, profile) -> None:
    """Per-stage times (layers + embedding / head) within 10% of each other, or one layer
    apart where a layer is more than 10% of a stage. The embedding's stage may be lighter:
    the solver gives pipeline rank 0 less load for its tail (the embedding's gradient
    reduction and optimizer step), as it does for a stack of one kind."""
    times = _stage_times_ns(plan, profile)
    layer_ns = max(st.layers_ms * 1e6 / st.num_layers for st in plan.stages if st.num_layers)
    rest = [x for x, st in zip(times, plan.stages) if not st.embedding]
    assert max(rest) - min(rest) <= max(0.1 * max(rest), layer_ns), times
    assert times[0] <= max(rest) + layer_ns, times
    assert all(st.kinds for st in plan.stages if st.num_layers)


def test_dense_first_then_moe_60_layers_balanced_at_1024_gpus():
    """60 layers, the first 3 dense (a 5632-wide MLP), the other 57 MoE (64 experts, top 8,
    1408 wide): two kinds, priced per kind, stages cut by cost within 10%."""
    plan, profile = _plan("hf_qwen3_moe", 60, dense=(0, 1, 2), experts=64, top_k=8)
    assert [k.num_layers for k in profile.layer_kinds] == [3, 57]
    assert profile.layer_kinds[0].layers == (0, 1, 2)
    # each kind's activations are its own block's (they were the first kind's for every kind):
    # an MoE layer saves its 8 routed copies of every token and their expert intermediates
    dense, moe = (k.profile.block for k in profile.layer_kinds)
    assert moe.act_split_bytes > 1.5 * dense.act_split_bytes, (moe, dense)
    _check_balanced(plan, profile)
    assert "× model.layers [Qwen3MoeMLP]" in str(plan)


def test_local_global_3_to_1_48_layers_balanced_at_1024_gpus():
    """48 Cohere2 layers, 3 sliding-window (rotary) to 1 full-attention (no rotary): the
    kinds' graphs differ, the pattern is kept from the module settings, stages by cost."""
    types = ("sliding_attention",) * 3 + ("full_attention",)
    plan, profile = _plan("hf_cohere2", 48, types=types * 12)
    assert [k.num_layers for k in profile.layer_kinds] == [36, 12]
    assert profile.layer_kinds[1].layers == tuple(range(3, 48, 4))
    _check_balanced(plan, profile)


def test_a_first_layer_adding_only_its_own_ops_is_a_kind():
    """Cohere2 alternating 1:1, sliding (rotary) first: the first block holds the full layer's
    ops and more, as T5's first block does, but hands the next block nothing besides the
    hidden state (T5's also hands on its position bias), so it is a kind of its own, both in
    a 2-layer capture and in the planning capture of 48 layers (which keeps two blocks)."""
    from autopar.passes.capture import capture
    from autopar.passes.layers import find_layers
    cap = capture(models.build("hf_cohere2", seed=0, layers=2),
                  (torch.zeros(2, 8, dtype=torch.long),), autopar.cross_entropy)
    s = find_layers(cap)
    assert [k.num_layers for k in s.kinds] == [1, 1] and s.pattern == (0, 1)
    types = ("sliding_attention", "full_attention")
    plan, profile = _plan("hf_cohere2", 48, types=types * 24)
    assert [k.num_layers for k in profile.layer_kinds] == [24, 24]
    assert profile.layer_kinds[0].layers == tuple(range(0, 48, 2))
    _check_balanced(plan, profile)


def test_attention_sinks_split_with_their_heads():
    """GPT-OSS's sinks (one logit per head, viewed (1, H, 1, 1), expanded and concatenated to
    the scores) are split with the heads at t = 2, not held whole while the scores are split
    (the shape error of issue 31); with 2 kv heads and with one (multi-query: k/v whole, the
    q heads and their sinks split)."""
    from autopar.passes import meta as K
    from autopar.passes.capture import capture
    from autopar.passes.tensor_parallel import propagate_sharding
    from autopar.passes.sharding import Shard
    for kv in (2, 1):
        cap = capture(models.build("hf_gpt_oss", seed=0, kv_heads=kv),
                      (torch.zeros(2, 8, dtype=torch.long),), autopar.cross_entropy)
        propagate_sharding(cap.gm, 2)
        sinks = [n for n in cap.gm.graph.nodes
                 if n.op == "get_attr" and n.target.endswith("sinks")]
        assert len(sinks) == 2
        assert all(n.meta[K.TP_LAYOUT] == Shard(0, (4,)) for n in sinks), kv


def test_shared_block_weights_priced_once_per_stage():
    """ALBERT's layer group, called at all 4 depths, is one set of weights: none of it in the
    per-layer block, all of it held by the first stage and (p ≥ 2) a copy by every other, its
    gradient in the stages' sync (issue 31 item 2)."""
    from dataclasses import replace
    from autopar.cost.dp_terms import tied_sync_s
    from autopar.cost.model import Config
    from autopar.cost.shares import rank_params
    from autopar.passes.capture import capture
    from autopar.passes.graph_profile import profile_from_graph
    from autopar.passes.layers import find_layers
    model = models.build("hf_albert", seed=0, layers=4)
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long),), autopar.cross_entropy)
    profile = profile_from_graph(cap, find_layers(cap))
    group = sum(p.numel() for p in model.albert.encoder.albert_layer_groups.parameters())
    assert profile.num_layers == 4 and profile.block.params_elems == 0
    assert profile.shared_split_elems + profile.shared_replicated_elems == group
    assert profile.params_elems == sum(p.numel() for p in model.parameters())
    cl = get_cluster("dgx-h100-80gb")
    one, two, three = (rank_params(profile, Config(t=1, p=p, d=1, micro_batch_size=1,
                                                   num_microbatches=2)) for p in (1, 2, 3))
    # p = 2 adds the shared group's copy and the tied MLM decoder's table copy to the head
    # (at p = 1 the one rank holds each once)
    from autopar.cost.shares import padded_vocab
    emb = model.albert.embeddings.word_embeddings.weight
    table = padded_vocab(emb.shape[0], 1) * emb.shape[1]     # the vocabulary padded, as priced
    assert two.embedding - one.embedding == 0 and two.head - one.head == group + table
    assert (one.middle, two.middle, three.middle) == (0, 0, group)   # p = 3: a copy each
    untied = replace(profile, tied_embeddings=False)
    assert tied_sync_s(untied, cl, Config(t=1, p=2, d=1, micro_batch_size=1,
                                          num_microbatches=2)) > 0


# ----- memory by the real layers of each stage (issue 31 item 1, issue 32 item 2) ----------------

def _light_heavy(light_ffn: int = 512, heavy_ffn: int = 32768):
    """16 layers: 8 light (a 512-wide MLP, the time in attention at 8k tokens) then 8 heavy
    (32768 wide: 16× the weights per unit of time), as a dense-then-MoE stack is."""
    from autopar.cost.kinds import mixed_profile
    from autopar.cost.profile import transformer_profile
    dims = dict(hidden=2048, heads=16, seq_len=8192, vocab=32000, num_layers=8)
    light = transformer_profile(name="light", ffn=light_ffn, **dims)
    heavy = transformer_profile(name="heavy", ffn=heavy_ffn, **dims)
    return mixed_profile([light, heavy], [tuple(range(8)), tuple(range(8, 16))],
                         ["light", "heavy"])


_PINS = dict(gpus=8, global_batch_size=64, t=1, p=4, d=2, v=1, micro_batch_size=1,
             schedule="1f1b", zero=1, max_alternatives=0)


def test_stage_memory_is_its_real_layers_and_the_solver_refuses_the_mean_layers_fit():
    """The mean-layer price of the solver's choice fits a GPU its real heaviest stage
    overflows: priced by the mean layer the solver keeps recompute off at the even split;
    priced by each stage's real layers it refuses that plan for one that fits (recompute, or
    a split that leaves the first stage its light layers alone: each stage's load is its real
    layers' too). Per-rank memory follows the kinds: a rank of 3 heavy layers holds more
    weights than one of 8 light + 1 heavy."""
    import dataclasses
    from autopar.api import over_kinds
    from autopar.cost.model import predict
    from autopar.cost.solver import solve
    profile = _light_heavy()
    mean = dataclasses.replace(profile, layer_kinds=())     # the L mean layers alone
    h100 = get_cluster("dgx-h100-80gb")
    mean_plan = solve(mean, h100, **_PINS)
    split = [st.num_layers for st in mean_plan.stages]
    real = predict(profile, h100, plan_config(mean_plan), split).memory_bytes_per_gpu
    assert real > 1.05 * mean_plan.predicted.memory_bytes_per_gpu
    gpu = dataclasses.replace(h100, memory_bytes=(real + mean_plan.predicted.memory_bytes_per_gpu) / 2)
    cap = gpu.usable_memory_bytes + gpu.reserved_bytes
    mean_plan = solve(mean, gpu, **_PINS)                    # the mean layer: fits, no recompute
    assert mean_plan.recompute == "none" and mean_plan.predicted.memory_bytes_per_gpu <= cap
    assert predict(profile, gpu, plan_config(mean_plan), split).memory_bytes_per_gpu > cap
    plan = over_kinds(solve(profile, gpu, **_PINS), profile)
    assert plan.predicted.memory_bytes_per_gpu <= cap
    assert (plan.recompute, [st.kinds for st in plan.stages]) != (
        "none", [st.kinds for st in over_kinds(mean_plan, profile).stages])
    roomy = over_kinds(solve(profile, h100, **_PINS), profile)
    ranks, stages = roomy.predicted.rank_memory, roomy.stages
    assert stages[0].kinds == "8 × light + 1 × heavy"
    assert sorted(st.kinds for st in stages[1:]) == ["2 × heavy", "2 × heavy", "3 × heavy"]
    three = next(r for r, st in enumerate(stages) if st.kinds == "3 × heavy")
    two = next(r for r, st in enumerate(stages) if st.kinds == "2 × heavy")
    assert ranks[three].weights_bytes > ranks[0].weights_bytes > ranks[two].weights_bytes
    lines = roomy.explain()
    assert "Predicted memory per GPU by pipeline rank" in lines


def test_stage_time_is_its_real_layers_where_no_cut_balances():
    """8 light then 8 heavy layers (~4× the time) at p = 8, 2 mean layers a stage: no cut
    balances them (8 light layers are one stage, and 7 stages share the 8 heavy ones), so
    the heaviest stage, two heavy layers, sets the pipeline's steady state: priced by its
    real layers, not by the mean (before, every stage was priced at the mean and the step
    ~12% short). At p = 2 the cut balances and the price is the mean's; the solver's plan
    is priced by its own split."""
    import dataclasses
    from autopar.cost.kinds import kind_layer_ns, layer_weights
    from autopar.cost.model import Config, config_costs, predict
    from autopar.cost.solver import solve
    profile = _light_heavy()
    mean = dataclasses.replace(profile, layer_kinds=())
    h100 = get_cluster("dgx-h100-80gb")
    for p, worse in ((8, 1.1), (2, 1.0)):
        cfg = Config(t=1, p=p, d=8 // p, v=1, micro_batch_size=1, num_microbatches=16,
                     schedule="1f1b", zero=1, recompute="none")
        kinds, flat = predict(profile, h100, cfg), predict(mean, h100, cfg)
        weights = layer_weights(profile, kind_layer_ns(profile, h100, cfg))
        cut = stage_layers([16 // p] * p, weights)
        stages = [sum(weights[sum(cut[:r]):sum(cut[:r + 1])]) for r in range(p)]
        heaviest = max(stages[1:-1] or stages) / (sum(weights) / p)
        assert heaviest > worse
        assert kinds.step_time_s == pytest.approx(flat.step_time_s, rel=0.02) if p == 2 else \
            kinds.step_time_s > worse * flat.step_time_s
        if p == 8:   # the critical rank (a middle one) computes its real layers
            middle = 16 * config_costs(mean, h100, cfg).layer_compute_ns * 2 / 1e9
            assert kinds.compute_s == pytest.approx(heaviest * middle, rel=0.01)
    plan = solve(profile, h100, **dict(_PINS, p=8, d=1))
    again = predict(profile, h100, plan_config(plan), [st.num_layers for st in plan.stages])
    assert plan.predicted.step_time_s == pytest.approx(again.step_time_s, rel=1e-9)


def test_kinds_memory_of_one_kind_twice_is_the_one_kind_stack():
    """A stack of two kinds that are the same block prices every rank's memory as the stack
    of one kind does (the kinds' coefficients are memory.memory_coefficients' own), at v = 1,
    under the interleaved schedule's walk and with ZeRO-3's gathered weights."""
    import dataclasses
    from autopar.cost.model import Config, predict
    from autopar.cost.profile import transformer_profile
    from autopar.cost.kinds import mixed_profile
    dims = dict(hidden=1024, heads=8, seq_len=2048, vocab=32000, ffn=4096)
    one = transformer_profile(num_layers=8, **dims)
    half = transformer_profile(num_layers=4, **dims)
    two = mixed_profile([half, half], [(0, 2, 4, 6), (1, 3, 5, 7)], ["a", "b"])
    h100 = get_cluster("dgx-h100-80gb")
    for v, schedule, zero in ((1, "1f1b", 1), (2, "interleaved-1f1b", 1),
                              (2, "breadth-first", 3)):
        cfg = Config(t=2, p=2, d=2, v=v, micro_batch_size=1, num_microbatches=8,
                     schedule=schedule, recompute="selective", sequence_parallel=True,
                     zero=zero)
        a = predict(one, h100, cfg).rank_memory
        b = predict(two, h100, cfg).rank_memory
        for x, y in zip(a, b):
            for f in dataclasses.fields(x):
                assert getattr(y, f.name) == pytest.approx(getattr(x, f.name), rel=1e-9)


def test_kind_times_restated_for_context_slices_and_fp8():
    """The per-kind times the cut weighs are one context rank's at c = 2 (its half of the
    sequence: less than the whole sequence's), as every profile the cost model prices, and
    FP8's where the GEMMs run in FP8."""
    from autopar.cost.kinds import kind_layer_ns
    from autopar.cost.model import Config
    profile = _light_heavy()
    h100 = get_cluster("dgx-h100-80gb")
    base = dict(t=1, p=1, micro_batch_size=1, num_microbatches=16, schedule="1f1b",
                recompute="none", zero=1)
    whole = kind_layer_ns(profile, h100, Config(c=1, d=4, **base))
    half = kind_layer_ns(profile, h100, Config(c=2, d=2, **base))
    assert all(h < w for h, w in zip(half, whole))
    assert half[1] / half[0] != pytest.approx(whole[1] / whole[0], rel=1e-3)
    # and FP8 GEMMs (`with_gemm_precision`) in the kinds' own profiles, as in the mean layer's
    fp8 = kind_layer_ns(profile.with_gemm_precision("fp8", h100), h100, Config(c=1, d=4, **base))
    assert all(f < w for f, w in zip(fp8, whole))


def test_each_kinds_layer_time_carries_the_split_backward_of_its_schedule():
    """On an eager cluster interleaved-zb's B/W split costs every layer more; one memo prices
    both schedules, so a kind's cached per-layer time must know which one it priced
    (`config.layer_parts_key`): an interleaved-1f1b time reused for interleaved-zb would
    drop the split from each stage's real layers."""
    import dataclasses
    from autopar.cost.compute import split_backward_s
    from autopar.cost.config import Config
    from autopar.cost.kinds import kind_layer_ns
    from autopar.cost.memo import CostMemo
    profile = _light_heavy()
    eager = dataclasses.replace(get_cluster("local-cpu"), split_backward_op_s=1e-5,
                                split_backward_s_per_byte=0.0)
    common = dict(t=1, p=2, d=1, v=2, micro_batch_size=1, num_microbatches=4)
    il, zb = (Config(schedule=s, **common) for s in ("interleaved-1f1b", "interleaved-zb"))
    memo = CostMemo()
    plain, split = kind_layer_ns(profile, eager, il, memo), kind_layer_ns(profile, eager, zb, memo)
    for k, a, b in zip(profile.layer_kinds, plain, split):
        extra = split_backward_s(eager, k.profile.for_cluster(eager).block, 0.0)  # frac 0
        assert extra > 0 and b - a == pytest.approx(extra * 1e9, abs=2), k.name
