"""The schedule executor's receive modes on 2 gloo ranks: pre-posted irecvs (the default, any
prefetch window) and blocking receives run the same action lists to bit-identical losses and
gradients; the recorded timeline puts each receive's wait outside the computes, once per RECV."""
from __future__ import annotations

import pytest
import torch

from autopar.testing import spawn

from programs import make_data, make_plan, make_program

pytestmark = pytest.mark.distributed

MODES = [("blocking", False, None), ("irecv-all", True, None), ("irecv-0", True, 0),
         ("irecv-2", True, 2)]


def _modes_rank(rank, world, plan):
    prog, vocab = make_program("gpt", plan)
    # lr 0: every mode starts from the same weights; gradients stay in .grad after the step
    runner = prog.compile(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), timeout_s=60)
    x, y = make_data(plan, vocab)[0]
    out = {}
    for name, async_recv, prefetch in MODES:
        ex = runner.executor
        ex.async_recv, ex.prefetch = async_recv, prefetch
        runner.record_timeline(True)
        losses = [runner.train_step(x, y) for _ in range(2)]   # 2nd step reuses the buffers
        grads = {k: p.grad.clone() for k, p in runner.named_parameters()}
        out[name] = (losses, grads, runner.timeline, [str(a) for a in ex.actions])
    return out


@pytest.mark.parametrize("schedule,v,m", [("interleaved-1f1b", 2, 3), ("1f1b", 1, 2)])
def test_receive_modes_are_bit_identical_and_waits_are_recorded(schedule, v, m):
    plan = make_plan(p=2, v=v, m=m, schedule=schedule, layers=2 * v)
    results = spawn(_modes_rank, 2, plan, timeout_s=240)
    for rank, out in enumerate(results):
        ref_losses, ref_grads, _, _ = out["blocking"]
        assert any(g.abs().sum() > 0 for g in ref_grads.values())
        for name, (losses, grads, timeline, actions) in out.items():
            assert losses == ref_losses, (rank, name)
            assert grads.keys() == ref_grads.keys()
            for k in grads:
                assert torch.equal(grads[k], ref_grads[k]), (rank, name, k)
            recvs = [a for a in actions if a[0] == "r"]
            recorded = [a for _, a, _, _ in timeline]
            assert sorted(a for a in recorded if a[0] == "r") == sorted(recvs), (rank, name)
            # one rank runs one action at a time: no recorded interval overlaps the next
            spans = sorted((s, e) for _, _, s, e in timeline)
            assert all(e <= s2 + 1e-6 for (_, e), (s2, _) in zip(spans, spans[1:])), name
