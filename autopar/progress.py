"""A progress display for long commands (`autopar scale`, each rank-0 compile): tqdm's bar on
stderr when stderr is a terminal, nothing otherwise (piped logs and tests stay clean)."""
from __future__ import annotations

import sys
import threading
from typing import Any


def tqdm_bar(**kwargs: Any) -> Any:
    """tqdm(**kwargs) whose lock is a thread lock where nothing set one before: tqdm's default
    also makes a multiprocessing lock, whose semaphore a spawned rank (autopar.testing.spawn
    ends them with os._exit) leaves registered, so the resource tracker warned of "leaked
    semaphore objects" at the end of `autopar calibrate`. The bars here are one rank's."""
    from tqdm import tqdm
    if not hasattr(tqdm, "_lock"):
        tqdm.set_lock(threading.RLock())
    return tqdm(**kwargs)


class Progress:
    """`start(label)` as each of `total` items begins (the previous one counts as done);
    `close()` at the end."""

    def __init__(self, *, total: int, desc: str, enabled: bool = True):
        self._bar: Any = None
        self._started = 0
        if enabled and sys.stderr.isatty():
            try:
                self._bar = tqdm_bar(total=total, desc=desc, leave=False, file=sys.stderr,
                                     dynamic_ncols=True)
            except ImportError:      # a dependency in pyproject; absent only in odd installs
                return

    def start(self, label: str) -> None:
        if self._bar is None:
            return
        if self._started:
            self._bar.update(1)
        self._started += 1
        self._bar.set_postfix_str(label)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
