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
from typing import Any, Callable, Sequence

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
    _check_keep(keep)
    index = [n for n, a in enumerate(actions) if a.kind in ("F", "B")]
    walk = _Walk([actions[n].chunk for n in index], [actions[n].kind for n in index], keep,
                 lookahead, record=True)
    # a compute-list position k is before compute k (index[k]); `after`: right after it
    return [(index[k] + after, op, c) for k, after, op, c in walk.ops]


def _check_keep(keep: Any) -> None:
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"plan_gathers: keep={keep!r} must be a positive integer (chunks "
                         f"gathered at once)")


class _Walk:
    """`plan_gathers` on a rank's computes (chunks[k], kinds[k]), run once at construction,
    with what `gather_stats` reads counted on the way (no plan list needed for it).

    Positions are compute positions: an op at (k, 0) runs before compute k, one at (k, 1)
    right after it. Ops are made in non-decreasing position, so the list is already in the
    order plan_gathers returns. Incremental where the rule allows: a chunk's next use is a
    pointer that moves with k (not a search), and the first missing compute ahead is reused
    while the gathered chunks have not changed (its window only slides by one)."""

    def __init__(self, chunks: list[int], kinds: list[str], keep: int, lookahead: int,
                 record: bool = False) -> None:
        n = len(chunks)
        self.n, self.keep, self.record = n, keep, record
        self.ops: list[tuple[int, int, str, int]] = []
        self.gather_leads: list[int] = []
        self.reduce_at: list[int] = []               # positions of the reduce-scatters, in order
        self.peak_gathered = self.peak_pending = 0
        inf = math.inf
        after: list[float] = [inf] * n                # next compute of the same chunk
        first: dict[int, float] = {}
        for k in range(n - 1, -1, -1):
            c = chunks[k]
            after[k] = first.get(c, inf)
            first[c] = k
        # run_end[k]: the first compute after k of another chunk; the prefetch scan skips a
        # run of one chunk at once (its computes are all gathered or none is)
        run_end = [n] * n
        for k in range(n - 2, -1, -1):
            run_end[k] = k + 1 if chunks[k + 1] != chunks[k] else run_end[k + 1]
        self.next_use = first                        # chunk -> its next compute at or after k
        self.live: list[int] = []
        self.pending: set[int] = set()    # chunks with backward gradients not reduce-scattered
        self.version = 0                  # counts the changes to `live`
        live, pending, next_use = self.live, self.pending, first
        seen_version, seen = -1, None     # the last scan: (from k, its answer), at that version
        for k in range(n):
            c = chunks[k]
            next_use[c] = after[k]
            if c not in live:
                self._gather(c, k, 0, c, c, k)
            # the first compute in (k, k + lookahead] whose chunk is not gathered
            version = self.version
            stop = min(k + 1 + lookahead, n)
            if version == seen_version and seen is not None and seen[1] is not None \
                    and seen[1] > k:
                upcoming = seen[1]
            else:
                j = k + 1
                if version == seen_version and seen is not None and seen[1] is None:
                    j = max(j, seen[0] + 1 + lookahead)   # all before it were gathered
                upcoming = None
                while j < stop:
                    if chunks[j] not in live:
                        upcoming = j
                        break
                    j = run_end[j]
            seen, seen_version = (k, upcoming), version
            if upcoming is not None:                                 # prefetch
                up = chunks[upcoming]
                self._gather(up, k, upcoming - k, c, up, upcoming)
            if kinds[k] == "B":
                pending.add(c)
                if len(pending) > self.peak_pending:
                    self.peak_pending = len(pending)
            if after[k] == inf:
                self._free(c, k + 1, 1)

    def _free(self, c: int, k: int, after: int) -> None:
        if c in self.pending:
            if self.record:
                self.ops.append((k - after, after, REDUCE_SCATTER, c))
            self.reduce_at.append(k)
            self.pending.discard(c)
        if self.record:
            self.ops.append((k - after, after, RELEASE, c))
        self.live.remove(c)
        self.version += 1

    def _gather(self, c: int, k: int, lead: int, busy1: int, busy2: int, before: int) -> None:
        """Gather c before compute k (its use `lead` computes later), freeing a slot if
        needed by a chunk other than busy1/busy2 not needed before `before`: the one whose
        next use is furthest (Belady's rule); nothing if there is none."""
        live = self.live
        if len(live) >= self.keep:
            victim, far = None, before
            for x in live:
                if x != busy1 and x != busy2 and self.next_use[x] > far:
                    victim, far = x, self.next_use[x]
            if victim is None:
                return
            self._free(victim, k, 0)
        if self.record:
            self.ops.append((k, 0, GATHER, c))
        self.gather_leads.append(lead)
        live.append(c)
        self.version += 1
        if len(live) > self.peak_gathered:
            self.peak_gathered = len(live)


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


@dataclass(frozen=True)
class GatherCounts:
    """GatherStats with equal leads counted: ((lead, how many), ...) sorted by lead, for
    gathers and reduce-scatters, and the same peaks: what the cost model reads (its terms sum
    over the leads), small whatever m. `GatherCounts.of(stats)`; `extrapolated` for long
    schedules."""
    gather_leads: tuple[tuple[int, int], ...]
    reduce_leads: tuple[tuple[int, int], ...]
    peak_gathered: int
    peak_pending: int

    @classmethod
    def of(cls, st: GatherStats) -> "GatherCounts":
        return cls(gather_leads=_counted(st.gather_leads), reduce_leads=_counted(st.reduce_leads),
                   peak_gathered=st.peak_gathered, peak_pending=st.peak_pending)

    @property
    def gathers(self) -> int:
        return sum(n for _, n in self.gather_leads)

    @property
    def reduce_scatters(self) -> int:
        return sum(n for _, n in self.reduce_leads)


def least_counts(keep: int, v: int) -> GatherCounts:
    """GatherCounts that the plan of no schedule of v chunks per rank, `keep` gathered at
    once, undercuts in any term the cost model reads (cost/dp_terms.py's exposed gathers and
    reduce-scatters, cost/memory.py's gathered working set): a lower bound for pruning
    before a schedule is walked (cost/search.py).

    - one all-gather of lead 0: nothing is gathered before a rank's first compute;
    - one reduce-scatter of lead 0: a rank's last compute is a backward, after which its
      chunk is released for good, its gradients reduce-scattered at the list's end;
    - peak gathered: chunk 0's first forward opens the list and its last backward (of the last
      micro-batch, behind every other chunk's forward of it) is the last of its computes; it
      can be evicted only when `keep` chunks are live, so the first other chunk gathered joins
      it: at least min(keep, v, 2); with keep >= v nothing is ever evicted and every chunk is
      live at the last micro-batch's first backward: v;
    - peak pending: the last backward's chunk: 1.
    tests/unit/test_search_work.py checks them against the walked plans."""
    gathered = v if keep >= v else min(keep, 2)
    return GatherCounts(gather_leads=((0, 1),), reduce_leads=((0, 1),),
                        peak_gathered=gathered, peak_pending=1)


def _counted(leads: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out: dict[int, int] = {}
    for lead in leads:
        out[lead] = out.get(lead, 0) + 1
    return tuple(sorted(out.items()))


def settled_walks(m: int, period: int, start: int) -> tuple[tuple[int, int, int], int] | None:
    """The three short schedules a long one of m micro-batches is extrapolated from, and how
    many periods past the first it is: ((m0, m0 + period, m0 + 2·period), k) with
    m = m0 + k·period and m0 ≡ m (mod period) from `start` on; None when m is not at least
    three periods past m0 (walk it whole)."""
    m0 = start + (m - start) % period
    if m < m0 + 3 * period:
        return None
    return (m0, m0 + period, m0 + 2 * period), (m - m0) // period


def extrapolated(counts_at: Callable[[int], GatherCounts], m: int, period: int,
                 start: int) -> GatherCounts | None:
    """The GatherCounts of a schedule of m micro-batches from three short ones, or None (walk
    it whole). After its warm-up a schedule repeats every `period` micro-batches (a multiple of
    its own period: p·N serves every schedule here), so its counts grow by the same lead
    counts per period while the warm-up, the cool-down and the peaks stay: counts(m) =
    counts(m0) + k·(counts(m0 + period) − counts(m0)), m = m0 + k·period, m0 ≡ m (mod period)
    from `start` on (or, breadth-first, the same gathers with leads longer by the same computes
    per period: `_grown`). Exact where it is used: the three walks (`settled_walks`) must show
    the same growth and the same peaks, else None. counts_at(m): the walked counts at m
    micro-batches (m ≡ the given m modulo period, so any divisibility m obeys holds)."""
    walks = settled_walks(m, period, start)
    if walks is None:
        return None
    (a, b, c), k = [counts_at(n) for n in walks[0]], walks[1]
    if not (a.peak_gathered == b.peak_gathered == c.peak_gathered
            and a.peak_pending == b.peak_pending == c.peak_pending):
        return None
    leads = [_grown(*(getattr(st, f) for st in (a, b, c)), k)
             for f in ("gather_leads", "reduce_leads")]
    if None in leads:
        return None
    return GatherCounts(gather_leads=leads[0], reduce_leads=leads[1],
                        peak_gathered=a.peak_gathered, peak_pending=a.peak_pending)


def _grown(x: tuple, y: tuple, z: tuple, k: int) -> tuple[tuple[int, int], ...] | None:
    """Lead counts x, y, z at m0, m0 + period, m0 + 2·period grown k periods, or None. Either
    the same leads recur more often (depth-first: each period adds the same counts), or the
    same gathers see longer leads (breadth-first: a reduce-scatter hides under the next
    chunk's pass of m micro-batches: each period adds the same computes to its lead)."""
    dx, dy, dz = dict(x), dict(y), dict(z)
    keys = set(dx) | set(dy) | set(dz)
    grow = {key: dy.get(key, 0) - dx.get(key, 0) for key in keys}
    if all(dz.get(key, 0) - dy.get(key, 0) == grow[key] for key in keys):
        return tuple(sorted((key, n) for key in keys
                            if (n := dx.get(key, 0) + k * grow[key])))
    if len(x) == len(y) == len(z) and all(
            nx == ny == nz and ly - lx == lz - ly for (lx, nx), (ly, ny), (lz, nz) in zip(x, y, z)):
        return tuple((lx + k * (ly - lx), nx) for (lx, nx), (ly, _) in zip(x, y))
    return None


def gather_stats(actions: Sequence[Any], *, keep: int = 2) -> GatherStats:
    """The GatherStats of `plan_gathers(actions, keep=keep)` (only F/B actions matter: a
    rank's compute order, e.g. autopar.schedules.compute_order, is enough)."""
    computes = [a for a in actions if a.kind in ("F", "B")]
    return compute_gather_stats([a.chunk for a in computes], [a.kind for a in computes],
                                keep=keep)


def compute_gather_stats(chunks: list[int], kinds: list[str], *, keep: int = 2) -> GatherStats:
    """`gather_stats` of a rank's computes given as their chunks and kinds ('F' / 'B'), e.g.
    from autopar.schedules.compute_ops: what the cost model asks per configuration."""
    _check_keep(keep)
    walk = _Walk(chunks, kinds, keep, LOOKAHEAD)
    ends = walk.reduce_at[1:] + [walk.n]
    return GatherStats(gather_leads=tuple(walk.gather_leads),
                       reduce_leads=tuple(b - a for a, b in zip(walk.reduce_at, ends)),
                       peak_gathered=walk.peak_gathered, peak_pending=walk.peak_pending)
