"""A progress display for long commands (`autopar scale`, each rank-0 compile): tqdm's bar on
stderr when stderr is a terminal, nothing otherwise (piped logs and tests stay clean)."""
from __future__ import annotations

import sys
from typing import Any


class Progress:
    """`start(label)` as each of `total` items begins (the previous one counts as done);
    `close()` at the end."""

    def __init__(self, *, total: int, desc: str, enabled: bool = True):
        self._bar: Any = None
        self._started = 0
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:      # a dependency in pyproject; absent only in odd installs
                return
            self._bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr,
                             dynamic_ncols=True)

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
