"""Checkpoints under failure (issue 27): a rank killed during an asynchronous write, a
preemption signal to one rank, and damaged or copied checkpoint directories.

- async: rank 1's writer process dies once its files are written, before the commit: both
  ranks' waits raise, and the link still names the previous version, whose files all match
  their checksums;
- SIGTERM to rank 1 mid-step: both ranks save at the same step and return; the job resumed
  from that checkpoint ends with the losses and weights of the uninterrupted run;
- a truncated file, a missing file: one line naming the file (and the previous kept version is
  used when there is one); a `cp -rL` copy loads, and its first save adopts it; a checkpoint
  in the format before sharded saves (gathered rows, no checksums) still loads, bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from autopar.runtime import ckpt_store
from autopar.runtime.checkpoint import read_layout
from autopar.runtime.preempt import CheckpointSaver
from autopar.testing import spawn

from programs import STEPS, make_data, make_plan, make_program, train_single_device, with_zero

pytestmark = [pytest.mark.distributed]

PLAN = with_zero(make_plan(d=2, m=2, layers=2), 1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _runner(plan=PLAN):
    torch.set_num_threads(1)
    prog, vocab = make_program("gpt", plan)
    return prog.compile(optimizer=_sgd, timeout_s=20), make_data(plan, vocab)


def _share(runner, plan, x, y):
    n = plan.global_batch_size // plan.d
    return x[runner.dp_rank * n:(runner.dp_rank + 1) * n], y[runner.dp_rank * n:(runner.dp_rank + 1) * n]


def _dies_in_async_write(rank, world, path):
    runner, batches = _runner()
    runner.train_step(*_share(runner, PLAN, *batches[0]))
    runner.save_checkpoint(path, async_save=True)
    runner.wait_for_checkpoint()                           # step 1: committed
    runner.train_step(*_share(runner, PLAN, *batches[1]))
    if rank == 1:       # its writer process dies once its files are written, before the commit
        os.environ["AUTOPAR_CKPT_FAULT"] = "exit-after-files"
    runner.save_checkpoint(path, async_save=True)          # returns once staged
    try:
        runner.wait_for_checkpoint()
    except Exception as exc:  # noqa: BLE001 - the writer's (or its dead peer's) error
        return type(exc).__name__, str(exc)
    return "committed", ""


def test_rank_killed_mid_async_write_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    out = spawn(_dies_in_async_write, 2, str(path), timeout_s=200, pg_timeout_s=15)
    assert out[1][0] == "CheckpointWriteError" and "writer process of rank 1 died" in out[1][1]
    assert out[0][0] == "CheckpointWriteError", out
    version, skipped = ckpt_store.choose_version(path, read_layout)
    assert read_layout(version)["step"] == 1 and not skipped
    assert any(p.name.startswith("ckpt.tmp-") for p in tmp_path.iterdir())   # the torn one


def _preempted(rank, world, path, load):
    runner, batches = _runner()
    start = runner.load_checkpoint(path) if load else 0
    saver = CheckpointSaver(runner, path, every=100, last=STEPS, keep=2)
    losses, stopped = [], None
    for step in range(start, STEPS):
        if not load and rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGTERM)           # mid-run, on one rank only
        losses.append(runner.train_step(*_share(runner, PLAN, *batches[step])))
        if saver.after_step(step):
            stopped = step + 1
            break
    saver.preemption.restore()
    return start, stopped, losses, runner.full_state_dict()


def test_sigterm_to_one_rank_saves_everywhere_at_one_step_and_resumes_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    first = spawn(_preempted, 2, path, False, timeout_s=200)
    assert [s for _, s, _, _ in first] == [2, 2], first         # both stopped after step 1
    assert read_layout(path)["step"] == 2
    second = spawn(_preempted, 2, path, True, timeout_s=200)
    assert [s for s, *_ in second] == [2, 2]
    ref = train_single_device("gpt", PLAN, _sgd)
    losses = first[0][2] + second[0][2]
    torch.testing.assert_close(losses, ref.losses, rtol=1e-4, atol=1e-5)
    for key, want in ref.state.items():
        torch.testing.assert_close(second[0][3][key], want, rtol=1e-4, atol=1e-5)


def _damaged(rank, world, tmp):
    plan = make_plan(layers=2)
    runner, batches = _runner(plan)
    path, out = Path(tmp) / "ckpt", {}
    for step in range(2):
        runner.train_step(*batches[step])
        runner.save_checkpoint(path, keep=2)                # versions of step 1 and step 2
    newest = path.resolve()
    victim = sorted(newest.glob("*.distcp"))[0]
    shutil.copy(victim, Path(tmp) / "good.distcp")
    with open(victim, "r+b") as f:                          # truncated
        f.truncate(victim.stat().st_size // 2)
    out["fallback_step"] = runner.load_checkpoint(path)
    out["fallback_skipped"] = ckpt_store.choose_version(path, read_layout)[1]
    single = Path(tmp) / "single"
    runner.save_checkpoint(single)
    next(single.resolve().glob("*.distcp")).unlink()        # missing, nothing older kept
    try:
        runner.load_checkpoint(single)
    except ValueError as exc:
        out["missing"] = str(exc)
    shutil.copy(Path(tmp) / "good.distcp", victim)
    copy = Path(tmp) / "copied"
    subprocess.run(["cp", "-rL", str(path), str(copy)], check=True)
    out["copied_step"] = runner.load_checkpoint(copy)
    runner.save_checkpoint(copy)                            # adopted: a link again
    out["copied_saved"] = (copy.is_symlink(), runner.load_checkpoint(copy))
    # the format before sharded saves: rows of split tensors, gathered, no file checksums
    old, want = Path(tmp) / "old", runner.full_state_dict()
    runner.regime.shard_state = lambda: None
    runner.save_checkpoint(old)
    del runner.regime.shard_state
    layout_file = old.resolve() / "autopar_layout.json"
    layout = json.loads(layout_file.read_text())
    del layout["files"]
    layout_file.write_text(json.dumps(layout))
    runner.train_step(*batches[2])
    runner.load_checkpoint(old)
    out["old_format"] = all(torch.equal(want[k], v) for k, v in runner.full_state_dict().items())
    return out


def test_truncated_missing_and_copied_checkpoints(tmp_path):
    (out,) = spawn(_damaged, 1, str(tmp_path), timeout_s=200)
    assert out["fallback_step"] == 1                        # the previous kept version
    (line,) = out["fallback_skipped"]
    assert "truncated" in line and ".distcp" in line and "\n" not in line, line
    missing = out["missing"]
    assert "is missing" in missing and ".distcp" in missing and "copy" in missing
    assert "\n" not in missing, missing
    assert out["copied_step"] == 2 and out["copied_saved"] == (True, 2)
    assert out["old_format"]
