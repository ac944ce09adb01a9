"""The runtime executes exactly the saved source of its chunks: on 2 gloo ranks, an edit to a
saved chunk file (the loss scaled by 2) changes the losses the Runner reports."""
from __future__ import annotations

import pytest
import torch

from autopar.testing import spawn

from programs import make_data, make_plan, make_program

pytestmark = pytest.mark.distributed


def _losses_from_dir(rank, world, plan, program_dir):
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(program_dir=program_dir, timeout_s=60)
    x, y = make_data(plan, vocab)[0]
    return runner.train_step(x, y)


def test_runtime_executes_the_saved_source(tmp_path):
    plan = make_plan(p=2, m=2, layers=2)
    prog, _ = make_program("gpt", plan)
    prog.save(tmp_path)
    before = spawn(_losses_from_dir, 2, plan, str(tmp_path), timeout_s=180)
    # Edit the generated last chunk: scale the loss by 2 in its return statement.
    path = tmp_path / "chunk_01.py"
    src = path.read_text()
    assert "    return cross_entropy_loss\n" in src
    path.write_text(src.replace("    return cross_entropy_loss\n",
                                "    return cross_entropy_loss * 2.0\n"))
    after = spawn(_losses_from_dir, 2, plan, str(tmp_path), timeout_s=180)
    assert before[0] == before[1] and after[0] == after[1]
    torch.testing.assert_close(after[0], 2.0 * before[0], rtol=1e-6, atol=0.0)
