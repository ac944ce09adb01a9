"""Every plan checkpoints: each ZeRO level × schedule family the solver can return saves, loads
(weights and Adam state, resharded from the previous ZeRO level's layout) and loads weights
only, and training goes on with the losses of an uninterrupted single-device run.

One spawn of 4 gloo ranks (p = 2, d = 2) per schedule; inside it the ZeRO levels run in turn,
each compiling its program, so the rank start-up is paid once per schedule:

  zero 0: steps 0 from the initial weights; save (step 1)          — save under zero 0
  zero z: load zero z−1's checkpoint; save it again under zero z   — reshard z−1 → z
  every z: step 1 (≈ the reference); load its own checkpoint back; step 1 again (the same loss,
           bit for bit: weights, Adam's m, v and step, and the step count all restored);
           load weights only (the saved weights, the step count and optimizer left as they
           are).
Sharded weights (zero 2, 3) are not gathered for a split backward's deferred W halves
(autopar/rules.py zero_refusal, which the Plan applies): interleaved-zb runs zero 0 and 1
only, as the solver.
"""
from __future__ import annotations

import pytest
import torch

from autopar.compile import check_program
from autopar.schedules import SCHEDULE_NAMES
from autopar.testing import spawn

from reference import weight_mismatches
from programs import (adamw, make_data, make_plan, make_program, train_single_device,
                      train_steps, with_zero)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _plans(schedule: str) -> list:
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    base = make_plan(p=2, d=2, v=v, b=1, m=2, schedule=schedule, layers=4)  # global batch 4
    plans = []
    for zero in (0, 1, 2, 3):
        try:
            plan = with_zero(base, zero)    # the Plan refuses what the runtime cannot run
            check_program(plan)
        except ValueError:          # a combination the runtime (and so the solver) excludes
            continue
        plans.append(plan)
    return plans


def _levels(rank, world, plans, tmp):
    out = []
    for k, plan in enumerate(plans):
        prog, vocab = make_program("gpt", plan)
        batches = make_data(plan, vocab)
        runner = prog.compile(optimizer=adamw, timeout_s=60)
        path = f"{tmp}/zero{plan.zero}"
        if k == 0:
            first = train_steps(runner, plan, batches[:1])
        else:
            first = runner.load_checkpoint(f"{tmp}/zero{plans[k - 1].zero}")
        saved = runner.full_state_dict()
        runner.save_checkpoint(path)
        step1 = train_steps(runner, plan, batches[1:2])
        after = runner.full_state_dict()
        loaded = runner.load_checkpoint(path)
        again = train_steps(runner, plan, batches[1:2])
        same = all(torch.equal(after[key], x) for key, x in runner.full_state_dict().items())
        steps_before = runner.steps
        runner.load_checkpoint(path, weights_only=True)
        weights_only = (runner.steps == steps_before and
                        all(torch.equal(saved[key], x)
                            for key, x in runner.full_state_dict().items()))
        out.append(dict(zero=plan.zero, first=first, step1=step1, loaded=loaded, again=again,
                        same=same, weights_only=weights_only,
                        after=after if rank == 0 else None))
    return out


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_every_zero_level_saves_loads_and_reshards(tmp_path, schedule):
    plans = _plans(schedule)
    assert [p.zero for p in plans] == ([0, 1] if schedule == "interleaved-zb" else [0, 1, 2, 3])
    ref = train_single_device("gpt", plans[0], adamw, keep_states=True)
    results = spawn(_levels, 4, plans, str(tmp_path), timeout_s=500)
    for rank, levels in enumerate(results):
        for k, r in enumerate(levels):
            where = f"{schedule} zero={r['zero']} rank {rank}"
            if k == 0:
                torch.testing.assert_close(r["first"], ref.losses[:1], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{where} step 0: {m}")
            else:
                assert r["first"] == 1, where          # the step of the previous level's save
            torch.testing.assert_close(r["step1"], ref.losses[1:2], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{where} step 1 after the load: {m}")
            assert r["loaded"] == 1 and r["again"] == r["step1"], where
            assert r["same"] and r["weights_only"], where
    for r in results[0]:
        # Adam on ~0 gradients: reference.weight_mismatches (tests/README.md)
        bad = weight_mismatches(r["after"], ref.states[1], ref.init)
        assert not bad, (schedule, r["zero"], bad)
