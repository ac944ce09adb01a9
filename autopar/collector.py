"""Python's cyclic garbage collector paused around work that allocates many short-lived,
acyclic objects or that is measured (`collector_paused`). A module of its own, importing
neither torch nor ortools, so that the planner (cost/solver.py), tune's timed steps
(autopar.tuning) and the test helpers' memory accounting (autopar.testing, which runs in
interpreters without ortools) share it."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused(collect_first: bool = False) -> Iterator[None]:
    """The cyclic collector off inside the block, its previous state restored after.
    collect_first: one collection before, so that what the block is measured by does not
    carry the garbage made before it.

    Why each user pauses it: the solve allocates ~10^5 short-lived acyclic tuples (heap
    entries, memory failures, memo keys), each allocation burst triggering collections that
    walk every object alive, torch's and the captured graph's included (~1 s of a 1T solve's
    ~6 s CPU, 2026-11-26); a timed step should not pay for other runners' objects; a
    collection inside a profiled window runs other objects' finalizers there, and what they
    allocate would count as the measured function's."""
    was = gc.isenabled()
    if collect_first:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
