"""Runner.eval_loss (launch.py --eval-data): the schedule's forwards alone under no_grad
(PipelineExecutor.run_forward) give the single device's loss on the batch and leave the training
untouched: eval, one AdamW step (lr 1e-3), eval again, under a tensor-split interleaved pipeline (t = 2,
p = 2, v = 2), a zero-bubble schedule (its W actions dropped) and ZeRO-3 (the forward-and-
backward fallback), each against one device (losses at rtol 1e-4 / atol 1e-5; the trained
weights by check_trained). One spawn of 4 ranks runs the cases in turn."""
from __future__ import annotations


import pytest
import torch

from models import runtime_model
from programs import (MAX_NORM, adamw_decayed, check_trained, loss_fn, make_data, make_plan,
                      make_program, spawn_cases, train_single_device, with_zero)

pytestmark = pytest.mark.distributed

NAME = "gpt"


def _rank(rank: int, world: int, plan) -> tuple:
    torch.set_num_threads(1)
    prog, vocab = make_program(NAME, plan)
    runner = prog.compile(optimizer=adamw_decayed, max_grad_norm=MAX_NORM, timeout_s=60)
    x0, y0 = make_data(plan, vocab)[0]
    share = plan.global_batch_size // plan.d
    lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
    runner.record_timeline(True)
    before = runner.eval_loss(x0[lo:hi], y0[lo:hi])
    kinds = {a.rstrip("0123456789.") for _, a, _, _ in runner.timeline}
    runner.record_timeline(False)
    loss = runner.train_step(x0[lo:hi], y0[lo:hi])
    after = [runner.eval_loss(x0[lo:hi], y0[lo:hi]) for _ in range(2)]
    return [loss], runner.full_state_dict(), (before, *after), kinds


CASES = {
    "t2 p2 interleaved-1f1b": make_plan(t=2, p=2, v=2, m=4, layers=4,
                                        schedule="interleaved-1f1b"),
    "p2 interleaved-zb d2": make_plan(p=2, v=2, d=2, m=4, layers=4, schedule="interleaved-zb"),
    "zero3 p2 d2": with_zero(make_plan(p=2, d=2, m=2), 3),
}


def _reference(plan) -> tuple[float, float, object]:
    """The single device's loss on batch 0, then after one step on it, and that step."""
    data = make_data(plan, 64)[:1]
    model = runtime_model(NAME, plan.num_layers)
    with torch.no_grad():
        before = float(loss_fn(model(data[0][0]), data[0][1]))
    ref = train_single_device(NAME, plan, adamw_decayed, batches=data,
                             max_grad_norm=MAX_NORM)
    model.load_state_dict(ref.state)
    with torch.no_grad():
        after = float(loss_fn(model(data[0][0]), data[0][1]))
    return before, after, ref


def test_eval_loss_is_the_forward_alone_and_leaves_training_untouched():
    results = spawn_cases(_rank, 4, {k: ((plan,), {}) for k, plan in CASES.items()})
    for label, plan in CASES.items():
        before, after, ref = _reference(plan)
        init = runtime_model(NAME, plan.num_layers).state_dict()
        check_trained([r[:2] for r in results[label]], ref, init)
        for rank, (_, _, evals, kinds) in enumerate(results[label]):
            backward = {k for k in kinds if k[0] in "BW" or k.endswith("_B")}
            assert bool(backward) == (plan.zero >= 2), (label, rank, sorted(kinds))
            got = torch.tensor(evals, dtype=torch.float64)
            want = torch.tensor([before, after, after], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{label}, rank {rank}: eval losses {m}")
        # the step moved the loss past twice the comparison's tolerance: the check can fail
        assert abs(before - after) > 2 * (1e-4 * abs(after) + 1e-5), (before, after)
