"""Where sharded weights are gathered on a rank's action list (ZeRO-3 / FSDP): pure data.

A schedule is data (autopar.schedules); so is the plan of the weight all-gathers, releases and
gradient reduce-scatters that sharded data parallelism (Plan.zero 2 and 3) runs around it. The
runtime carries it out (autopar.runtime.zero3_chunks.Zero3Chunks, from the regime's executor hooks)
and the cost model counts it (cost/model.py): one plan for both, as for the schedule.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Sequence

GATHER, RELEASE, REDUCE_SCATTER = "GATHER", "RELEASE", "REDUCE_SCATTER"
# computes ahead a prefetch may look: a gather issued farther ahead hides no more (it overlaps
# at least this many computes) and scanning farther would make planning quadratic in m
LOOKAHEAD = 64
_TOKEN = {GATHER: "AG", RELEASE: "FREE", REDUCE_SCATTER: "RS"}


# ---- the plan: pure, on action lists -----------------------------------------------------
def plan_gathers(actions: Sequence[Any], *, keep: int = 2,
                 lookahead: int = LOOKAHEAD) -> list[tuple[int, str, int]]:
    """Where a rank's weight gathers, releases and gradient reduce-scatters go, on its list.

    Returns (index, op, chunk) sorted by index: run `op` on `chunk` just before
    `actions[index]` (index == len(actions): after the last action); ops at one index run in
    the listed order.

    At most `keep` chunks are gathered at once, counting those being prefetched. Before each
    compute (F/B), the next chunk the rank will compute that is not gathered (within
    `lookahead` computes) is prefetched as early as a slot is free or can be freed, so its
    all-gather overlaps the computes in between; a chunk still not gathered when it is needed
    is gathered right before (exposed). A slot is freed by releasing a gathered chunk, other
    than the computing and the prefetched one, whose next compute is furthest away and later
    than the prefetched chunk's (Belady's rule: the fewest re-gathers at this capacity; the
    lists are known in advance). A chunk is released for good right after its last compute of
    the step. Gradients: a chunk released after backward computes has its accumulated
    gradients reduce-scattered first (into the shard's, which adds up over the step), at the
    latest right after its last backward, so it overlaps the backwards still to run.

    keep = 2 is ZeRO-3: breadth-first gathers each chunk once per pass, prefetched under the
    previous chunk's pass, except the two top chunks at the forward→backward turn (2v − 2 per
    step for v >= 2); the interleaved orders once per visit of a group of N micro-batches (about
    2·m/N per chunk); 1F1B (one chunk) once. keep = v is the FSDP variant that keeps a chunk
    gathered from its first forward to its last backward (Plan.zero = 2): one gather and one
    reduce-scatter per chunk per step.

        >>> from autopar.schedules import breadth_first
        >>> print(format_with_gathers(breadth_first(1, 3, 2)[0]))  # doctest: +NORMALIZE_WHITESPACE
        AG0 AG1 F0.0 F0.1 FREE0 AG2 F1.0 F1.1 F2.0 F2.1 B2.0 B2.1 RS2 FREE2 R2 AG0 B1.0 B1.1 RS1
        FREE1 R1 B0.0 B0.1 RS0 FREE0 R0
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"plan_gathers: keep={keep!r} must be a positive integer (chunks "
                         f"gathered at once)")
    computes = [(n, a.chunk, a.kind) for n, a in enumerate(actions) if a.kind in ("F", "B")]
    uses: dict[int, list[int]] = {}
    for k, (_, c, _) in enumerate(computes):
        uses.setdefault(c, []).append(k)
    # run_end[k]: the first compute after k of another chunk; the prefetch scan below skips a
    # run of one chunk at once (its computes are all gathered or none is), which keeps it
    # linear in the runs rather than the computes (breadth-first runs m of one chunk in a row)
    run_end = [len(computes)] * len(computes)
    for k in range(len(computes) - 2, -1, -1):
        run_end[k] = k + 1 if computes[k + 1][1] != computes[k][1] else run_end[k + 1]

    def next_missing(k: int) -> int | None:
        """The first compute within `lookahead` after k whose chunk is not gathered."""
        j, stop = k + 1, min(k + 1 + lookahead, len(computes))
        while j < stop:
            if computes[j][1] not in live:
                return j
            j = run_end[j]
        return None

    def next_use(c: int, k: int) -> float:
        i = bisect.bisect_right(uses[c], k)
        return uses[c][i] if i < len(uses[c]) else math.inf

    ops: list[tuple[int, str, int]] = []
    live: list[int] = []
    pending: set[int] = set()           # chunks with backward gradients not reduce-scattered

    def free(c: int, at: int) -> None:
        if c in pending:
            ops.append((at, REDUCE_SCATTER, c))
            pending.discard(c)
        ops.append((at, RELEASE, c))
        live.remove(c)

    def gather(c: int, at: int, k: int, busy: set[int], before: float) -> bool:
        """Gather c at `at`, freeing a slot if needed by a chunk not needed before `before`."""
        if len(live) >= keep:
            victims = [x for x in live if x not in busy and next_use(x, k) > before]
            if not victims:
                return False
            free(max(victims, key=lambda x: next_use(x, k)), at)
        ops.append((at, GATHER, c))
        live.append(c)
        return True

    for k, (n, c, kind) in enumerate(computes):
        if c not in live:
            gather(c, n, k, {c}, k)
        upcoming = next_missing(k)
        if upcoming is not None:                                     # prefetch
            gather(computes[upcoming][1], n, k, {c, computes[upcoming][1]}, upcoming)
        if kind == "B":
            pending.add(c)
        if next_use(c, k) == math.inf:
            free(c, n + 1)
    return sorted(ops, key=lambda op: op[0])   # stable: ops at one index keep their order


def format_with_gathers(actions: Sequence[Any], plan: Sequence[tuple[int, str, int]] | None
                        = None, *, keep: int = 2) -> str:
    """One rank's actions with the plan's ops merged in: AG{c} gather, FREE{c} release,
    RS{c} reduce-scatter (default plan: `plan_gathers(actions, keep=keep)`)."""
    plan = plan_gathers(actions, keep=keep) if plan is None else plan
    at: dict[int, list[str]] = {}
    for i, op, c in plan:
        at.setdefault(i, []).append(f"{_TOKEN[op]}{c}")
    out: list[str] = []
    for n in range(len(actions) + 1):
        out += at.get(n, [])
        if n < len(actions):
            out.append(str(actions[n]))
    return " ".join(out)


def max_gathered(actions: Sequence[Any], plan: Sequence[tuple[int, str, int]]) -> int:
    """Most chunks gathered at once (in flight or in use) when `plan` runs on `actions`."""
    live: set[int] = set()
    most = 0
    for _, op, c in plan:
        if op == GATHER:
            live.add(c)
            most = max(most, len(live))
        elif op == RELEASE:
            live.discard(c)
    return most


@dataclass(frozen=True)
class GatherStats:
    """What `plan_gathers` does on one rank's list, for the cost model: per all-gather the
    computes it overlaps before its chunk is needed (0: exposed), per reduce-scatter the
    computes after it before the next one starts or the list ends (0: the last, exposed), and
    the most chunks gathered / holding unreduced full gradients at once."""
    gather_leads: tuple[int, ...]
    reduce_leads: tuple[int, ...]
    peak_gathered: int
    peak_pending: int

    @property
    def gathers(self) -> int:
        return len(self.gather_leads)

    @property
    def reduce_scatters(self) -> int:
        return len(self.reduce_leads)


def gather_stats(actions: Sequence[Any], *, keep: int = 2) -> GatherStats:
    """The GatherStats of `plan_gathers(actions, keep=keep)` (only F/B actions matter: a
    rank's compute order, e.g. autopar.schedules.compute_order, is enough)."""
    actions = list(actions)
    plan = plan_gathers(actions, keep=keep)
    done = [0] * (len(actions) + 1)               # computes before each index
    for n, a in enumerate(actions):
        done[n + 1] = done[n] + (a.kind in ("F", "B"))
    at_chunk: dict[int, list[int]] = {}             # chunk -> indices of its computes
    for n, a in enumerate(actions):
        if a.kind in ("F", "B"):
            at_chunk.setdefault(a.chunk, []).append(n)
    gathers, reduces = [], []
    for n, op, c in plan:
        if op == GATHER:
            use = at_chunk[c][bisect.bisect_left(at_chunk[c], n)]
            gathers.append(done[use] - done[n])
        elif op == REDUCE_SCATTER:
            reduces.append(n)
    leads = [done[b] - done[a] for a, b in zip(reduces, reduces[1:] + [len(actions)])]
    pending: set[int] = set()
    peak = 0
    at: dict[int, list[tuple[str, int]]] = {}
    for n, op, c in plan:
        at.setdefault(n, []).append((op, c))
    for n, a in enumerate(actions + [None]):
        for op, c in at.get(n, ()):
            if op == REDUCE_SCATTER:
                pending.discard(c)
        if a is not None and a.kind == "B":
            pending.add(a.chunk)
            peak = max(peak, len(pending))
    return GatherStats(gather_leads=tuple(gathers), reduce_leads=tuple(leads),
                       peak_gathered=max_gathered(actions, plan), peak_pending=peak)
