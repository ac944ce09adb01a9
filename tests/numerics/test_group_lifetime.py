"""A runner's process groups end with the runner: after the last reference to it goes, no
gloo worker thread of its groups is left (nor of the checkpoint groups its saves made), so
none can outlive `destroy_process_group` into the interpreter's teardown. One that did
released a finished collective's tensors there, took the finalizing interpreter's GIL and
aborted the process (SIGABRT, "terminate called without an active exception": the restarted
torchrun attempt of test_fault.py, 4 of 59 runs on a loaded host)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopar.testing import spawn

from programs import make_data, make_plan, make_program, with_zero

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                 reason="counts threads by /proc/self/task (Linux)")]


def _gloo_threads() -> int:
    """This process's threads that belong to gloo process groups (their workers and loops)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:   # a thread that ended while listed
            continue
    return sum(n.startswith(("pt_gloo", "gloo_")) for n in names)


def _trained_runner(rank, zero, precision, tmp):
    """A d = 2 runner after a step, a checkpoint save and a full state dict."""
    plan = with_zero(make_plan(d=2, m=2, layers=2), zero)
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                          precision=precision, timeout_s=30)
    x, y = make_data(plan, vocab)[0]
    share = plan.global_batch_size // plan.d
    runner.train_step(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
    runner.save_checkpoint(str(Path(tmp) / f"ckpt{zero}{precision}"))
    runner.full_state_dict()
    return runner


def _lifetimes(rank, world, tmp):
    # the default group's threads start with its first collective (torch 2.13: one gloo
    # thread before it, three after): the base is counted once it has run one
    dist.all_reduce(torch.zeros(1))
    counts = {"default group only": _gloo_threads()}
    for zero, precision in ((0, "fp32"), (1, "fp32"), (0, "bf16"), (1, "bf16")):
        runner = _trained_runner(rank, zero, precision, tmp)
        counts[f"zero {zero} {precision}: alive"] = _gloo_threads()
        runner.release_groups()   # its layout's groups and its checkpoint groups
        del runner                # no collection: reference counts alone must free them
        counts[f"zero {zero} {precision}: released"] = _gloo_threads()
    # a script's end (test_fault.py's): the job's groups destroyed, then the runner let go
    runner = _trained_runner(rank, 1, "fp32", tmp)
    dist.destroy_process_group()
    del runner
    counts["destroyed"] = _gloo_threads()
    return counts


def test_a_released_runner_leaves_no_process_group_threads(tmp_path):
    for counts in spawn(_lifetimes, 2, str(tmp_path), timeout_s=240):
        base = counts["default group only"]
        assert base > 0, counts            # the default group's threads are what is counted
        for key, n in counts.items():
            if key.endswith("alive"):
                assert n > base, counts      # the runner's groups and the checkpoint group
            elif key.endswith("released"):
                assert n == base, counts
        assert counts["destroyed"] == 0, counts
