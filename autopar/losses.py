"""Loss functions with the `loss_fn(model_output, targets) -> scalar mean loss` contract.

The router's load-balancing loss: a `transformers` mixture-of-experts model built with
`output_router_logits=True` returns `aux_loss` (Switch Transformer's E·Σ_e f_e·P_e over the
forward's tokens) next to its logits and, given labels, adds `router_aux_loss_coef · aux_loss`
to its own loss. `cross_entropy` adds the same term when the output carries one, so a model
trained through autopar trains with its load-balancing loss: the coefficient is the model's
(`bind_aux_loss`, applied where autopar captures model and loss together), or the caller's
`aux_loss_coef=`. Under data parallelism the token fractions f_e are those of all the ranks
that split the micro-batch (passes/router_stats.py), as on one device with the micro-batch
b·c·d; the statistics are per micro-batch (as transformers' own loss under gradient
accumulation), so plans with m > 1 micro-batches train with the mean of the micro-batches'
load-balancing losses.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F


def cross_entropy(output: Any, targets: torch.Tensor, ignore_index: int = -100, *,
                  aux_loss_coef: float | None = None) -> torch.Tensor:
    """Mean token cross-entropy of logits (..., V) against targets (...), plus
    `aux_loss_coef · output.aux_loss` when the output carries a router load-balancing loss.

    Accepts a logits tensor or any model output with a `.logits` attribute (the `transformers`
    convention), so unmodified Hugging Face models need no wrapper. aux_loss_coef: the
    model's `config.router_aux_loss_coef` (autopar binds it when it captures the model with
    this loss, `bind_aux_loss`); called directly on an output with an aux loss and no
    coefficient, it raises rather than silently train without it.
    """
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"cross_entropy: model output is a {type(output).__name__} without a "
                         f"tensor `.logits`; pass a loss_fn that picks the logits out of it")
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index)
    aux = getattr(output, "aux_loss", None)
    if not isinstance(aux, torch.Tensor):
        return loss
    if aux_loss_coef is None:
        raise ValueError("cross_entropy: the model output carries a router aux_loss but no "
                         "aux_loss_coef was given; pass aux_loss_coef=model.config."
                         "router_aux_loss_coef (autopar.losses.bind_aux_loss(model, loss_fn) "
                         "does it), or build the model with output_router_logits=False")
    return loss + aux_loss_coef * aux.to(loss.dtype)


def bind_aux_loss(model: torch.nn.Module, loss_fn: Callable | None) -> Callable | None:
    """`cross_entropy` with the model's router load-balancing coefficient bound when the model
    returns a router loss (a `transformers` config with `output_router_logits` set and a
    `router_aux_loss_coef`); any other loss_fn, or a model without one, unchanged."""
    config = getattr(model, "config", None)
    if loss_fn is not cross_entropy or not getattr(config, "output_router_logits", False):
        return loss_fn
    coef = getattr(config, "router_aux_loss_coef", None)
    if coef is None:
        return loss_fn
    return functools.partial(cross_entropy, aux_loss_coef=float(coef))
