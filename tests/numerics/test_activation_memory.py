"""Predicted activation memory against what the runtime really saves, on 2 gloo ranks.

The meter: every tensor autograd saves for backward goes through a saved-tensors hook that
charges its storage once (shared storages counted once, parameters and buffers not at all) and
releases it when autograd drops the last reference; the arguments of an activation checkpoint
(what full / selective recompute keeps instead) are charged the same way, and so are the
outputs op recompute's policy keeps (held in the checkpoint's storage, not as saved tensors:
charged when kept, released with the checkpoint). Its peak over one
training step on a pipeline rank is the activation memory that rank's plan predicts
(`plan.predicted.rank_memory[r].activations_bytes`): the profile's saved bytes per region ×
the chunk-micro-batches the schedule holds at once.

Tolerance 5%: what the profile counts and the meter sees differ by small tensors (per-row
statistics, masks' rounding, the loss's scalars) that scale with neither layers nor micro-batches;
measured here within 2% on every schedule but zero-bubble.

Zero-bubble splits each backward: between a chunk's B and its W the runtime keeps the
gradients recorded at the weights' GEMM outputs (autopar/runtime/split_backward.py), which are
not saved tensors and which the meter cannot see; and the tensors saved by nodes on the
input-gradient path only (attention's q, k, v, output, logsumexp) outlive the W until the
chunk's autograd graph is collected (measured: +50 KB per micro-batch of a one-layer chunk
here, +8% of rank 0's peak). There the prediction, deferred W's included, must bound the
meter from above — before the deferred W's were priced it was 1.7x below under full recompute.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.passes.recompute import POLICY_SEES_OUTPUT
from autopar.testing import spawn

import models

SEQ, VOCAB, HIDDEN, LAYERS = 96, 256, 64, 4   # seq ≠ hidden: the profile tells them apart by shape
RTOL = 0.05
# (schedule, v, micro-batch size, micro-batches, recompute)
CASES = [("1f1b", 1, 2, 4, "none"), ("gpipe", 1, 1, 4, "selective"),
         ("1f1b", 1, 1, 4, "full"), ("interleaved-1f1b", 2, 1, 4, "none"),
         ("interleaved-1f1b", 2, 1, 6, "full"), ("breadth-first", 2, 1, 4, "selective"),
         ("interleaved-zb", 2, 1, 4, "none"), ("interleaved-zb", 2, 1, 4, "full")]
# op where the meter sees what it keeps: it charges them from the policy's context, which
# hands the policy each op's output on torch 2.13, not on 2.11 (one spawn measures every
# case, so a case that cannot run would fail the others with it)
CASES += [("1f1b", 1, 2, 4, "op")] if POLICY_SEES_OUTPUT else []


class _Meter:
    """Bytes of the distinct storages autograd holds for backward, and their peak."""

    def __init__(self, skip: set[int]):
        self.skip, self.refs, self.nbytes, self.now, self.peak = skip, {}, {}, 0, 0

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self.skip or t.numel() == 0:
            return t
        if key not in self.refs:
            self.refs[key], self.nbytes[key] = 0, t.untyped_storage().nbytes()
            self.now += self.nbytes[key]
            self.peak = max(self.peak, self.now)
        self.refs[key] += 1
        return _Held(t, key, self)

    def drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.now -= self.nbytes.pop(key)


class _Held:
    """A packed tensor; its reference to the meter ends when autograd frees it."""

    def __init__(self, t, key, meter):
        self.t, self.key, self.meter = t, key, meter

    def __del__(self):
        self.meter.drop(self.key)


def _unpack(h):
    return h.t if isinstance(h, _Held) else h


def _program(schedule, v, b, m, recompute):
    torch.manual_seed(0)
    model = models.gpt(vocab=VOCAB, seq=SEQ, layers=LAYERS, heads=4, hidden=HIDDEN)
    return autopar.parallelize(
        model, gpus=2, example_inputs=(torch.zeros(b, SEQ, dtype=torch.long),),
        loss_fn=autopar.cross_entropy, global_batch_size=b * m, cluster="local-cpu",
        t=1, p=2, d=1, v=v, micro_batch_size=b, recompute=recompute, schedule=schedule)


def _measure(rank, world, cases):
    import torch.utils.checkpoint as checkpoint
    import autopar.passes.recompute as recompute
    from autopar.cost.model import Config, config_costs, schedule_activation_bytes
    out = []
    policy_of, kept_by = recompute.op_policy, [None]

    def charging_policy(seen, *last):        # op: the outputs it keeps are held too
        inner = policy_of(seen, *last)

        def policy(ctx, func, *args, **kwargs):
            decision = inner(ctx, func, *args, **kwargs)
            if decision.name == "MUST_SAVE" and kept_by[0] is not None:
                kept_by[0] += [meter.pack(t) for t in recompute._tensors(ctx.op_output)]
            return decision
        return policy
    recompute.op_policy = charging_policy
    for case in cases:
        prog = _program(*case)
        runner = prog.compile(precision="bf16", timeout_s=60)
        x = torch.randint(0, VOCAB, (case[2] * case[3], SEQ),
                          generator=torch.Generator().manual_seed(1))
        runner.train_step(x, x)              # warm: optimizer state, buffers
        meter = _Meter({q.untyped_storage().data_ptr() for c in runner.chunks.values()
                        for q in (*c.net.parameters(), *c.net.buffers())})
        plain = checkpoint.checkpoint

        def charged(fn, *args, **kw):        # a checkpoint keeps its arguments for backward
            held = [meter.pack(a) for a in args if torch.is_tensor(a)]

            def run(*a, _held=held):         # `held` lives as long as the checkpoint does
                return fn(*a)
            kept_by[0] = held                # (op's kept outputs join it while it runs)
            try:
                return plain(run, *args, **kw)
            finally:
                kept_by[0] = None
        checkpoint.checkpoint = charged
        try:
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, _unpack):
                runner.train_step(x, x)
        finally:
            checkpoint.checkpoint = plain
        r = runner.pg.pp_rank
        plan = prog.plan
        predicted = plan.predicted.rank_memory[r].activations_bytes
        cc = config_costs(prog.profile.for_cluster(autopar.get_cluster("local-cpu")),
                          autopar.get_cluster("local-cpu"), Config.of_plan(plan))
        saved_only = schedule_activation_bytes(
            cc, [st.num_layers for st in plan.stages], deferred=False)[r]
        out.append((meter.peak, predicted, saved_only))
    return out


@pytest.fixture(scope="module")
def measured():
    return spawn(_measure, 2, CASES, timeout_s=900)


@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_predicted_activations_match_saved_tensors(measured, i):
    schedule = CASES[i][0]
    for rank, results in enumerate(measured):
        peak, predicted, saved_only = results[i]
        if schedule == "interleaved-zb":
            assert saved_only <= peak <= predicted, (rank, saved_only, peak, predicted)
        else:
            assert peak == pytest.approx(predicted, rel=RTOL), (rank, peak, predicted)
