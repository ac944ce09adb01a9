"""Stacks of several kinds of block (issue 31): found from the module structure and the graph,
each kind profiled once, the stack priced as the sum of its layers' kinds and cut into
pipeline stages by cost (cost/kinds.py), at a scale where the kinds' costs differ."""
from __future__ import annotations

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
