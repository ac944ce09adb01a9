"""All-to-all context attention (plan.cp_attention = "all-to-all", DeepSpeed-Ulysses) on gloo
ranks equals one device: losses and full_state_dict after 3 AdamW steps (clipped at 1.0) at
rtol 1e-4 / atol 1e-5, bf16 against one device in bf16. Each context rank trades its tokens of
every head for the whole sequence of heads/c heads around attention (autopar/runtime/
ulysses.py). GPT (is_causal, multi-head) alone, with d = 2 and ZeRO-3, and with p = 2 under
1F1B; the Llama-style model (grouped-query: only the kv heads exchanged) with t = 2 (each
tensor rank's heads split again over c), sequence parallelism and selective recompute, and
with p = 2 under interleaved zero-bubble (the exchange's backward in B) and full recompute;
unmodified transformers Llama (an explicit causal mask read whole); multi-query Falcon (one
kv head < c: repeated before the exchange); bf16."""
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


def test_alltoall_c2_bf16_equals_one_device_bf16():
    check_training("gpt", a2a(make_plan()), precision="bf16", max_norm=0.05)


def _two_nodes(rank, world, *args, **kwargs):
    """train_rank as on 2 nodes of 2 ranks (torchrun --nnodes 2 --nproc-per-node 2 sets
    LOCAL_WORLD_SIZE so): the hybrid's inner degree is read from it."""
    import os

    from programs import train_rank
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    return train_rank(rank, world, *args, **kwargs)


def test_hybrid_c4_equals_one_device():
    """The hybrid (cp_attention "hybrid": all-to-all over the 2 context ranks of a node, the
    K/V all-gather over the 2 nodes; autopar/runtime/ulysses.py context_hybrid_attention) at
    c = 4 on 4 ranks as 2 nodes of 2 equals one device: GPT (is_causal) and the Llama-style
    model (grouped-query: its 2 kv heads exchanged, not repeated), the Llama-style model under
    full recompute (both exchanges run again in the recomputed forward) and GPT in bf16 against
    one device in bf16 (clipped, so the check can fail), and "hybrid-ring" (the ring over the
    2 nodes instead of the all-gather: ulysses.context_hybrid_ring_attention) on GPT and the
    Llama-style model, one spawn. (t = 2 with SP, or p = 2,
    needs 8 ranks at c = 4 = 2 × 2: not run here; the all-to-all covers them at c = 2.)"""
    from programs import adamw_decayed, check_case, compare_training, spawn_cases
    cases = {name: (name, a2a(make_plan(), c=4, cp_attention="hybrid"))
             for name in ("gpt", "llama_style")}
    cases["llama_style full recompute"] = ("llama_style", a2a(
        make_plan(), c=4, cp_attention="hybrid", recompute="full"))
    for name in ("gpt", "llama_style"):   # the ring across (hybrid-ring) in the same spawn
        cases[f"{name} ring across"] = (name, a2a(make_plan(), c=4, cp_attention="hybrid-ring"))
    bf16 = a2a(make_plan(), c=4, cp_attention="hybrid")
    jobs = {k: (c, {}) for k, c in cases.items()}
    jobs["gpt bf16"] = (("gpt", bf16, adamw_decayed, 0.05, "bf16"), {})
    results = spawn_cases(_two_nodes, 4, jobs)
    for label, case in cases.items():
        check_case(label, case, results[label])
    compare_training("gpt", bf16, results["gpt bf16"], max_norm=0.05, precision="bf16")
