"""Checkpoint cost at d = 4 (--ranks) on CPU gloo ranks: the sharded save (every rank writes
what it holds) against the gathered one it replaced (the ZeRO regimes all-gathered the
optimizer state and data-parallel rank 0 wrote it), the sharded load (straight into the
regime's shards, autopar.runtime.ckpt_load) against the one it replaced (each rank built its
unsharded local weights and optimizer state, then the regime took its shard), and an
asynchronous save's training stall against a synchronous save.

Per rank, for each ZeRO level: its shard state (fp32 weights + Adam moments held), bytes written
(.distcp files), peak resident-memory growth during the save (VmHWM after a reset, the
second save of the process), save time; for the load (under the same plan, the second of the
process) its time, peak resident growth and the largest temporary the loader allocated
(counted: ckpt_load.LoadStats.peak_bytes), against the replaced load. Then the stall:
the time a synchronous save blocks the loop, against the time an asynchronous save blocks it
(staging a host copy) plus the slowdown of the training steps that run while it writes
(`_async_trial`: the save and n steps, minus the same n steps without a save before and
after, unclipped; medians of --rounds, the slowest rank's). The asynchronous saves measured
follow the job's first, which starts each rank's writer process and allocates its shared
staging buffer, once per job. Also: the CPU seconds the writer process uses per save (what
a host without idle cores loses to it, free of the wall-clock noise of a shared machine) and
the stall that implies there (block + the writers' CPU seconds / cores: an estimate), the
load it replaced (the unsharded local state it built). The machine may be shared: read the
medians, and rerun.

    python benchmarks/checkpoint.py [--hidden 512] [--layers 4] [--vocab 8192] [--zero 1,3]
                                    [--ranks 4] [--rounds 5]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

from autopar.testing import spawn


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _runner(args, zero: int):
    import autopar
    from autopar.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                          n_head=4, n_embd=args.hidden))
    ex = torch.zeros(1, args.seq, dtype=torch.long)
    prog = autopar.parallelize(model, args.ranks, example_inputs=(ex,), loss_fn=loss_fn,
                               example_targets=ex.clone(), global_batch_size=args.ranks,
                               cluster="local-cpu", t=1, p=1, d=args.ranks,
                               micro_batch_size=1, zero=zero)
    return prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), timeout_s=300)


def _step(runner, args, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    t0 = time.perf_counter()
    runner.train_step(x, x)
    return time.perf_counter() - t0


def _second(runner, call, gathered):
    """(seconds, peak resident growth) of the second of two calls of `call` (the first pays
    one-time costs); gathered: the regime without a sharded form (the path it replaced)."""
    if gathered:
        runner.regime.shard_state = lambda: None
    call()
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kb("VmRSS")
    t0 = time.perf_counter()
    call()
    took = time.perf_counter() - t0
    grew = (_rss_kb("VmHWM") - before) * 1024
    if gathered:
        del runner.regime.shard_state
    return took, grew


def _save(runner, path, rank, gathered=False):
    save_s, grew = _second(runner, lambda: runner.save_checkpoint(path), gathered)
    written = sum(f.stat().st_size for f in Path(path).resolve().glob(f"__{rank}_*.distcp"))
    return save_s, written, grew


def _load(runner, path, gathered=False):
    """(seconds, peak resident growth, largest counted temporary) of a load of `path`."""
    from autopar.runtime.ckpt_load import last_load_stats
    load_s, grew = _second(runner, lambda: runner.load_checkpoint(path), gathered)
    return load_s, grew, None if gathered else last_load_stats().peak_bytes


def _steps(runner, args, k0, n):
    t0 = time.perf_counter()
    for i in range(n):
        _step(runner, args, k0 + i)
    return time.perf_counter() - t0


def _async_trial(runner, args, path, k0, n):
    """One asynchronous save against the same n steps without one: (seconds the save blocks
    the loop, its stall). The stall is the wall time of the save, n steps and the wait for
    the write if it outlasts them, minus the mean of the same n steps (same data) run without
    a save right before and right after — not clipped at zero, so the steps' noise averages
    out over rounds instead of adding up (the version before took max(0, during − after):
    biased upwards by the noise alone). Also returned: the wait for a write that outlasted
    the n steps (part of the stall here; in training it would overlap more steps)."""
    from autopar.runtime.ckpt_writer import WRITER
    before = _steps(runner, args, k0, n)
    cpu0 = _cpu_s(WRITER._proc.pid)
    t0 = time.perf_counter()
    runner.save_checkpoint(path, async_save=True)
    block = time.perf_counter() - t0
    _steps(runner, args, k0, n)
    t1 = time.perf_counter()
    runner.wait_for_checkpoint()
    with_save = time.perf_counter() - t0
    writer_cpu = _cpu_s(WRITER._proc.pid) - cpu0
    after = _steps(runner, args, k0, n)
    return block, with_save - (before + after) / 2, with_save - (t1 - t0), writer_cpu


def _cpu_s(pid):
    """CPU seconds (user + system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rank(rank, world, args, tmp):
    import torch.distributed as dist
    torch.set_num_threads(1)
    out = {}
    for zero in args.zero:
        runner = _runner(args, zero)
        _step(runner, args, 0)
        held = sum(t.numel() * t.element_size() for h in runner.regime.shard_state()
                   for t in h.tensors.values())
        # what the load it replaced built before the regime took its shard: every local
        # parameter's fp32 weight and elementwise optimizer states, unsharded
        states = 1 + sum(1 for st in list(runner.regime.optimizer.state.values())[:1]
                         for v in st.values() if v.dim() > 0)
        built = sum(p.numel() * 4 * states for p in runner.params.tensors.values())
        row = {"held": held, "old_load_built": built}
        for kind in ("gathered", "sharded"):
            path = f"{tmp}/z{zero}-{kind}"
            row[kind] = _save(runner, path, rank, gathered=kind == "gathered")
        row["load_gathered"] = _load(runner, f"{tmp}/z{zero}-sharded", gathered=True)
        row["load"] = _load(runner, f"{tmp}/z{zero}-sharded")
        row["step_s"] = statistics.median(_step(runner, args, k) for k in range(1, 6))
        runner.save_checkpoint(f"{tmp}/z{zero}-sync")        # the version dir exists
        syncs, cpus = [], []
        for _ in range(args.rounds):
            t0, c0 = time.perf_counter(), time.process_time()
            runner.save_checkpoint(f"{tmp}/z{zero}-sync")
            syncs.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        row["sync_block_s"] = statistics.median(syncs)
        row["sync_cpu_s"] = statistics.median(cpus)
        # steps overlapping a write: 3 sync saves' worth, the same on every rank
        n = torch.tensor([max(3, math.ceil(3 * row["sync_block_s"] / row["step_s"]))])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        row["async_steps"] = int(n)
        runner.save_checkpoint(f"{tmp}/z{zero}-async", async_save=True)   # starts the writer
        runner.wait_for_checkpoint()     # process and its staging buffer: once per job
        trials = [_async_trial(runner, args, f"{tmp}/z{zero}-async", 10 + 20 * i, int(n))
                  for i in range(args.rounds)]
        row["async_block_s"] = statistics.median(tr[0] for tr in trials)
        row["async_stall_s"] = statistics.median(tr[1] for tr in trials)
        row["async_stalls"] = [tr[1] for tr in trials]
        row["async_tail_s"] = max(tr[2] for tr in trials)
        row["writer_cpu_s"] = statistics.median(tr[3] for tr in trials)
        out[zero] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--zero", default="1,3")
    ap.add_argument("--ranks", type=int, default=4, help="d: data-parallel CPU ranks")
    ap.add_argument("--rounds", type=int, default=5, help="async trials and sync saves "
                    "(their medians are reported)")
    args = ap.parse_args()
    args.zero = [int(z) for z in args.zero.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(_rank, args.ranks, args, tmp, timeout_s=1800)
    mb = 1 / 2**20
    for zero in args.zero:
        rows = [r[zero] for r in results]
        print(f"\nZeRO-{zero}, d={args.ranks}, GPT hidden {args.hidden} × {args.layers} "
              f"layers, vocab {args.vocab}: shard state per rank {rows[0]['held'] * mb:.1f} MiB")
        print("rank | gathered: written MiB, mem growth MiB, save s | sharded: written MiB, "
              "mem growth MiB, save s | load before: s, mem growth MiB | load: s, mem growth "
              "MiB, largest temporary MiB")
        for rank, r in enumerate(rows):
            g, s, lg, ld = r["gathered"], r["sharded"], r["load_gathered"], r["load"]
            print(f"{rank:4d} | {g[1] * mb:8.1f} {g[2] * mb:8.1f} {g[0]:6.2f} | "
                  f"{s[1] * mb:8.1f} {s[2] * mb:8.1f} {s[0]:6.2f} | {lg[0]:6.2f} "
                  f"{lg[1] * mb:8.1f} | {ld[0]:6.2f} {ld[1] * mb:8.1f} {ld[2] * mb:8.2f}")
        sync = max(r["sync_block_s"] for r in rows)
        stall = max(r["async_stall_s"] for r in rows)
        print(f"sync save blocks {sync:.2f} s; async save blocks "
              f"{max(r['async_block_s'] for r in rows):.2f} s and slows the "
              f"{rows[0]['async_steps']} steps that overlap its write: stall {stall:.2f} s = "
              f"{stall / sync:.2f} × the sync save (median step {rows[0]['step_s']:.2f} s; "
              f"medians of {args.rounds} rounds, the slowest rank's)")
        print("  stall per round, each rank: " + "; ".join(
            " ".join(f"{x:.2f}" for x in r["async_stalls"]) for r in rows)
            + f"; longest wait for a write that outlasted the steps "
            f"{max(r['async_tail_s'] for r in rows):.2f} s")
        print(f"  the writer process used {max(r['writer_cpu_s'] for r in rows):.2f} CPU-s "
              f"per save (median; the slowest rank's): what a saturated host's training loses "
              f"to it, whatever the wall-clock noise; a sync save used "
              f"{max(r['sync_cpu_s'] for r in rows):.2f} CPU-s of its rank")
        # derived, not measured: with no idle core, the lock-stepped ranks lose the writers'
        # CPU spread over the host's cores, on top of the time an async save blocks
        block = max(r["async_block_s"] for r in rows)
        writers = sum(r["writer_cpu_s"] for r in rows)
        cores = os.cpu_count() or 1
        print(f"  if no core is idle: block {block:.2f} s + the {len(rows)} writers' "
              f"{writers:.2f} CPU-s over {cores} cores = {block + writers / cores:.2f} s = "
              f"{(block + writers / cores) / sync:.2f} × the sync save (an estimate from the "
              f"CPU seconds, free of the wall-clock noise)")
        print(f"  the load it replaced built {rows[0]['old_load_built'] * mb:.1f} MiB of "
              f"unsharded local state on each rank "
              f"({rows[0]['old_load_built'] / rows[0]['held']:.1f}× the shard state); the "
              f"sharded load's largest temporary "
              f"{max(r['load'][2] for r in rows) / rows[0]['held']:.3f}× it")


if __name__ == "__main__":
    main()
