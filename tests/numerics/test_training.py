"""Training through the Runner on gloo ranks equals the single-device model (3 AdamW steps):
data parallelism (GradSync), ZeRO-1, tensor × data, interleaved pipeline × data with ZeRO-1,
active global-norm clipping, bf16 mixed precision (against a single-device bf16 run), and
ZeRO-1's optimizer-state memory (1/d per rank)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from programs import check_training as check
from programs import check_against_reference, make_plan, make_program, with_zero

pytestmark = pytest.mark.distributed


def test_d2():
    check("gpt", make_plan(d=2, m=2, layers=2))


def test_d2_zero1_clipping_active_and_state_bytes_halved():
    results, ref_bytes = check("gpt", with_zero(make_plan(d=2, m=2, layers=2), 1),
                               max_norm=0.05)
    for _losses, _state, nbytes in results:
        # ZeRO-1: each rank keeps Adam's m and v for ceil(N/2) of the N elements (+ a few
        # scalar `step` states per parameter segment): half the single-device bytes
        assert abs(nbytes / ref_bytes - 0.5) < 0.02, (nbytes, ref_bytes)


@pytest.mark.slow
def test_t2_d2_clipping_active():
    check("gpt", make_plan(t=2, d=2, m=2, layers=2), max_norm=0.05)


@pytest.mark.slow
def test_p2_d2_interleaved_zero1():
    check("gpt", with_zero(make_plan(p=2, d=2, v=2, m=2, schedule="interleaved-1f1b",
                                     layers=4), 1))


def test_bf16_d2():
    check("gpt", make_plan(d=2, m=2, layers=2), precision="bf16", max_norm=0.05)


@pytest.mark.slow
def test_bf16_p2_d2_zero1():
    check("gpt", with_zero(make_plan(p=2, d=2, m=2, layers=2), 1), precision="bf16")


@pytest.mark.slow
def test_bf16_t2_sequence_parallel_overlapped_column_parallel():
    """bf16 through the fused column-parallel calls (passes/overlap.py): their weight
    gradients reach the fp32 main_grad hooks like a plain linear's."""
    check("gpt", dataclasses.replace(make_plan(t=2, m=2, layers=2), sequence_parallel=True),
          precision="bf16", max_norm=0.05)


def test_zero3_with_a_split_backward_and_bad_precision_are_clear_errors(monkeypatch):
    """(zero=3 runs under 1f1b, interleaved and breadth-first:
    tests/numerics/test_sharded_dp.py)"""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^Plan.zero=3 with schedule='interleaved-zb'.*use "
                                         r"zero=0 or 1"):
        with_zero(make_plan(d=2, m=2, layers=2, schedule="interleaved-zb"), 3)
    prog, _ = make_program("gpt", make_plan(d=2, m=2, layers=2))
    with pytest.raises(ValueError, match=r"precision='fp64'"):
        prog.compile(precision="fp64")


def test_bf16_p2_interleaved_zero_bubble_clipping_active():
    """Split backwards (W accumulates the weight gradients) feed the fp32 main-grads through
    the post-accumulate hooks, and clipping sees the whole gradient."""
    check("gpt", make_plan(p=2, v=2, m=2, schedule="interleaved-zb", layers=4),
          precision="bf16", max_norm=0.05)


def _ignored_unevenly(plan):
    """make_data's global batches (8 sequences of 8 tokens) with targets -100 (ignored) at
    positions 1-5 of sequences 2-3, 0-4 of sequences 4-7 and 5-6 of sequence 6: the replicas
    (rows 0-3, 4-7) and micro-batches (2 rows each) count 14 to 16 tokens, not 16 each."""
    from programs import RUNTIME_VOCAB, make_data
    out = []
    for x, y in make_data(plan, RUNTIME_VOCAB):
        y = y.clone()
        y[2:4, 1:6] = -100
        y[4:8, 0:5] = -100
        y[6, 5:7] = -100
        out.append((x, y))
    return out


@pytest.mark.parametrize("name, plan", [
    ("gpt", make_plan(d=2, m=2, layers=2)),
    ("llama_style", make_plan(p=2, d=2, m=2, layers=2)),
    ("gpt", dataclasses.replace(make_plan(d=2, m=2, layers=2), c=2)),
], ids=["d2", "p2-d2", "c2-d2"])
def test_ignored_targets_uneven_between_replicas_and_microbatches(name, plan):
    """The step's loss is the mean over every counted token of the global batch, as one device
    computes it (not the mean of the micro-batches' and replicas' means): each micro-batch's
    backward is weighed by the tokens it counts (Runner._loss_scales)."""
    assert plan.global_batch_size == 8
    check_against_reference(name, plan, batches=_ignored_unevenly(plan))


def test_a_microbatch_with_every_target_ignored_adds_nothing():
    """Micro-batch 1 ignores all its targets: its mean is 0/0 and its weight 0, so the step is
    the other micro-batch's mean, with finite gradients, as on one device."""
    plan = make_plan(m=2, layers=2)
    from programs import RUNTIME_VOCAB, make_data
    batches = [(x, y.clone().index_fill_(0, torch.tensor([2, 3]), -100))
               for x, y in make_data(plan, RUNTIME_VOCAB)]
    check_against_reference("gpt", plan, batches=batches)
