"""The README's main command: `autopar demo` plans GPT-3 175B and trains a tiny GPT on local
CPU ranks whose losses must match the single-device run (the demo exits non-zero otherwise).

Run through the CLI's `main` in this process: the demo's ranks then fork from the test session's
warm spawn server (no second interpreter, fork server and cold capture per rank: 22 -> ~8 s);
the console script in a fresh interpreter is what tests/passes/test_quiet_cli.py and
.ci/install-check run."""
import pytest

from autopar.cli import main


@pytest.mark.slow
def test_demo_runs_and_losses_match(capsys):
    rc = main(["demo", "--ranks", "4", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "autopar plan for gpt3-175b on 1536 GPUs" in out
    assert "losses match the single-device run" in out
