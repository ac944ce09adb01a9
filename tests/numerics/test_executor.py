"""The schedule executor's receive modes on 2 gloo ranks: pre-posted irecvs (the default, any
prefetch window) and blocking receives run the same action lists to bit-identical losses and
gradients; the recorded timeline puts each receive's wait outside the computes, once per RECV."""
from __future__ import annotations

import pytest
import torch

from autopar.schedules import eager_sends, parse_action
from autopar.testing import spawn

from programs import make_data, make_plan, make_program

pytestmark = pytest.mark.distributed

# (name, async_recv, prefetch, async_send): "blocking" sends at the SEND's place in the list;
# every other mode sends right after the producing compute (executor: eager_sends)
MODES = [("blocking", False, None, False), ("blocking-recv", False, None, True),
         ("irecv-all", True, None, True), ("irecv-0", True, 0, True), ("irecv-2", True, 2, True)]


def _modes_rank(rank, world, plan):
    prog, vocab = make_program("gpt", plan)
    # lr 0: every mode starts from the same weights; gradients stay in .grad after the step
    runner = prog.compile(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), timeout_s=60)
    x, y = make_data(plan, vocab)[0]
    out = {}
    for name, async_recv, prefetch, async_send in MODES:
        ex = runner.executor
        ex.async_recv, ex.prefetch, ex.async_send = async_recv, prefetch, async_send
        runner.record_timeline(True)
        losses = [runner.train_step(x, y) for _ in range(2)]   # the 2nd from the 1st's state
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
            if name != "blocking":   # eager: each send recorded right after its compute
                order = [a for _, a, _, _ in sorted(timeline, key=lambda ev: ev[2])]
                for i, a in enumerate(order):
                    if a[0] == "s":
                        assert order[i - 1] == a[1:a.index(">")], (rank, name, order)
        trailing = eager_sends([parse_action(a) for a in out["blocking"][3]])
        if schedule == "interleaved-1f1b":   # the list puts some send after a later compute
            assert trailing, out["blocking"][3]


# ---- what a stage holds ------------------------------------------------------------------
def test_released_outputs_backpropagate_like_kept_ones():
    """release_data frees a sent output's data; backward_from still runs its graph (only the
    grad_fn is needed) to the same gradients as torch.autograd.backward on a kept output."""
    from autopar.runtime.executor import backward_from, release_data
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    g = torch.randn(4, 8)
    kept = torch.tanh(x @ w)
    torch.autograd.backward([kept], [g])
    want = w.grad.clone()
    w.grad = None
    out = torch.tanh(x @ w)
    assert release_data([out]) and out.numel() == 1
    backward_from([out], [g])
    assert torch.equal(w.grad, want)
    leaf = torch.randn(3, requires_grad=True)
    assert not release_data([leaf, leaf[:2]]) and leaf.numel() == 3   # leaves and views kept
    # a sent value the chunk also reads (SEND_KEPT: a norm's input sent beside the norm) keeps
    # its data, which the norm's backward needs
    stream = x @ w
    normed = torch.nn.functional.layer_norm(stream, (8,))
    assert release_data([stream, normed], kept=(0,)) and stream.numel() == 32


def _held_rank(rank, world, plan):
    """Per action, the bytes this rank's executor holds in sent outputs and posted receive
    buffers (a hook before every action)."""
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), timeout_s=60)
    ex, regime_hook = runner.executor, runner.executor.before_action
    held = []

    def snapshot(n, a):
        outs = sum(o.untyped_storage().nbytes() for st in ex._stash.values()
                   for o in st.outputs)
        bufs = sum(b.untyped_storage().nbytes() for p in ex._posted.values() for b in p.bufs)
        held.append((outs, bufs, len(ex._posted)))
        regime_hook(n, a)
    ex.before_action = snapshot
    x, y = make_data(plan, vocab)[0]
    runner.train_step(x, y)
    return held, len(ex.actions)


def test_a_stage_frees_sent_outputs_and_posts_receives_just_in_time():
    """p=2, m=8: rank 0's sent activations are freed once sent (a few bytes each instead of
    b·s·h), and no rank has more than a window of receives posted, not the step's 16."""
    plan = make_plan(p=2, m=8, layers=2)
    results = spawn(_held_rank, 2, plan, timeout_s=240)
    (held0, _), (held1, n1) = results
    act_bytes = 2 * 8 * 32 * 4                      # one micro-batch's (b, s, h) fp32 output
    # at most the one output between its forward and its send (8 kept outputs: 8x)
    assert act_bytes <= max(o for o, _, _ in held0) < 2 * act_bytes
    assert max(k for _, _, k in held0 + held1) <= 4 < 8
