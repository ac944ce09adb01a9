"""Predicted step time of the best breadth-first, interleaved-1F1B and 1F1B plans for a 52B GPT
(64 layers, h 8192, 64 heads, s 2048, V 51200) on 64 A100s, at small and large global batch.

Each column is the CP-SAT optimum with the schedule pinned (everything else free); 'free' is
the unpinned solve. Run: python benchmarks/schedules.py [batch ...]
"""
from __future__ import annotations

import sys
import time

from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve

SCHEDULES = ("breadth-first", "interleaved-1f1b", "1f1b")


def _row(label: str, plan) -> str:
    pr = plan.predicted
    return (f"  {label:<17} {pr.step_time_s:8.3f} s  t={plan.t} p={plan.p} d={plan.d} "
            f"v={plan.v} b={plan.micro_batch_size} m={plan.num_microbatches} {plan.recompute}"
            f" sp={int(plan.sequence_parallel)} zero={plan.zero} | bubble {pr.bubble_s:.3f} "
            f"dp {pr.dp_comm_s:.3f} p2p {pr.pp_comm_s:.3f} tp {pr.tp_comm_s:.3f} "
            f"mem {pr.memory_bytes_per_gpu / 1e9:.1f} GB")


def main(batches: list[int]) -> None:
    prof = transformer_profile(name="52B", num_layers=64, hidden=8192, heads=64, seq_len=2048,
                               vocab=51200)
    for batch in batches:
        t0 = time.perf_counter()
        free = solve(prof, "dgx-a100-80gb", gpus=64, global_batch_size=batch)
        print(f"52B on 64 A100, B={batch} ({batch / 64:g} sequences per GPU): free solve picks "
              f"{free.schedule} ({time.perf_counter() - t0:.2f} s)")
        print(_row("free", free))
        times = {}
        for sched in SCHEDULES:
            try:
                plan = solve(prof, "dgx-a100-80gb", gpus=64, global_batch_size=batch,
                             schedule=sched)
            except ValueError as err:
                print(f"  {sched:<17} infeasible: {str(err)[:110]}...")
                continue
            times[sched] = plan.predicted.step_time_s
            print(_row(sched, plan))
        if "breadth-first" in times and "interleaved-1f1b" in times:
            print(f"  breadth-first vs best interleaved: "
                  f"{times['interleaved-1f1b'] / times['breadth-first'] - 1:+.1%} throughput")
        print()


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [16, 64, 256, 2048])
