"""Time to train: the critical-batch relations of 2001.08361 §5, the batch choice on small
textbook cases (the solver's step times), bad inputs, and the plan's JSON round trip."""
from __future__ import annotations

import math

import pytest

from autopar.cost.critical_batch import (KAPLAN_N_C_PARAMS,
                                         check_training_inputs,
                                         critical_batch_tokens_from_loss,
                                         critical_batch_tokens_from_params,
                                         loss_nats_from_params, min_steps, steps_for_tokens,
                                         tokens_processed)
from autopar.cost.hardware import get_cluster
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve
from autopar.cost.time_to_train import batch_candidates, plan_for_tokens
from autopar.plan import Plan
from autopar.scaling import Family, gpu_range, parallel_return, sweep

A100 = get_cluster("dgx-a100-80gb")
SEQ = 1024


# ----- the formulas (textbook values) ----------------------------------------------------------
def test_kaplan_constants_and_fixed_points():
    # eq. 1.1 at N = N_c is a loss of one nat; eq. 5.3 at L = 1 nat is B* itself
    assert loss_nats_from_params(KAPLAN_N_C_PARAMS) == pytest.approx(1.0)
    assert critical_batch_tokens_from_loss(1.0) == pytest.approx(2e8)
    # B_crit doubles for every ~13 % drop of the loss (the paper's "2^α_B ≈ 1.16" reading):
    # halving L multiplies B_crit by 2^(1/0.21) = 27.1
    assert critical_batch_tokens_from_loss(2.0) == pytest.approx(2e8 / 2 ** (1 / 0.21))
    assert critical_batch_tokens_from_loss(2.0) == pytest.approx(7.37e6, rel=1e-3)


def test_critical_batch_of_textbook_models():
    # GPT-3 175B (N ≈ 1.74e11 non-embedding): L = (8.8e13/1.74e11)^0.076 ≈ 1.605 nats and
    # B_crit ≈ 2e8 / 1.605^4.76 = 2e8 / 9.52 ≈ 2.1e7 tokens (~10,000 sequences of 2048)
    n = 12 * 96 * 12288 ** 2
    assert loss_nats_from_params(n) == pytest.approx(1.605, abs=2e-3)
    assert critical_batch_tokens_from_params(n) == pytest.approx(2.1e7, rel=0.02)
    # larger models have larger critical batches (lower loss)
    assert critical_batch_tokens_from_params(1e12) > critical_batch_tokens_from_params(1e11)


@pytest.mark.parametrize("batch_ratio", [0.01, 0.3, 1.0, 3.0, 100.0])
def test_steps_and_tokens_trade_off_on_the_hyperbola(batch_ratio):
    tokens, crit = 3e11, 4e6
    b = batch_ratio * crit
    s, e = steps_for_tokens(tokens, b, crit), tokens_processed(tokens, b, crit)
    s_min, e_min = min_steps(tokens, crit), tokens
    assert (s / s_min - 1) * (e / e_min - 1) == pytest.approx(1.0)    # eq. 5.1
    assert e == pytest.approx(b * s)                                   # E = B·S
    assert e_min / s_min == pytest.approx(crit)                        # eq. 5.2
    if batch_ratio == 1.0:  # at the critical batch: twice the minimum steps and tokens
        assert s == pytest.approx(2 * s_min) and e == pytest.approx(2 * e_min)


def test_batch_candidates_are_powers_of_two_and_three_times_them():
    c = batch_candidates(SEQ, 64 * SEQ)
    assert c[0] == 1 and c[-1] == 8 * 64
    assert all(b & (b - 1) == 0 or (b % 3 == 0 and (b // 3) & (b // 3 - 1) == 0) for b in c)
    assert batch_candidates(SEQ, 64 * SEQ, multiple=12) == [12, 24, 48, 96, 192, 384]
    # far above the critical batch, candidates still reach one sequence per GPU
    assert batch_candidates(SEQ, 2 * SEQ, gpus=64)[-1] == 64


# ----- the batch choice on small cases (the solver's step times) -------------------------------
def _gpt2_small():
    return transformer_profile(name="gpt-125m", num_layers=12, hidden=768, heads=12,
                               seq_len=SEQ, vocab=50304)


def _days(res, g):
    return res.point(g, "auto").days


AUTO = Family(name="auto", schedules=("1f1b", "breadth-first"), zero_levels=(0, 1),
              description="1F1B or breadth-first")


def _sweep(crit_tokens, counts):
    return sweep(_gpt2_small(), A100, tokens=1e10, critical_batch_tokens=crit_tokens,
                 critical_batch_source="given", gpu_counts=counts, families=(AUTO,))


def test_below_critical_batch_more_gpus_shorten_training_almost_linearly():
    res = _sweep(1e9, (8, 16, 32))          # B_crit ~ 1M sequences: far above any batch here
    for a, b in ((8, 16), (16, 32)):
        ret = parallel_return(a, _days(res, a), b, _days(res, b))
        assert ret > 0.85, (a, b, ret)       # doubling the GPUs nearly halves the time
        assert _days(res, b) < _days(res, a)


def test_far_above_critical_batch_more_gpus_stop_helping():
    res = _sweep(4 * SEQ, (8, 64, 512))     # B_crit = 4 sequences: each GPU already needs more
    assert parallel_return(64, _days(res, 64), 512, _days(res, 512)) < 0.1
    # steps cannot fall below S_min, so the time floors at S_min × the fastest possible step
    pl = res.point(512, "auto").plan
    assert pl.training.steps >= min_steps(1e10, 4 * SEQ)
    assert res.stop_paying("auto").gpus < 512
    # at a batch many times B_crit, a larger one is held back by the critical batch
    assert pl.training.batch_reason.startswith("critical batch")


def test_chosen_batch_is_the_fastest_trial_and_reason_names_both_sides():
    prof = _gpt2_small()
    crit = 512 * SEQ

    def solve_at(b):
        return solve(prof, A100, gpus=32, global_batch_size=b, max_alternatives=0)
    pl = plan_for_tokens(solve_at, tokens=1e10, critical_batch_tokens=crit,
                         critical_batch_source="given", seq_len=SEQ, gpus=32)
    tr = pl.training
    ok = [t for t in tr.trials if t.train_time_s is not None]
    assert tr.train_time_s == min(t.train_time_s for t in ok)
    assert tr.batch_tokens == pl.global_batch_size * SEQ
    assert tr.steps == pytest.approx(steps_for_tokens(1e10, tr.batch_tokens, crit))
    assert tr.train_time_s == pytest.approx(tr.steps * pl.predicted.step_time_s)
    assert tr.gpu_hours == pytest.approx(tr.train_time_s * 32 / 3600)
    # the neighbours planned on both sides, and the reason says why each lost
    assert any(t.global_batch_size > pl.global_batch_size for t in tr.trials)
    assert any(t.global_batch_size < pl.global_batch_size for t in tr.trials)
    assert "pipeline fill" in tr.batch_reason
    assert "critical batch" in tr.batch_reason or "GPUs full" in tr.batch_reason
    # the plan, training estimate included, survives JSON
    assert Plan.from_json(pl.to_json()) == pl
    assert Plan.from_json(pl.to_json()).training.days == pytest.approx(tr.train_time_s / 86400)
    # a plan.json written before time to train existed (no "training" key) still loads
    old = pl.to_dict()
    del old["training"]
    assert Plan.from_dict(old).training is None


def test_pinned_batch_is_the_only_one_planned():
    prof = _gpt2_small()
    pl = plan_for_tokens(lambda b: solve(prof, A100, gpus=8, global_batch_size=b,
                                         max_alternatives=0),
                         tokens=1e10, critical_batch_tokens=1e6, critical_batch_source="given",
                         seq_len=SEQ, gpus=8, pinned_batch=64)
    assert pl.global_batch_size == 64 and len(pl.training.trials) == 1
    assert pl.training.batch_reason.startswith("pinned")


def test_no_plan_at_any_batch_is_one_error():
    def solve_at(b):
        raise ValueError(f"solve: nothing fits at {b}\nmore detail")
    with pytest.raises(ValueError, match=r"time to train: no global batch has a plan on 8 GPUs"):
        plan_for_tokens(solve_at, tokens=1e9, critical_batch_tokens=8 * SEQ,
                        critical_batch_source="given", seq_len=SEQ, gpus=8)


# ----- bad inputs: one-line errors ----------------------------------------------------------
@pytest.mark.parametrize("tokens,crit,match", [
    (0, None, r"tokens=0 must be a positive number"),
    (-5e9, None, r"tokens=-5000000000.0 must be a positive number"),
    (float("nan"), None, r"tokens=nan must be a positive number"),
    ("1e9", None, r"tokens='1e9' must be a positive number"),
    (1e9, 0, r"critical_batch_tokens=0 must be a positive number"),
    (1e9, 512, r"critical_batch_tokens=512 is smaller than one sequence \(1024 tokens\)"),
])
def test_bad_training_inputs_get_one_line_errors(tokens, crit, match):
    with pytest.raises(ValueError, match=match) as info:
        check_training_inputs(tokens, crit, SEQ, "parallelize")
    assert "\n" not in str(info.value)


def test_gpu_range():
    assert gpu_range(512, 8) == (8, 16, 32, 64, 128, 256, 512)
    assert gpu_range(3072, 1024) == (1024, 2048, 3072)
    assert gpu_range(64) == (1, 2, 4, 8, 16, 32, 64)
    with pytest.raises(ValueError, match="gpus_min=100 must be an integer in"):
        gpu_range(64, 100)
    assert math.isclose(parallel_return(8, 2.0, 16, 1.0), 1.0)


def test_gpus_stop_paying_only_when_they_do():
    """stop_paying is the last count before a step that returns < PAYING_EFFICIENCY of its
    ideal speed-up, and None when every step of the sweep still pays (the sweep's end is not
    the point where GPUs stop paying)."""
    from types import SimpleNamespace

    from autopar.scaling import ScaleResult

    def result(days):
        pts = [SimpleNamespace(gpus=g, days=d) for g, d in zip((8, 16, 32, 64), days)]
        return ScaleResult.stop_paying(SimpleNamespace(envelope=lambda family=None: pts))

    assert result([8.0, 4.0, 2.0, 1.0]) is None              # halves every doubling: pays
    assert result([8.0, 4.0, 3.9, 3.8]).gpus == 16           # 16 -> 32 barely helps
