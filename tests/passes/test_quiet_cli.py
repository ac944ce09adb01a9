"""A user's terminal shows autopar's words, not torch's (issue 30): `autopar plan` of a model
file that imports its sibling module prints nothing on stderr (no pytree FutureWarnings), and
an unexportable model gives the one-line error alone (not torch's ~50-line graph dump first).
One subprocess each, as the user runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MODEL = '''
import torch
from my_sizes import VOCAB
from autopar.examples.gpt import GPT, GPTConfig

def tiny():
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))

class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        if h.sum() > 0:
            h = h * 2
        return self.out(h)

def branchy():
    return Branchy()
'''
ARGS = ["--gpus", "2", "--batch", "2", "--seq", "16", "--cluster", "local-cpu"]


def _autopar(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "autopar.cli", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_plan_is_silent_on_stderr_and_an_unexportable_model_is_one_line(tmp_path):
    (tmp_path / "sub").mkdir()                 # run from elsewhere: the sibling is found
    (tmp_path / "sub" / "model.py").write_text(MODEL)
    (tmp_path / "sub" / "my_sizes.py").write_text("VOCAB = 64\n")
    ok = _autopar(tmp_path, "plan", "sub/model.py:tiny", *ARGS)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr[-3000:]
    assert "autopar plan for" in ok.stdout
    bad = _autopar(tmp_path, "plan", "sub/model.py:branchy", *ARGS)
    lines = bad.stderr.splitlines()
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr[-3000:]
    assert lines[0].startswith("autopar: error: autopar could not capture the model")
    assert "model.py:" in lines[0] and "if h.sum() > 0" in lines[0] and "torch.where" in lines[0]


def test_cutting_a_ranks_chunks_warns_nothing():
    """A rank's chunks are cut from a deep copy of the captured graph, which torch 2.13 copies
    through its own deprecated pytree check: a FutureWarning per chunk on every rank (the log
    of `autopar tune` had one per candidate and rank). None now."""
    import warnings

    from autopar.build import build_program
    from programs import make_plan, make_program
    prog, _ = make_program("llama_style", make_plan(t=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert build_program(prog, "fp32").chunks(0, weights=False)
