"""The README's main command: `autopar demo` plans GPT-3 175B and trains a tiny GPT on local
CPU ranks whose losses must match the single-device run (the demo exits non-zero otherwise)."""
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_and_losses_match():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "demo", "--ranks", "4",
                          "--steps", "2"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "autopar plan for gpt3-175b on 1536 GPUs" in out.stdout
    assert "losses match the single-device run" in out.stdout
