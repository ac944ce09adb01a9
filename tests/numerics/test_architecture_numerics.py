"""Whole programs (compile() and the Runner on gloo ranks) of architectures beyond the dense
decoder-only LMs (issue 17): mixture-of-experts (transformers' Mixtral and OLMoE, experts as
3-D parameters) and a vision model without a vocabulary (ViT: pixels in, class labels out),
at t = 2 and at p = 2, against the same model trained on one device (3 AdamW steps, losses
and full_state_dict at rtol 1e-4 / atol 1e-5)."""
from __future__ import annotations

import pytest
import torch

from autopar.api import ParallelProgram
from autopar.testing import spawn

import models
from programs import MAX_NORM, STEPS, adamw, check_trained, loss_fn, make_plan, train_steps
from reference import train

pytestmark = pytest.mark.distributed

SEQ, LABELS = 8, 10


def _model(name: str) -> torch.nn.Module:
    return models.build(name, seed=0)


def _data(name: str, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches: token ids and next tokens, or pixels and class labels (ViT)."""
    if name != "hf_vit":
        return models.token_batches(64, (batch, SEQ), STEPS, seed=1234)
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(batch, 3, 16, 16, generator=g),
             torch.randint(0, LABELS, (batch,), generator=g)) for _ in range(STEPS)]


def _loss(name: str):
    return models.classification_loss if name == "hf_vit" else loss_fn


def _rank(rank: int, world: int, name: str, plan) -> tuple:
    torch.set_num_threads(1)
    model = _model(name)
    x, y = _data(name, plan.micro_batch_size)[0]
    prog = ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(x,),
                           loss_fn=_loss(name), example_targets=y, cluster=None)
    runner = prog.compile(optimizer=adamw, max_grad_norm=MAX_NORM, timeout_s=60)
    local = sum(p.numel() for p in runner.parameters())
    losses = train_steps(runner, plan, _data(name, plan.global_batch_size))
    return losses, runner.full_state_dict(), local


def _check(name: str, plan) -> list:
    results = spawn(_rank, plan.gpus, name, plan, timeout_s=300)
    ref = train(_model(name), _data(name, plan.global_batch_size), adamw, loss_fn=_loss(name),
                max_grad_norm=MAX_NORM)
    check_trained(results, ref, _model(name).state_dict())
    return results


@pytest.mark.parametrize("name", ["hf_mixtral", "hf_olmoe", "hf_vit"])
def test_tp2_program_splits_and_matches_single_device(name):
    """t = 2: rank 0 holds at most 75% of the weights (the experts split, not replicated)."""
    results = _check(name, make_plan(t=2))
    total = sum(p.numel() for p in _model(name).parameters())
    assert results[0][2] <= 0.75 * total, (results[0][2], total)


@pytest.mark.parametrize("name", ["hf_mixtral", "hf_olmoe", "hf_vit"])
def test_pp2_program_matches_single_device(name):
    """p = 2: routing inside each stage; pixels flow into the first stage only."""
    _check(name, make_plan(p=2))
