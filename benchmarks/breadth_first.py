"""Breadth-first vs interleaved 1F1B at the same (p=2, v=2, m), measured on 2 CPU gloo ranks.

Both programs are built with the public API (autopar.parallelize with p, v, schedule pinned,
then prog.compile) in the same two processes and stepped alternately (interleaved, breadth-first,
interleaved, ...) on the same batches, so machine noise hits both alike. Reports per schedule the
median step time and, from runner.timeline, each pipeline rank's idle fraction (1 − its F/B time /
the step's span over both ranks, cost.simulate.measured_idle_fraction), and prints the ratios.
Model: the examples' GPT, 4 layers (one per chunk), untied embeddings.

--d 2: p=2 × d=2 on 4 gloo ranks (oversubscribed on 2 cores: a functional comparison, the
ratio is noisy), breadth-first with ZeRO-3 (weights gathered once per chunk pass) against
interleaved 1F1B with ZeRO-1, each rank stepping its data-parallel share.

    python benchmarks/breadth_first.py [--steps 8] [--m 4] [--hidden 256] [--seq 64] [--b 2]
                                       [--d 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from autopar.testing import spawn

SCHEDULES = ("interleaved-1f1b", "breadth-first")
ZERO_AT_D2 = {"interleaved-1f1b": 1, "breadth-first": 3}


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def make_model(args) -> nn.Module:
    from autopar.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=4, n_head=4,
                         n_embd=args.hidden, tie_embeddings=False))


def data(args, step: int, dp_rank: int = 0):
    """This data-parallel rank's share of the step's global batch."""
    g = torch.Generator().manual_seed(step)
    shape = (args.b * args.m * args.d, args.seq)
    x, y = (torch.randint(0, args.vocab, shape, generator=g),
            torch.randint(0, args.vocab, shape, generator=g))
    lo, hi = dp_rank * args.b * args.m, (dp_rank + 1) * args.b * args.m
    return x[lo:hi], y[lo:hi]


def build(args, schedule: str):
    import autopar
    ex = torch.zeros(args.b, args.seq, dtype=torch.long)
    zero = ZERO_AT_D2[schedule] if args.d > 1 else 0
    prog = autopar.parallelize(make_model(args), 2 * args.d, example_inputs=(ex,),
                               loss_fn=loss_fn, example_targets=ex.clone(),
                               global_batch_size=args.b * args.m * args.d,
                               cluster="local-cpu", t=1, p=2, d=args.d, v=2,
                               micro_batch_size=args.b, schedule=schedule, recompute="none",
                               zero=zero, sequence_parallel=False)
    got = (prog.plan.schedule, prog.plan.p, prog.plan.v, prog.plan.d, prog.plan.zero)
    if got != (schedule, 2, 2, args.d, zero):
        raise RuntimeError(f"planner did not honour the pins: {got}")
    return prog.compile(timeout_s=120)


def _worker(rank: int, world: int, args) -> dict:
    import torch.distributed as dist
    from autopar.cost.simulate import measured_idle_fraction
    runners = {s: build(args, s) for s in SCHEDULES}
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    idle: dict[str, list[tuple]] = {s: [] for s in SCHEDULES}
    losses: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for s in SCHEDULES:                       # warm-up step each (allocations, first calls)
        runners[s].train_step(*data(args, 0, runners[s].dp_rank))
    for step in range(1, args.steps + 1):
        for s in SCHEDULES:                   # alternate: noise hits both alike
            r = runners[s]
            r.record_timeline(True)
            dist.barrier()
            t0 = time.perf_counter()
            losses[s].append(r.train_step(*data(args, step, r.dp_rank)))
            dist.barrier()
            times[s].append(time.perf_counter() - t0)
            evs = [None] * world
            dist.all_gather_object(evs, r.timeline)
            r.record_timeline(False)
            replica = set(r.pg.pipeline_ranks)      # this rank's pipeline (one dp replica)
            evs = [e for k, rank_evs in enumerate(evs) if k in replica for e in rank_evs]
            idle[s].append(measured_idle_fraction(evs, 2))
    return dict(times=times, idle=idle, losses=losses,
                actions={s: len(runners[s].executor.actions) for s in SCHEDULES})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--m", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--b", type=int, default=2, help="micro-batch size")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d", type=int, default=1, choices=(1, 2),
                    help="data-parallel degree; 2: ZeRO-3 breadth-first vs ZeRO-1 interleaved")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = spawn(_worker, 2 * args.d, args, timeout_s=110 * args.d)[0]
    zeros = (f"ZeRO-{ZERO_AT_D2['breadth-first']} breadth-first vs ZeRO-"
             f"{ZERO_AT_D2['interleaved-1f1b']} interleaved, " if args.d > 1 else "")
    print(f"GPT 4 layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.b}, "
          f"p=2 v=2 m={args.m}, d={args.d}, {zeros}{2 * args.d} CPU gloo ranks, "
          f"{args.steps} alternating steps "
          f"(+1 warm-up each); wall {time.perf_counter() - t0:.0f} s")
    print(f"{'schedule':<18}{'median step s':>14}{'idle r0':>9}{'idle r1':>9}{'mean idle':>10}"
          f"{'last loss':>11}")
    summary = {}
    for s in SCHEDULES:
        med = statistics.median(res["times"][s])
        idle = [statistics.mean(step[r] for step in res["idle"][s]) for r in range(2)]
        summary[s] = (med, statistics.mean(idle))
        print(f"{s:<18}{med:>14.4f}{idle[0]:>9.3f}{idle[1]:>9.3f}{summary[s][1]:>10.3f}"
              f"{res['losses'][s][-1]:>11.4f}")
    bf, il = summary["breadth-first"], summary["interleaved-1f1b"]
    print(f"breadth-first / interleaved: step time {bf[0] / il[0]:.3f}x, "
          f"mean idle fraction {bf[1]:.3f} vs {il[1]:.3f} "
          f"({'equal losses' if res['losses']['breadth-first'] == res['losses']['interleaved-1f1b'] else 'losses differ slightly: summation order'})")


if __name__ == "__main__":
    main()
