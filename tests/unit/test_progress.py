"""autopar.progress: a tqdm bar on a terminal's stderr, nothing when piped or disabled."""
from __future__ import annotations

import io
import sys

from autopar.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _shown(monkeypatch, **kwargs) -> str:
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    bar = Progress(total=3, desc="compile", **kwargs)
    for label in ("capture (torch.export)", "process groups", "done"):
        bar.start(label)
    bar.close()
    return err.getvalue()


def test_a_terminal_sees_the_phases(monkeypatch):
    shown = _shown(monkeypatch)
    assert "compile" in shown and "capture (torch.export)" in shown and "2/3" in shown


def test_disabled_or_piped_shows_nothing(monkeypatch):
    assert _shown(monkeypatch, enabled=False) == ""
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    bar = Progress(total=2, desc="compile")
    bar.start("capture")
    bar.close()
    assert piped.getvalue() == ""
