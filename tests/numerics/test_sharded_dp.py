"""Sharded data parallelism (ZeRO-3 / FSDP) under every schedule with an unsplit backward,
through the Runner: 3 AdamW steps equal to the single device (losses and full_state_dict at
rtol 1e-4 / atol 1e-5). zero=3 keeps at most two chunks gathered (a chunk gathered once per
pass / micro-batch-group visit, its partial reduce-scatters adding up in the shard); zero=2
gathers each chunk once per step and keeps it until its last backward."""
from __future__ import annotations

import dataclasses

import pytest

from programs import check_against_reference, make_plan

pytestmark = pytest.mark.distributed


def _plan(zero: int, **kw):
    return dataclasses.replace(make_plan(**kw), zero=zero)


@pytest.mark.parametrize("zero", [2, 3])
def test_gpt_1f1b_p2_d2(zero):
    check_against_reference("gpt", _plan(zero, p=2, d=2, m=2, layers=2))


@pytest.mark.parametrize("zero", [2, 3])
def test_gpt_untied_interleaved_p2_d2(zero):
    """v = 2 chunks per rank visited in alternation: under zero=3 each chunk is gathered and
    reduce-scattered several times per step."""
    check_against_reference("gpt_untied", _plan(zero, p=2, d=2, v=2, m=4, layers=4,
                                                schedule="interleaved-1f1b"))


def test_gpt_interleaved_microbatch_group_zero3():
    plan = _plan(3, p=2, d=2, v=2, m=4, layers=4, schedule="interleaved-1f1b")
    check_against_reference("gpt", dataclasses.replace(plan, microbatch_group=4))


def test_llama_fsdp_only_d2():
    """p = t = 1: plain FSDP over 2 data-parallel ranks, one chunk gathered once per step."""
    check_against_reference("llama_style", _plan(3, d=2, m=2, layers=2))


@pytest.mark.slow
def test_gpt_t2_d2_zero3():
    check_against_reference("gpt", _plan(3, t=2, d=2, m=2, layers=2))
