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


def test_a_bar_makes_no_multiprocessing_lock():
    """tqdm's default lock makes a multiprocessing semaphore, which a spawned rank (ended by
    os._exit) leaves registered: `autopar calibrate` ended with the resource tracker's
    "leaked semaphore objects" warning. A fresh interpreter whose semaphores refuse to be
    made draws a bar with `tqdm_bar`."""
    import subprocess
    code = ("import io, multiprocessing.synchronize as s\n"
            "def refuse(*a, **k): raise AssertionError('a multiprocessing lock was made')\n"
            "s.SemLock.__init__ = refuse\n"
            "from autopar.progress import tqdm_bar\n"
            "bar = tqdm_bar(total=2, desc='calibrate', file=io.StringIO()); bar.update(2)\n"
            "bar.close(); print('drawn')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "drawn" in done.stdout, done.stderr
