"""The weight comparisons after AdamW (reference.weight_mismatches, used by check_trained,
check_training and state_mismatches) hold on any x86 CPU yet still catch a real error: one
element off by the ~2e-5 another CPU's summation order gives GPT-2's c_proj after 3 AdamW
steps (1.65e-5 on an AVX-512 host, 2.06e-5 under ATEN_CPU_CAPABILITY=default) passes; a learning rate 2% off, or one row off by as much, fails. One process,
single-device training only (no ranks spawned)."""
from __future__ import annotations

import pytest
import torch

from models import runtime_model
from programs import (LR, MAX_NORM, TRAINING_LR, check_trained, make_data, make_plan,
                      loss_fn)
from reference import state_mismatches, train, weight_mismatches

PLAN = make_plan()
INIT = runtime_model("gpt", PLAN.num_layers).state_dict()
_RUNS: dict = {}


def _trained(lr: float, weight_decay: float):
    """The tiny GPT after 3 AdamW steps (clipped at MAX_NORM) on make_data's batches."""
    if (lr, weight_decay) not in _RUNS:
        opt = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay)  # noqa: E731
        _RUNS[lr, weight_decay] = train(runtime_model("gpt", PLAN.num_layers),
                                        make_data(PLAN, 64), opt, loss_fn=loss_fn,
                                        max_grad_norm=MAX_NORM)
    return _RUNS[lr, weight_decay]


@pytest.mark.parametrize("lr, weight_decay", [(LR, 0.01), (TRAINING_LR, 0.1)])
def test_every_weight_comparison_fails_when_the_learning_rate_is_2_percent_off(lr,
                                                                               weight_decay):
    """check_against_reference's AdamW (lr LR) and check_training's (TRAINING_LR, decay
    0.1): the weights of a run at 1.02·lr fail every comparison."""
    ref, off = _trained(lr, weight_decay), _trained(lr * 1.02, weight_decay)
    assert weight_mismatches(ref.state, ref.state, INIT) == []
    assert weight_mismatches(off.state, ref.state, INIT) != []
    assert state_mismatches(off.state, ref.state, init=INIT) != []
    assert state_mismatches(off.state, ref.state) != []
    # check_trained given the reference's own losses: the weights alone must fail it
    with pytest.raises(AssertionError, match="weights differ"):
        check_trained([(ref.losses, off.state, 0)], ref, INIT)


def test_one_element_of_adam_rounding_passes_a_row_off_fails():
    ref = _trained(LR, 0.01)
    key = "transformer.h.0.attn.c_proj.weight"
    check_trained([(ref.losses, ref.state, 0)], ref, INIT)
    one = dict(ref.state, **{key: ref.state[key].clone()})
    one[key][11, 15] += 2.1e-5          # what another CPU's summation order gives (see above)
    assert weight_mismatches(one, ref.state, INIT) == []
    row = dict(ref.state, **{key: ref.state[key].clone()})
    row[key][11] += 2.1e-5              # a real error: a whole row off by as much
    assert weight_mismatches(row, ref.state, INIT) != []
