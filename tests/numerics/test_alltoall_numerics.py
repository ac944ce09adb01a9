"""All-to-all context attention (plan.cp_attention = "all-to-all", DeepSpeed-Ulysses) on gloo
ranks equals one device: losses and full_state_dict after 3 AdamW steps (clipped at 1.0) at
rtol 1e-4 / atol 1e-5, bf16 against one device in bf16. Each context rank trades its tokens of
every head for the whole sequence of heads/c heads around attention (autopar/runtime/
ulysses.py). Every decoder of tests/models.py with fused attention alone; GPT (is_causal,
multi-head) alone, with d = 2 and ZeRO-3, and with p = 2 under
1F1B; the Llama-style model (grouped-query: only the kv heads exchanged) with t = 2 (each
tensor rank's heads split again over c), sequence parallelism and selective recompute, and
with p = 2 under interleaved zero-bubble (the exchange's backward in B) and full recompute;
unmodified transformers Llama (an explicit causal mask read whole); multi-query Falcon (one
kv head < c: repeated before the exchange); bf16; with d = 2 under ZeRO-2 and with p = 2 under
breadth-first, GPipe and interleaved 1F1B (in the hybrids' 4-rank spawn). The hybrids
("hybrid", "hybrid-ring": the all-to-all inside a node, the all-gather or the ring across)
at c = 4 = 2 × 2 on ranks posing as nodes of 2 (or 4 with t = 2), alone (every decoder;
DeepSeek-V3 in fp32 and bf16) and with t = 2 + SP, p = 2 under interleaved 1F1B, GPipe and
interleaved zero-bubble, d = 2 under ZeRO-2 and ZeRO-3, recompute, bf16; every rank checked
to run the planned method (`_ran_as_planned`)."""
from __future__ import annotations

import pytest

from autopar.plan import Plan
from programs import check_against_reference, check_training, make_plan


def a2a(plan: Plan, c: int = 2, **over) -> Plan:
    return Plan.from_dict({**plan.to_dict(), "c": c, "cp_attention": "all-to-all", **over})


PIPELINE = dict(p=2, m=2, layers=4)


@pytest.mark.parametrize("name, plan, over", [
    ("gpt", make_plan(), {}),
    ("gpt", make_plan(d=2), {"zero": 3}),
    ("gpt", make_plan(**PIPELINE), {}),
    ("llama_style", make_plan(t=2), {"sequence_parallel": True, "recompute": "selective"}),
    ("llama_style", make_plan(v=2, schedule="interleaved-zb", **PIPELINE), {"recompute": "full"}),
    ("hf_llama", make_plan(), {}),
    ("hf_falcon_mq", make_plan(), {}),
])
def test_alltoall_c2_equals_one_device(name, plan, over):
    check_against_reference(name, a2a(plan, **over))


# every decoder of tests/models.py whose attention is a scaled_dot_product_attention call
# (test_context_parallel_numerics.py's ARCHITECTURES and the Llama family), beyond the
# parametrized cases above. Not BLOOM: its attention is written out (baddbmm with ALiBi,
# softmax, bmm), which the context pass keeps on the all-gather under any method and the
# planner never gives another (cost.families.cp_attention_rule; a hand-made plan pinning
# all-to-all on it ran the all-gather, this test's method check found)
EVERY_DECODER = ("hf_gpt2", "hf_falcon", "hf_gptj", "hf_olmo2", "hf_qwen3", "hf_phi3",
                 "hf_gemma", "hf_phi", "hf_opt", "hf_bigcode", "hf_mistral", "hf_neox")


def test_alltoall_c2_every_decoder_equals_one_device():
    """All-to-all attention at c = 2 on every decoder we build, one 2-rank spawn: each writes
    attention and positions its own way (Conv1D's merged rows, fused and multi-query
    projections, interleaved and partial rotary, ALiBi from the mask, q / k norms over all
    heads, learned positions at an offset), and each rank ran the all-to-all over 2 and no
    other context method (`_ran_as_planned`)."""
    from programs import check_case, spawn_cases
    cases = {n: (n, a2a(make_plan())) for n in EVERY_DECODER}
    results = spawn_cases(_on_nodes, 2, {k: ((2, *c), {}) for k, c in cases.items()})
    for label, case in cases.items():
        check_case(label, case, _ran_as_planned(label, case[1], results[label]))


def test_alltoall_c2_bf16_equals_one_device_bf16():
    check_training("gpt", a2a(make_plan()), precision="bf16", max_norm=0.05)


def _on_nodes(rank, world, ranks_per_node, *args, **kwargs):
    """(train_rank's result, {method key: calls}) as on nodes of `ranks_per_node` ranks
    (torchrun --nproc-per-node sets LOCAL_WORLD_SIZE so: the hybrid's inner degree is read from
    it at compile()). Counted where the context methods run: ("hybrid" or "hybrid-ring", k) at
    the hybrid's body with the inner degree k it runs at (so a hybrid that fell back to k = 1,
    the all-gather, is seen), ("all-to-all", n) at each heads<->tokens exchange over n ranks,
    ("ring", n) at each ring of n ranks."""
    import os
    from collections import Counter

    import torch.distributed as dist

    from autopar.runtime import groups, ring_attention, ulysses
    from programs import train_rank
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    seen = Counter()
    body, exchange, ring_cls = ulysses._hybrid, ulysses._exchange, ring_attention._Ring

    def hybrid(q, k, v, cp, *rest, ring):
        inner = groups.hybrid_inner_degree(cp.c, q.shape[1], cp.node_ranks)
        seen["hybrid-ring" if ring else "hybrid", inner] += 1
        return body(q, k, v, cp, *rest, ring=ring)

    def exchanged(x, group, what):
        seen["all-to-all", dist.get_world_size(group)] += 1
        return exchange(x, group, what)

    class Ring(ring_cls):
        def __init__(self, group, rank, c):
            seen["ring", c] += 1
            super().__init__(group, rank, c)
    ulysses._hybrid, ulysses._exchange, ring_attention._Ring = hybrid, exchanged, Ring
    try:
        return train_rank(rank, world, *args, **kwargs), dict(seen)
    finally:
        ulysses._hybrid, ulysses._exchange, ring_attention._Ring = body, exchange, ring_cls


def _ran_as_planned(label: str, plan: Plan, results: list) -> list:
    """train_rank's per-rank results of an `_on_nodes` case, after checking that every rank
    ran the plan's context method and nothing else: the all-to-all over c or the ring of c;
    the hybrids at inner degree k = 2 (their all-to-all over 2, and for hybrid-ring the ring
    of the c/2 outer ranks)."""
    c, method = plan.c, plan.cp_attention
    want = {"all-to-all": {("all-to-all", c)}, "ring": {("ring", c)},
            "hybrid": {("hybrid", 2), ("all-to-all", 2)},
            "hybrid-ring": {("hybrid-ring", 2), ("all-to-all", 2), ("ring", c // 2)}}[method]
    for r, (_, seen) in enumerate(results):
        assert set(seen) == want, f"case {label}: rank {r} ran {seen}, not {method} as {want}"
    return [res for res, _ in results]


def test_hybrid_c4_equals_one_device():
    """On 4 ranks as 2 nodes of 2, one spawn. The hybrid (cp_attention "hybrid": all-to-all
    over the 2 context ranks of a node, the K/V all-gather over the 2 nodes; autopar/runtime/
    ulysses.py context_hybrid_attention) at c = 4: GPT (is_causal) and the Llama-style model
    (grouped-query: its 2 kv heads exchanged, not repeated), the Llama-style model under full
    recompute (both exchanges run again in the recomputed forward), GPT (AdamW) and DeepSeek-V3
    (SGD) in bf16 against one device in bf16 (clipped, so the check can fail); "hybrid-ring"
    (the ring over the 2 nodes instead of the all-gather:
    ulysses.context_hybrid_ring_attention) on GPT, the Llama-style
    model and DeepSeek-V3 (multi-head latent attention: q/k heads of 8 = 4 rotary + 4 not, one
    rotary key expanded to the heads; a dense layer, then routed experts on the rank's tokens).
    The hybrid on every decoder of tests/models.py with fused attention (EVERY_DECODER,
    transformers' Llama and multi-query Falcon: one kv head, repeated up to the inner degree;
    the hybrid-ring on all of them too, checked once, 2026-11-26 night).
    The all-to-all at c = 2 with d = 2 under ZeRO-2, and with p = 2 under breadth-first
    (v = 2), GPipe and interleaved 1F1B (1F1B and interleaved zero-bubble: the parametrized
    test above; the hybrids' schedules: test_hybrid_c4_with_t_p_d_equals_one_device). Every
    rank ran the planned method (`_ran_as_planned`: the hybrids at k = 2). With t, p and d:
    test_hybrid_c4_with_t_p_d_equals_one_device. Cost of the ZeRO-2, breadth-first and
    DeepSeek-V3 cases: ~24 CPU-s summed over the 4 ranks (2026-11-26, 2-core host); the
    whole test 34 s on the faster host of 2026-11-26 night."""
    from programs import adamw_decayed, check_case, compare_training, sgd_momentum, spawn_cases
    cases = {name: (name, a2a(make_plan(), c=4, cp_attention="hybrid"))
             for name in ("gpt", "llama_style")}
    cases["llama_style full recompute"] = ("llama_style", a2a(
        make_plan(), c=4, cp_attention="hybrid", recompute="full"))
    for name in ("gpt", "llama_style", "hf_deepseek_v3"):   # the ring across (hybrid-ring)
        cases[f"{name} ring across"] = (name, a2a(make_plan(), c=4, cp_attention="hybrid-ring"))
    for name in EVERY_DECODER + ("hf_llama", "hf_falcon_mq"):   # every decoder, the hybrid
        cases[f"{name} hybrid"] = (name, a2a(make_plan(), c=4, cp_attention="hybrid"))
    cases["all-to-all d=2 ZeRO-2"] = ("gpt", a2a(make_plan(d=2), zero=2))
    for schedule, v in (("breadth-first", 2), ("gpipe", 1), ("interleaved-1f1b", 2)):
        cases[f"all-to-all p=2 {schedule}"] = ("gpt", a2a(make_plan(
            v=v, schedule=schedule, **PIPELINE)))
    bf16 = a2a(make_plan(), c=4, cp_attention="hybrid")
    jobs = {k: ((2, *c), {}) for k, c in cases.items()}
    jobs["gpt bf16"] = ((2, "gpt", bf16, adamw_decayed, 0.05, "bf16"), {})
    # DeepSeek-V3 in bf16 with SGD: its experts see few tokens, and AdamW turns their bf16
    # rounding into lr-sized moves (programs.sgd_momentum)
    jobs["deepseek bf16"] = ((2, "hf_deepseek_v3", bf16, sgd_momentum, 0.05, "bf16"), {})
    results = spawn_cases(_on_nodes, 4, jobs)
    for label, case in cases.items():
        check_case(label, case, _ran_as_planned(label, case[1], results[label]))
    compare_training("gpt", bf16, _ran_as_planned("gpt bf16", bf16, results["gpt bf16"]),
                     max_norm=0.05, precision="bf16")
    compare_training("hf_deepseek_v3", bf16, _ran_as_planned(
        "deepseek bf16", bf16, results["deepseek bf16"]), max_norm=0.05, precision="bf16",
        optimizer=sgd_momentum)


def test_hybrid_c4_with_t_p_d_equals_one_device():
    """The hybrid methods at c = 4 = 2 × 2 with the other degrees, on 8 ranks, one spawn:
    the hybrid with t = 2 and sequence parallelism (the Llama-style model: 2 query heads and
    1 kv head per tensor rank, the kv head repeated to 2 for the inner all-to-all; 4 ranks a
    node = 2 context ranks a node, so k = 2 inner × 2 nodes), the hybrid with p = 2 under
    interleaved 1F1B (GPT, v = 2: the exchanges of each chunk's attention in its own micro-
    batch order) and under GPipe, hybrid-ring with p = 2 under interleaved zero-bubble (GPT,
    v = 2: the exchanges' and the ring's backward in B, the weight gradients in W), hybrid-ring
    under full recompute with d = 2 and ZeRO-3 (the Llama-style model: the inner all-to-all
    and the outer ring run again in the recomputed forward, parameters gathered per chunk),
    the hybrid with d = 2 and ZeRO-3 (GPT), hybrid-ring with t = 2 and SP (the Llama-style
    model as above, the ring over the 2 nodes) and hybrid-ring in bf16 with d = 2 and ZeRO-2
    (GPT, against one device in bf16, clipped so the check can fail); 2 ranks a node where p
    or d take the outer factor, so the 4 context ranks span 2 nodes. Each equals one device
    (fp32: rtol 1e-4 / atol 1e-5), every rank ran the planned method at k = 2. Cost: ~90
    CPU-s summed over the 8 ranks (2026-11-26, 2-core host), so ~50 s on it idle."""
    from programs import adamw_decayed, check_case, compare_training, sgd_momentum, spawn_cases
    hybrid = dict(c=4, cp_attention="hybrid")
    ring = dict(c=4, cp_attention="hybrid-ring")
    cases = {   # label: (ranks per node, model, plan)
        "hybrid t=2 sp": (4, "llama_style", a2a(make_plan(t=2), sequence_parallel=True,
                                                  **hybrid)),
        "hybrid p=2 interleaved-1f1b": (2, "gpt", a2a(make_plan(
            v=2, schedule="interleaved-1f1b", **PIPELINE), **hybrid)),
        "hybrid p=2 gpipe": (2, "gpt", a2a(make_plan(schedule="gpipe", **PIPELINE), **hybrid)),
        "hybrid-ring p=2 interleaved-zb": (2, "gpt", a2a(make_plan(
            v=2, schedule="interleaved-zb", **PIPELINE), **ring)),
        "hybrid-ring d=2 full recompute ZeRO-3": (2, "llama_style", a2a(
            make_plan(d=2), recompute="full", zero=3, **ring)),
        "hybrid d=2 ZeRO-3": (2, "gpt", a2a(make_plan(d=2), zero=3, **hybrid)),
        "hybrid-ring t=2 sp": (4, "llama_style", a2a(make_plan(t=2), sequence_parallel=True,
                                                       **ring)),
    }
    bf16 = a2a(make_plan(d=2), zero=2, **ring)
    jobs = {k: ((n, name, plan), {}) for k, (n, name, plan) in cases.items()}
    jobs["hybrid-ring d=2 ZeRO-2 bf16"] = ((2, "gpt", bf16, adamw_decayed, 0.05, "bf16"), {})
    results = spawn_cases(_on_nodes, 8, jobs)
    for label, (_, name, plan) in cases.items():
        check_case(label, (name, plan), _ran_as_planned(label, plan, results[label]))
    compare_training("gpt", bf16, _ran_as_planned("bf16", bf16,
                                                  results["hybrid-ring d=2 ZeRO-2 bf16"]),
                     max_norm=0.05, precision="bf16")
