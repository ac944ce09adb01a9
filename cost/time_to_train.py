"""Time to train: the global batch that minimises steps(B) × step_time(B) on a GPU count.

    time(B) = S(B) · step_time(B),   S(B) = S_min·(1 + B_crit/B)      (cost/critical_batch.py)

step_time(B) is the solver's (cost/solver.py, the fastest plan at global batch B). Below the
critical batch, doubling B nearly halves the steps, and pays while the GPUs are not yet full
(more micro-batches fill the pipeline, a larger per-GPU batch runs faster GEMMs); far above it
the steps stop falling while every step grows with B. On few GPUs the step time is nearly
proportional to B, so time(B) ∝ (B + B_crit): the smallest batch that still fills the GPUs wins
("pipeline fill"); on many GPUs the step time stops shrinking with B and the critical batch
caps it ("critical batch").

The search plans a few candidate batches, not all: candidates are 2^k and 3·2^k sequences
(the GPU counts of real clusters are of these forms, so d divides them), from one sequence to
8·B_crit. time(B) is unimodal in practice (S falls and flattens, the step time grows), so a walk
over the powers of two from a start near the fill point, then the 3·2^k neighbours of the best,
finds its minimum in a handful of solves. Each solve is independent; the caller supplies it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from autopar.cost.critical_batch import (steps_for_tokens, tokens_processed)
from autopar.plan import BatchTrial, Plan, TrainingEstimate

MAX_CRITICAL_MULTIPLE = 8   # S(8·B_crit) is within 12.5 % of S_min: larger batches buy nothing


def batch_candidates(seq_len: int, critical_batch_tokens: float, multiple: int = 1,
                     gpus: int = 1) -> list[int]:
    """Global batches (sequences) worth planning: 2^k and 3·2^k sequences, multiples of
    `multiple` (pinned d·b), from one sequence up to MAX_CRITICAL_MULTIPLE·B_crit tokens, or
    up to one sequence per GPU where that is more (far above the critical batch a plan still
    needs work for every GPU)."""
    top = max(1, int(MAX_CRITICAL_MULTIPLE * critical_batch_tokens // seq_len), gpus)
    out, k = set(), 0
    while 2 ** k <= top:
        for b in (2 ** k, 3 * 2 ** k):
            if b <= top and b % multiple == 0:
                out.add(b)
        k += 1
    if not out:  # a pinned multiple above every power-of-two candidate
        out.add(multiple)
    return sorted(out)


def _first_line(err: Exception) -> str:
    text = str(err).split("\n")[0]
    return text if len(text) <= 160 else text[:157] + "…"


def plan_for_tokens(solve_at: Callable[[int], Plan], *, tokens: float,
                    critical_batch_tokens: float, critical_batch_source: str, seq_len: int,
                    gpus: int, pinned_batch: int | None = None, multiple: int = 1,
                    start: int | None = None, refine: bool = True) -> Plan:
    """The plan (with `training` set) that trains `tokens` in the shortest time on `gpus` GPUs.

    `solve_at(global_batch)` returns the fastest plan at that batch or raises ValueError (no
    configuration, nothing fits). `pinned_batch`: the user fixed the global batch; it is the
    only one planned. `start`: the batch to start the walk from (a sweep passes the batch chosen
    at the previous GPU count). `refine`: also plan the 3·2^k neighbours of the best power of
    two (a sweep over powers of two skips them: a few % of time for half the solves). Raises
    ValueError when no candidate batch has a plan. Why this size: the walk over batches (up,
    then down, then the refinement) keeps its trials in one place so each is solved once.
    """
    trials: dict[int, BatchTrial] = {}
    plans: dict[int, Plan] = {}

    def run(b: int) -> float:
        if b not in trials:
            try:
                pl = solve_at(b)
            except ValueError as err:
                trials[b] = BatchTrial(global_batch_size=b, train_time_s=None,
                                       note=_first_line(err))
                return float("inf")
            steps = steps_for_tokens(tokens, b * seq_len, critical_batch_tokens)
            plans[b] = pl
            trials[b] = BatchTrial(global_batch_size=b, step_time_s=pl.predicted.step_time_s,
                                   steps=steps, train_time_s=steps * pl.predicted.step_time_s)
        t = trials[b].train_time_s
        return float("inf") if t is None else t

    if pinned_batch is not None:
        run(pinned_batch)
        reason = "pinned: global_batch_size was given, so only it was planned"
    else:
        cands = batch_candidates(seq_len, critical_batch_tokens, multiple, gpus)
        coarse = [b for b in cands if b & (b - 1) == 0] or cands
        crit_seqs = critical_batch_tokens / seq_len
        # start near where the GPUs fill (a sequence per 8 GPUs: t = 8 inside a node), never
        # beyond the critical batch
        guess = start if start is not None else max(1.0, min(crit_seqs, gpus / 8))
        i = min(range(len(coarse)), key=lambda j: abs(coarse[j] - guess))
        best = run(coarse[i])
        if best == float("inf"):  # no plan at the start: the first larger batch that has one
            # (a small batch leaves too few micro-batches or replicas), else a smaller one
            order = list(range(i + 1, len(coarse))) + list(range(i - 1, -1, -1))
            for j in order:
                best = run(coarse[j])
                if best < float("inf"):
                    i = j
                    break
        for step in (-1, 1):  # walk down, then up, while the time falls
            j = i
            while 0 <= j + step < len(coarse):
                tj = run(coarse[j + step])
                if not tj < best:
                    break
                best, j = tj, j + step
                i = j
        # refine between the coarse neighbours of the best (the 3·2^k candidates)
        b0 = coarse[i]
        for b in cands if refine else ():
            if b0 // 2 < b < 2 * b0 and b & (b - 1):
                run(b)
        reason = ""
    ok = {b: tr for b, tr in trials.items() if tr.train_time_s is not None}
    if not ok:
        notes = "; ".join(f"{b}: {tr.note}" for b, tr in sorted(trials.items()))
        raise ValueError(f"time to train: no global batch has a plan on {gpus} GPUs (tried "
                         f"{notes}); add GPUs or unpin knobs")
    b = min(ok, key=lambda k: (ok[k].train_time_s, k))
    if not reason:
        reason = _batch_reason(b, trials, seq_len, critical_batch_tokens)
    pl, tr = plans[b], trials[b]
    est = TrainingEstimate(
        tokens=float(tokens), critical_batch_tokens=float(critical_batch_tokens),
        critical_batch_source=critical_batch_source, batch_tokens=b * seq_len, steps=tr.steps,
        tokens_processed=tokens_processed(tokens, b * seq_len, critical_batch_tokens),
        train_time_s=tr.train_time_s, gpu_hours=tr.train_time_s * gpus / 3600.0,
        batch_reason=reason, trials=tuple(trials[k] for k in sorted(trials)))
    return dataclasses.replace(pl, training=est)


def _batch_reason(b: int, trials: dict[int, BatchTrial], seq_len: int,
                  critical_batch_tokens: float) -> str:
    """Why not larger (the critical batch, memory, or GPUs already full) and why not smaller
    (pipeline fill, memory), from the planned neighbours of the chosen batch."""
    chosen = trials[b]
    larger = [k for k in trials if k > b]
    smaller = [k for k in trials if k < b]
    parts = []
    if larger:
        up = trials[min(larger)]
        if up.train_time_s is None:
            parts.append(f"memory: {up.global_batch_size} sequences has no plan ({up.note})")
        else:
            cut = 1 - up.steps / chosen.steps
            grow = (up.step_time_s / chosen.step_time_s - 1) * 100
            # far below B_crit the steps fall almost in proportion to the batch (cut ≈ 1 −
            # b/b_up): what stops a larger batch is then the step time, not the critical batch
            if cut < 0.5 * (1 - b / up.global_batch_size):
                parts.append(
                    f"critical batch: {up.global_batch_size} sequences would cut the steps "
                    f"only {cut * 100:.0f}% (B_crit = {critical_batch_tokens / seq_len:,.0f} "
                    f"sequences) while each step grows {grow:.0f}%")
            else:
                parts.append(
                    f"GPUs full: {up.global_batch_size} sequences would cut the steps "
                    f"{cut * 100:.0f}% but each step grows {grow:.0f}% (B_crit = "
                    f"{critical_batch_tokens / seq_len:,.0f} sequences is far above)")
    else:
        parts.append(f"critical batch: larger batches ({MAX_CRITICAL_MULTIPLE}·B_crit) buy "
                     f"almost no fewer steps")
    if smaller:
        down = trials[max(smaller)]
        if down.train_time_s is None:
            parts.append(f"memory: {down.global_batch_size} sequences has no plan "
                         f"({down.note})")
        else:
            parts.append(
                f"pipeline fill: {down.global_batch_size} sequences would need "
                f"{(down.steps / chosen.steps - 1) * 100:.0f}% more steps while each step "
                f"shrinks only {(1 - down.step_time_s / chosen.step_time_s) * 100:.0f}% (the "
                f"GPUs are no longer full)")
    else:
        parts.append("one sequence is the smallest batch")
    return "; ".join(parts)
