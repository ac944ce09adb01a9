"""A CPU rank keeps the memory it frees (autopar/runtime/host_memory.py): counted page faults,
not seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autopar.runtime import host_memory

# a 40 MiB block allocated, touched and freed again and again, as a step's buffers are
# (past glibc's largest dynamic mmap threshold: each reuse of a fresh mapping faults)
_CYCLES = r"""
import ctypes, json, resource, sys
from autopar.runtime.host_memory import _glibc, keep_freed_memory
libc = _glibc()
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
n = 40 << 20
def cycle():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
print(json.dumps({"kept": kept,
                  "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10}))
"""


def _faults(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != host_memory.ENV}
    out = subprocess.run([sys.executable, "-c", _CYCLES, mode], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's mallopt only")
def test_kept_memory_is_reused_without_page_faults():
    system, kept = _faults("system"), _faults("keep")
    assert kept["kept"] is True
    # glibc's defaults map and unmap the block: every 4 KiB page faults at each touch
    assert system["faults"] >= 0.5 * (40 << 20) / 4096, system
    assert kept["faults"] <= system["faults"] / 4, (kept, system)


def test_system_choice_changes_nothing(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "system")
    assert host_memory.keep_freed_memory() is False


def test_bad_choice_is_one_line(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "jemalloc")
    with pytest.raises(ValueError, match=r"AUTOPAR_CPU_MALLOC='jemalloc': must be 'keep'"):
        host_memory.keep_freed_memory()
