"""The router's load-balancing loss (issue 32 item 3): transformers' Mixtral and GPT-OSS
(biased experts: each row's gathered bias is dispatched with it, passes/expert_parallel.py)
built with output_router_logits=True return `aux_loss`; autopar.cross_entropy adds
router_aux_loss_coef · aux_loss (bound from the model's config where autopar captures model and
loss), and the parallel run trains with the same loss as one device (3 AdamW steps with
clipping, losses and full_state_dict at rtol 1e-4 / atol 1e-5). The loss's token fractions are
a nonlinear function of the micro-batch's routing, so at d = 2 with ep = 2 each rank's counts
are averaged over the data group (passes/router_stats.py); at t = 2 every tensor rank routes
the whole micro-batch (without the averaging the ep = 2 × d = 2 losses are 7e-4 off, 7× the
tolerance: checked once). One micro-batch per step (m = 1): the statistics are per
micro-batch.
The coefficient is raised to 4 so the router loss moves the weights well past the tolerance
(the reference without it differs: checked below)."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from autopar.api import ParallelProgram
from autopar.losses import cross_entropy
from autopar.testing import spawn

import models
from programs import MAX_NORM, STEPS, adamw, check_trained, make_plan, train_steps
from reference import train, weight_mismatches

pytestmark = pytest.mark.distributed

SEQ, COEF = 8, 4.0


def _model(name: str):
    return models.build(name, seed=0, output_router_logits=True, router_aux_loss_coef=COEF)


def _data(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return models.token_batches(64, (batch, SEQ), STEPS, seed=1234)


def _rank(rank: int, world: int, name: str, plan) -> tuple:
    torch.set_num_threads(1)
    x, y = _data(plan.micro_batch_size)[0]
    prog = ParallelProgram(model=_model(name), plan=plan, profile=None, example_inputs=(x,),
                           loss_fn=cross_entropy, example_targets=y, cluster=None)
    runner = prog.compile(optimizer=adamw, max_grad_norm=MAX_NORM, timeout_s=60)
    return train_steps(runner, plan, _data(plan.global_batch_size)), runner.full_state_dict()


# one model per mode (the suite's time budget); verified once beyond these, not kept: p = 2
# (m = 2) against one device accumulating the two micro-batches' losses. c2ep2: each context
# rank counts and sums over its own tokens, both summed over the 2 context ranks (context_sum)
@pytest.mark.parametrize("name, mode", [("hf_mixtral", "t2"), ("hf_gpt_oss", "ep2d2"),
                                        ("hf_mixtral", "c2ep2")])
def test_router_loss_trains_as_on_one_device(name, mode):
    plan = {"t2": make_plan(t=2, b=4, m=1),
            "ep2d2": dataclasses.replace(make_plan(d=2, b=2, m=1), ep=2),
            "c2ep2": dataclasses.replace(make_plan(b=2, m=1), c=2, ep=2)}[mode]
    results = spawn(_rank, plan.gpus, name, plan, timeout_s=300)
    data = _data(plan.global_batch_size)
    ref = train(_model(name), data, adamw, max_grad_norm=MAX_NORM,
                loss_fn=functools.partial(cross_entropy, aux_loss_coef=COEF))
    init = _model(name).state_dict()
    check_trained(results, ref, init)
    without = train(_model(name), data, adamw, max_grad_norm=MAX_NORM,
                    loss_fn=lambda out, y: cross_entropy(out.logits, y))
    assert weight_mismatches(results[0][1], without.state, init)   # the router loss counted
