"""Compiled chunks (issue 28 item 3): `prog.compile(..., torch_compile=True)` trains like eager.

One run on 2 gloo ranks at t=2 (the tiniest GPT: torch.compile with Inductor on CPU
takes seconds per graph, and every collective is a graph break, so this is the one compiled
numerics test): 3 AdamW steps equal the single-device model (rtol 1e-4 / atol 1e-5), Dynamo
compiled something during the first step and nothing after it (compile work cached across
steps: no recompiles).
"""
from __future__ import annotations

import pytest

from autopar.testing import spawn

from programs import (MAX_NORM, adamw, check_trained, make_data, make_plan, make_program,
                      train_single_device)
from models import runtime_model

pytestmark = pytest.mark.distributed


def _compiled_rank(rank: int, world: int, plan) -> tuple:
    import os
    import torch
    from autopar.runtime.compiled import compile_counts
    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")   # 2 ranks on 2 cores
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=adamw, max_grad_norm=MAX_NORM, timeout_s=300,
                          torch_compile=True)
    losses, counts = [], []
    for x, y in make_data(plan, vocab):
        losses.append(runner.train_step(x, y))
        counts.append(compile_counts())
    return losses, runner.full_state_dict(), counts


def test_compiled_t2_equals_one_device_and_compiles_once():
    plan = make_plan(t=2, layers=2)
    results = spawn(_compiled_rank, plan.gpus, plan, timeout_s=900)
    ref = train_single_device("gpt", plan, max_grad_norm=MAX_NORM)
    check_trained(results, ref, runtime_model("gpt", plan.num_layers).state_dict())
    for r, (_, _, counts) in enumerate(results):
        assert counts[0]["frames"] > 0, f"rank {r}: nothing was compiled: {counts}"
        assert counts[0]["breaks"] > 0, f"rank {r}: no graph break at the collectives: {counts}"
        assert counts[1:] == counts[:1] * (len(counts) - 1), \
            f"rank {r}: recompiled after the first step: {counts}"
