"""The single-device reference every numerics test compares with: one training loop, and the
comparison of a parallel run's weights with its result.

    ref = train(model, batches, optimizer, loss_fn=cross_entropy, max_grad_norm=1.0)
    ref.losses, ref.state            # per-step losses, the weights after the last step

Per (inputs, targets) batch, one textbook step: zero_grad (set to None), forward, loss,
backward, optional global-norm clipping, optimizer step. Tests whose reference is not a
training loop (gradients of one backward, a clipped gradient, a hand-written bf16 loop) keep
their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from models import token_batches

Batch = tuple[torch.Tensor, torch.Tensor]
State = dict[str, torch.Tensor]


@dataclass
class Trained:
    """What `train` leaves: the trained model and optimizer, the loss of every step, the state
    dict after the last step (and after every step with keep_states), and the gradient norms
    before clipping (with max_grad_norm). States are detached copies; under bf16 the
    parameters in them are the fp32 masters."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float]
    state: State
    states: list[State] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)   # fp16: the scale after each step
    init: State = field(default_factory=dict)   # the state before the first step


def train(model: torch.nn.Module, batches: Iterable[Batch],
          optimizer: Callable[[list], torch.optim.Optimizer], *,
          loss_fn: Callable | None = None, max_grad_norm: float | None = None,
          precision: str = "fp32", seed: int | None = None,
          keep_states: bool = False, loss_scaling=None) -> Trained:
    """Train `model` on one process, one optimizer step per batch.

    optimizer: a factory params -> Optimizer (the one the parallel run uses). loss_fn(output,
    targets); None: the model computes its loss, model(inputs, targets) (a captured graph
    with its loss). max_grad_norm: clip_grad_norm_ over the stepped parameters after each
    backward. precision "bf16": bf16 compute on fp32 masters through the runtime's
    MixedPrecision, as the Runner does (the loss on fp32 logits); "fp16": the same in fp16
    with torch.amp.GradScaler (loss_scaling: an autopar LossScaling for its knobs). seed: torch.manual_seed right before the first step
    (the RNG stream dropout draws from).
    """
    mp = scaler = None
    if precision in ("bf16", "fp16"):
        from autopar.runtime.loss_scale import LossScaling
        from autopar.runtime.precision import MixedPrecision
        low = torch.bfloat16 if precision == "bf16" else torch.float16
        mp = MixedPrecision(list(model.parameters()), compute_dtype=low)
        if precision == "fp16":
            c = loss_scaling or LossScaling()
            scaler = torch.amp.GradScaler("cpu", init_scale=c.init_scale,
                                          growth_factor=c.growth_factor,
                                          backoff_factor=c.backoff_factor,
                                          growth_interval=c.growth_interval)
    elif precision != "fp32":
        raise ValueError(f"train: precision={precision!r}; use 'fp32', 'bf16' or 'fp16'")
    stepped = mp.master_params if mp else list(model.parameters())
    opt = optimizer(stepped)
    scales = []
    if seed is not None:
        torch.manual_seed(seed)
    losses, states, norms = [], [], []
    init = _state(model, mp)
    for x, y in batches:
        if mp is None:  # (mp.step zeroes main_grad; opt.zero_grad would unlink the masters' grads)
            opt.zero_grad(set_to_none=True)
        if loss_fn is None:
            loss = model(x, y)
        else:  # under bf16 the loss reads fp32 logits, as the Runner's (passes/loss_precision.py)
            out = model(*x) if isinstance(x, tuple) else model(x)   # several inputs: a tuple
            loss = loss_fn(_fp32_logits(out) if mp else out, y)
        if scaler is not None:   # GradScaler: scaled backward, unscale, skip on inf/nan
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(stepped, max_grad_norm)))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            mp.to_compute()
            mp.zero_grad()
        elif mp:
            mp.step(opt)
        else:
            opt.step()
        losses.append(loss.item())
        if keep_states:
            states.append(_state(model, mp))
    return Trained(model, opt, losses, _state(model, mp), states, norms, scales, init)


def _fp32_logits(out):
    """The model's output with its logits in fp32: a floating tensor, or a transformers
    ModelOutput's `.logits` (its setattr updates the mapping too)."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        out.logits = out.logits.float()
    return out


def _state(model: torch.nn.Module, mp) -> State:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if mp:  # the fp32 masters are the weights (the Runner's full_state_dict returns them too)
        by_id = {id(p): m for p, m in zip(mp.params, mp.master_params)}
        for k, v in model.state_dict(keep_vars=True).items():
            if id(v) in by_id:
                state[k] = by_id[id(v)].detach().clone()
    return state


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (Adam's m, v and step)."""
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def state_mismatches(got: State, want: State, *, exact: bool = False,
                     init: State | None = None) -> list[str]:
    """What differs between a gathered state dict and the reference's: missing keys, shapes,
    values beyond rtol 1e-4 / atol 1e-5 (exact: any difference; given the weights before
    training, `init`, compared as weight_mismatches does). Empty when they agree."""
    bad = []
    for key, ref in want.items():
        if key not in got:
            bad.append(f"missing {key}")
            continue
        value = got[key]
        if value.shape != ref.shape:
            bad.append(f"{key}: shape {tuple(value.shape)} != {tuple(ref.shape)}")
        elif exact and not torch.equal(value, ref):
            bad.append(f"{key}: not equal, max diff {(value - ref).abs().max().item():.3g}")
        elif not exact and init is not None and key in init:
            bad += weight_mismatches({key: value}, {key: ref}, init)
        elif not exact and not torch.allclose(value, ref, rtol=1e-4, atol=1e-5):
            bad.append(f"{key}: max diff {(value - ref).abs().max().item():.3g}")
    return bad


# AdamW divides each gradient by its own running RMS: where the true gradient is ~0 (a
# softmax-invariant bias, a near-dead unit), fp32 rounding noise — which differs with the
# summation order, and so with the CPU's vector width (AVX2 vs AVX-512) — becomes a step of
# up to lr of either sign, so one element may land 1e-5 off while every other agrees to 1e-7.
# A tensor then passes when at most OUTLIERS_PER of its elements (at least 1) are outside the
# elementwise tolerance, each by no more than twice the largest step the reference took on
# that tensor (the noise can flip the sign of an element's whole update: +s in one run, −s in
# the other), AND its update agrees in norm over the other elements: |Δgot − Δref|₂ ≤ UPDATE_RTOL
# · |Δref|₂ (Δ = weights − init, both over the elements inside the tolerance: in bf16 one
# amplified element can carry several % of a sparse tensor's update norm by itself, as on an
# AMD EPYC host: the embedding of hf_llama at t=2). A learning rate 2% off shifts every update by 2% (4× UPDATE_RTOL) and fails, as
# test_weight_comparisons checks; a sharding error shifts rows or blocks, far beyond it.
OUTLIERS_PER = 1000
UPDATE_RTOL = 5e-3


def weight_mismatches(got: State, want: State, init: State, *, rtol: float = 1e-4,
                      atol: float = 1e-5, update_rtol: float = UPDATE_RTOL) -> list[str]:
    """The weights after training (`got`) against the reference's (`want`), both trained from
    `init`: elementwise at rtol / atol, robust to AdamW's amplified rounding (see above). One
    line per tensor that differs; empty when all agree."""
    bad = []
    for key, ref in want.items():
        value = got[key].float()
        ref = ref.float()
        close = torch.isclose(value, ref, rtol=rtol, atol=atol)
        if bool(close.all()):
            continue
        diff = (value - ref).abs()
        if key in init:
            step_ref = ref - init[key].float()
            outliers = int((~close).sum())
            # the update's agreement is measured over the elements inside the elementwise
            # tolerance: the few outliers are bounded on their own (count, size), and a
            # systematic error (a learning rate 2% off) moves every other element with them
            update_err = ((value - ref)[close].norm()
                          / step_ref[close].norm().clamp_min(1e-30)).item()
            if (outliers <= max(1, ref.numel() // OUTLIERS_PER)
                    and diff.max() <= 2 * step_ref.abs().max() and update_err <= update_rtol):
                continue
            bad.append(f"{key}: {outliers} of {ref.numel()} values beyond rtol {rtol:g} / atol "
                       f"{atol:g}, max diff {diff.max().item():.3g}, update off by "
                       f"{update_err:.2%} (Adam rounding allows {update_rtol:.1%})")
        else:
            bad.append(f"{key}: max diff {diff.max().item():.3g}")
    return bad


def median_update_error(got: State, want: State, init: State) -> float:
    """The median over tensors of |Δgot − Δref|₂ / |Δref|₂ (Δ = weights − init; tensors the
    reference moved). bf16's elementwise tolerance (an AdamW step of lr moves every master by
    about lr, whatever the gradient's rounding) cannot see a learning rate 2% off; this can:
    a 2% error puts every tensor's update 2% off, while bf16 rounding noise leaves most tensors
    within ~0.8% (a few, such as a softmax-invariant key bias, far off: the median ignores
    them). tests/numerics/test_weight_comparisons.py measures both."""
    errs = []
    for key, ref in want.items():
        if key not in init:
            continue
        step = ref.float() - init[key].float()
        if float(step.norm()) > 0:
            errs.append(float((got[key].float() - ref.float()).norm() / step.norm()))
    return float(torch.tensor(errs).median()) if errs else 0.0


def update_scale(got: State, want: State, init: State) -> float:
    """The least-squares slope of every element's update on the reference's, over all tensors
    (Σ ⟨Δgot, Δref⟩ / Σ |Δref|², Δ = weights − init). A learning rate off by a factor scales
    every update (weight decay's included) by it; rounding noise, uncorrelated with the
    update, leaves the slope at 1 — even where each tensor's update is noisy: bf16 at t = 2
    (row-parallel partial sums rounded before their all-reduce, the median tensor's update
    1.8 - 2.9% off) keeps it within 0.15% of 1, while a learning rate 2% off moves it 2.0%
    (measured on test_mixed_precision's bf16 plans and test_weight_comparisons' runs)."""
    num = den = 0.0
    for key, ref in want.items():
        if key in init:
            r = (ref.float() - init[key].float()).reshape(-1)
            num += float((got[key].float() - init[key].float()).reshape(-1) @ r)
            den += float(r @ r)
    return num / den if den else 1.0


def assert_weights_match(got: State, want: State, init: State, *,
                         median_update_rtol: float | None = None,
                         update_scale_rtol: float | None = None, **tol: float) -> None:
    """weight_mismatches is empty (keys and their order equal too), and, when given (bf16),
    median_update_error is within median_update_rtol and update_scale within
    update_scale_rtol of 1; else an AssertionError listing every tensor that differs."""
    assert list(got) == list(want), (list(got), list(want))
    bad = weight_mismatches(got, want, init, **tol)
    if update_scale_rtol is not None:
        scale = update_scale(got, want, init)
        if abs(scale - 1) > update_scale_rtol:
            bad.append(f"the updates are {scale:.4f}× the reference's (update scale; bf16 noise "
                       f"stays within {update_scale_rtol:.1%} of 1): a learning-rate-like "
                       f"systematic error")
    if median_update_rtol is not None:
        err = median_update_error(got, want, init)
        if err > median_update_rtol:
            bad.append(f"the median tensor's update is {err:.2%} off the reference's (bf16 "
                       f"noise stays within {median_update_rtol:.1%}): a systematic error")
    assert not bad, "weights differ from the single-device run:\n" + "\n".join(bad)


# ---- the tensor-parallel tests' training (test_tp_numerics, test_tp_meta) -----------------
TP_STEPS, TP_BATCH, TP_SEQ = 3, 2, 8


def tp_batches(vocab: int = 64) -> list[Batch]:
    """TP_STEPS batches of TP_BATCH × TP_SEQ random tokens (seed 99)."""
    return token_batches(vocab, (TP_BATCH, TP_SEQ), TP_STEPS, seed=99)


def tp_adamw(params: list) -> torch.optim.Optimizer:
    # lr 1e-3: a wrong gradient still moves a weight by ~1e-3, 100x the tolerance, while Adam
    # cannot amplify fp32 reduction-order noise past atol. eps=1e-6: the key bias of attention
    # has an analytically zero gradient (softmax is shift-invariant), so with the default eps
    # Adam's update of it is normalised rounding noise (±lr, sign-random) in both runs alike;
    # 1e-6 keeps noise-level gradients from moving it.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def tp_train(model: torch.nn.Module, batches: list[Batch] | None = None,
             loss_fn: Callable | None = None) -> list[float]:
    """The losses of `train` with tp_adamw on `batches` (default tp_batches()); both runs
    start the default RNG stream alike (seed 4321): dropout in replicated regions (and on
    partial sums) then draws the single device's masks."""
    return train(model, tp_batches() if batches is None else batches, tp_adamw,
                 loss_fn=loss_fn, seed=4321).losses
