"""Preemption: SIGTERM / SIGUSR1 on any rank → every rank checkpoints at the same step
boundary and leaves cleanly.

SLURM's `--signal=USR1@120` (slurm.sbatch sets it) and a scheduler's SIGTERM reach one or
all ranks at any moment, usually mid-step. The handler only records the signal; at each step
boundary `Preemption.stop_now()` agrees over every rank (one all-reduce of a flag, MAX, on the
checkpoint's gloo group) whether any rank was signalled, so all ranks stop after the same step,
save the same checkpoint and exit 0 — torchrun then sees a clean exit, and the next job
resumes from that step (Megatron-LM's `--exit-signal-handler` does the same with its
`DistributedSignalHandler`).
"""
from __future__ import annotations

import signal
from typing import Any

import torch
import torch.distributed as dist


SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Installs handlers for `signals` on construction (main thread); `restore()` puts the
    previous ones back."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum

    def stop_now(self, group: Any = None) -> bool:
        """Whether any rank has been signalled: collective over `group` (every rank calls it
        at the same step boundary); False on one process unless this one was."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


# ~ a checkpoint every few minutes to an hour of training at typical step times; not fitted
# (torchtitan's default interval is 500 steps as well; Megatron-LM has none)
DEFAULT_SAVE_EVERY = 500


class CheckpointSaver:
    """A training loop's checkpoints (autopar/launch.py): every `every` steps, after the step
    `last` − 1, and at a preemption signal; `after_step` says whether to stop (preempted, the
    checkpoint of this step written and committed on every rank). Without a path it neither
    saves nor installs handlers."""

    def __init__(self, runner: Any, path: str | None, *, every: int, last: int, keep: int = 2,
                 async_save: bool = True):
        self.runner, self.path, self.every, self.last = runner, path, every, last
        self.keep, self.async_save = keep, async_save
        self.preemption = Preemption() if path else None
        multi = path and dist.is_initialized() and dist.get_world_size() > 1
        # imported here: the checkpoint store loads torch.distributed.checkpoint (~1 s a
        # process), which a run without --checkpoint never needs
        from autopar.runtime.ckpt_store import checkpoint_group
        self.group = checkpoint_group(runner.pg, "vote") if multi else None

    def after_step(self, step: int, user_state: dict | None = None) -> bool:
        if self.preemption is None:
            return False
        stop = self.preemption.stop_now(self.group)
        if stop or (step + 1) % self.every == 0 or step + 1 == self.last:
            self.runner.save_checkpoint(self.path, user_state=user_state, keep=self.keep,
                                        async_save=self.async_save and not stop)
        if stop:
            self.runner.wait_for_checkpoint()
            if getattr(self.runner.pg, "rank", 0) == 0:
                print(f"preempted (signal {self.preemption.received or 'on another rank'}): "
                      f"saved step {step + 1} to {self.path}; exiting", flush=True)
        return stop
