"""The weight comparisons after AdamW (reference.weight_mismatches, used by check_trained,
check_training and state_mismatches) hold on any x86 CPU yet still catch a real error: one
element off by the ~2e-5 another CPU's summation order gives GPT-2's c_proj after 3 AdamW
steps (1.65e-5 on an AVX-512 host, 2.06e-5 under ATEN_CPU_CAPABILITY=default) passes; a
learning rate 2% off, or one row off by as much, fails. In bf16 the elementwise check (atol
3e-3: an AdamW step moves every master by ~lr whatever the rounding) cannot see a 2% learning
rate; the median tensor's update error can where no matmul is split (noise 0.3 - 0.8%, a 2%
learning rate 2.1%, the bound 1.4%), and the update scale can at every plan (noise within
0.2% of 1, a 2% learning rate 2.0% off, the bound 0.5%). One process, single-device training only (no ranks spawned)."""
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


def _trained_bf16(name: str, lr_scale: float = 1.0, perturb_seed: int | None = None):
    """name's tiny model after 3 bf16 AdamW steps (check_training's optimizer); its masters
    perturbed by a relative 1e-6 first when perturb_seed is given: bf16 rounding then falls
    elsewhere, as another summation order makes it fall (the split runs' noise)."""
    model = runtime_model(name, PLAN.num_layers)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    if perturb_seed is not None:
        g = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=g))
    opt = lambda ps: torch.optim.AdamW(ps, lr=TRAINING_LR * lr_scale,  # noqa: E731
                                       weight_decay=0.1)
    return init, train(model, make_data(PLAN, 64), opt, loss_fn=loss_fn, precision="bf16")


@pytest.mark.parametrize("name", ["gpt", "llama_style"])
def test_bf16_comparison_passes_rounding_noise_and_fails_a_2_percent_learning_rate(name):
    """check_training's bf16 weight check (atol BF16_WEIGHT_ATOL: an AdamW step moves every
    master by ~lr whatever the rounding) sees a learning rate 2% off through the median
    tensor's update error; bf16 rounding noise passes it."""
    from programs import (BF16_MEDIAN_UPDATE_RTOL, BF16_UPDATE_RTOL, BF16_UPDATE_SCALE_RTOL,
                          BF16_WEIGHT_ATOL)
    from reference import assert_weights_match, median_update_error, update_scale
    tol = dict(rtol=0, atol=BF16_WEIGHT_ATOL, update_rtol=BF16_UPDATE_RTOL,
               median_update_rtol=BF16_MEDIAN_UPDATE_RTOL)
    init, ref = _trained_bf16(name)
    _, noisy = _trained_bf16(name, perturb_seed=3)
    _, off = _trained_bf16(name, lr_scale=1.02)
    # the noise stays well inside the bound (its key bias, a zero true gradient, is far off:
    # the elementwise check's outlier rule, not this one, is what bounds such a tensor)
    assert median_update_error(noisy.state, ref.state, init) < BF16_MEDIAN_UPDATE_RTOL / 1.5
    assert_weights_match(ref.state, ref.state, init, **tol)
    assert weight_mismatches(off.state, ref.state, init, rtol=0, atol=BF16_WEIGHT_ATOL,
                             update_rtol=BF16_UPDATE_RTOL) == []   # the elementwise check alone
    with pytest.raises(AssertionError, match="median tensor's update"):
        assert_weights_match(off.state, ref.state, init, **tol)
    # the update scale, checked at every plan (t = 2 too, where the median is as noisy as a 2%
    # learning rate): noise leaves it at 1, the learning rate moves it 2%, fast or slow
    assert abs(update_scale(noisy.state, ref.state, init) - 1) < BF16_UPDATE_SCALE_RTOL / 2
    _, slow = _trained_bf16(name, lr_scale=0.98)
    for bad in (off, slow):
        with pytest.raises(AssertionError, match="update scale"):
            assert_weights_match(bad.state, ref.state, init, rtol=0, atol=BF16_WEIGHT_ATOL,
                                 update_rtol=BF16_UPDATE_RTOL,
                                 update_scale_rtol=BF16_UPDATE_SCALE_RTOL)
