"""Ring attention (plan.cp_attention = "ring") on gloo ranks equals one device: losses and
full_state_dict after 3 AdamW steps (clipped at 1.0) at rtol 1e-4 / atol 1e-5. The K/V blocks
travel round the context group (autopar/runtime/ring_attention.py), the backward runs the ring
again; on the examples' GPT (is_causal) and Llama-style model (grouped-query attention through
repeat_interleave: only the kv heads travel), with d = 2 and with t = 2, on unmodified
transformers Llama (an explicit causal mask cut at each block owner's keys) and at c = 4."""
from __future__ import annotations

import pytest

from autopar.plan import Plan
from programs import check_against_reference, check_training, make_plan


def ring(plan: Plan, c: int, **over) -> Plan:
    return Plan.from_dict({**plan.to_dict(), "c": c, "cp_attention": "ring", **over})


@pytest.mark.parametrize("name", ["gpt", "llama_style"])
def test_ring_c2_equals_one_device(name):
    check_against_reference(name, ring(make_plan(), 2))


def test_ring_c2_d2_equals_one_device():
    check_against_reference("gpt", ring(make_plan(d=2), 2, zero=1))


def test_ring_c2_t2_equals_one_device():
    """Each tensor rank rings its own heads (the tensor-parallel sdpa's local heads)."""
    check_against_reference("llama_style", ring(make_plan(t=2), 2))


@pytest.mark.parametrize("name", ["hf_llama", "hf_neox"])
def test_ring_c2_unmodified_transformers_models_equal_one_device(name):
    """transformers builds an explicit causal mask: its rows are the rank's, its columns cut
    at each ring step's block owner; blocks it masks whole are skipped."""
    check_against_reference(name, ring(make_plan(), 2))


def test_ring_c4_equals_one_device():
    """Four context ranks, chunks of one token (sequence 8 = 2c · 1): three ring steps."""
    check_against_reference("llama_style", ring(make_plan(), 4))


@pytest.mark.parametrize("mode", ["selective", "full", "op"])
def test_ring_c2_recompute_equals_one_device(mode):
    """Recomputation runs the ring's forward again inside the backward, on every context
    rank in the same order."""
    check_against_reference("llama_style", ring(make_plan(), 2, recompute=mode))


def test_ring_c2_p2_interleaved_equals_one_device():
    plan = make_plan(p=2, v=2, m=2, schedule="interleaved-1f1b", layers=4)
    check_against_reference("llama_style", ring(plan, 2))


def test_ring_c2_bf16_equals_one_device_bf16():
    """bf16 compute: the tiles in bf16, the merge and the dK/dV accumulators in fp32."""
    check_training("gpt", ring(make_plan(), 2), precision="bf16", max_norm=0.05)


def test_ring_c2_t2_sequence_parallel_equals_one_device():
    """Each context rank's tokens cut again between its tensor ranks outside attention; the
    ring runs on the regathered local tokens of the rank's heads."""
    check_against_reference("hf_llama", ring(make_plan(t=2), 2, sequence_parallel=True))
