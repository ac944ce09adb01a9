"""What launch.py prints and records while it trains: the learning-rate schedule and the
per-step log line (rank 0).

    step 12/1000  loss 6.81234  1.52 s/step  43.1k tok/s  MFU 38.2% (plan 41.0%)  lr 2.9e-04
        grad-norm 0.812  peak-mem 12.3 GiB

- lr_at: linear warm-up over --warmup-steps, then cosine or linear decay to
  min_lr_ratio · lr at the last step (or constant); a pure function of the step, so a resumed
  job continues the schedule with nothing saved.
- StepLog: the line above, and with --metrics FILE one JSON object per line (the same
  fields, in SI units). tokens/s = global batch · sequence / measured step time; the measured
  MFU is the plan's predicted MFU scaled by predicted / measured step time (the same model
  FLOPs and peak, so the two are comparable by construction).
"""
from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

import torch

DECAYS = ("cosine", "linear", "constant")


def add_arguments(ap: Any) -> None:
    """launch.py's schedule, evaluation and logging options."""
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="linear learning-rate warm-up from lr/warmup to lr")
    ap.add_argument("--lr-decay", choices=DECAYS, default="constant",
                    help="after warm-up: cosine or linear decay to --min-lr-ratio · lr at "
                         "--steps, or constant")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1,
                    help="the final learning rate as a fraction of --lr")
    ap.add_argument("--eval-data", default=None,
                    help="held-out data (same forms as --data); its loss every --eval-every "
                         "steps")
    ap.add_argument("--eval-every", type=int, default=100, help="steps between eval losses")
    ap.add_argument("--eval-batches", type=int, default=4,
                    help="global batches averaged per eval loss")
    ap.add_argument("--metrics", default=None,
                    help="append one JSON object per step to this file (rank 0)")


def check_arguments(args: Any) -> None:
    """One-line ValueErrors for the options above."""
    if args.warmup_steps < 0 or (args.warmup_steps and args.warmup_steps >= args.steps):
        raise ValueError(f"--warmup-steps {args.warmup_steps}: must be in [0, --steps "
                         f"{args.steps}); pass fewer warm-up steps or more --steps")
    if not 0.0 <= args.min_lr_ratio <= 1.0:
        raise ValueError(f"--min-lr-ratio {args.min_lr_ratio}: must be in [0, 1] (the final "
                         f"learning rate as a fraction of --lr)")
    if not 0 <= args.lr < math.inf:
        raise ValueError(f"--lr {args.lr}: must be a finite number >= 0 (the peak learning "
                         f"rate); pass e.g. --lr 3e-4")
    if args.metrics and not Path(args.metrics).resolve().parent.is_dir():
        raise ValueError(f"--metrics {args.metrics}: its directory "
                         f"{Path(args.metrics).resolve().parent} does not exist; create it or "
                         f"pass a path in an existing directory")
    for name in ("eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a "
                             f"positive integer")


def lr_at(step: int, *, lr: float, steps: int, warmup_steps: int = 0, decay: str = "cosine",
          min_lr_ratio: float = 0.1) -> float:
    """The learning rate of optimizer step `step` (0-based) of `steps` (module docstring)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant" or steps - warmup_steps <= 1:
        return lr
    frac = min(1.0, (step - warmup_steps) / (steps - warmup_steps - 1))
    shape = 0.5 * (1.0 + math.cos(math.pi * frac)) if decay == "cosine" else 1.0 - frac
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * shape)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): the CUDA allocator's peak on a GPU, else the process's
    peak resident set (ru_maxrss, KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


class StepLog:
    """Rank 0's per-step line and JSONL record (module docstring); other ranks pass out=None
    and metrics=None and record nothing."""

    def __init__(self, plan: Any, *, total_steps: int, out: TextIO | None = sys.stdout,
                 metrics: str | Path | None = None):
        self.plan, self.total_steps, self.out = plan, total_steps, out
        self.tokens_per_step = plan.global_batch_size * plan.seq_len
        self.metrics = open(metrics, "a") if metrics else None

    def record(self, step: int, *, loss: float, step_time_s: float, lr: float,
               grad_norm: float | None, device: torch.device,
               eval_loss: float | None = None) -> dict[str, Any]:
        """Print and write one step's record; the record."""
        pred = self.plan.predicted
        mem, kind = peak_memory_bytes(device)
        rec = {"step": step, "loss": loss, "step_time_s": step_time_s,
               "tokens_per_s": self.tokens_per_step / step_time_s,
               "mfu": pred.mfu * pred.step_time_s / step_time_s, "mfu_predicted": pred.mfu,
               "step_time_s_predicted": pred.step_time_s, "lr": lr, "grad_norm": grad_norm,
               "peak_memory_bytes": mem, "peak_memory_kind": kind}
        if eval_loss is not None:
            rec["eval_loss"] = eval_loss
        if self.out is not None:
            print(self.line(rec), file=self.out, flush=True)
        if self.metrics is not None:
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()
        return rec

    def line(self, rec: dict[str, Any]) -> str:
        norm = "off" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3g}"
        width = len(str(self.total_steps))
        text = (f"step {rec['step']:>{width}}/{self.total_steps}  loss {rec['loss']:.5f}  "
                f"{_seconds(rec['step_time_s'])}/step  {_si(rec['tokens_per_s'])} tok/s  "
                f"MFU {rec['mfu']:.1%} (plan {rec['mfu_predicted']:.1%})  lr {rec['lr']:.3g}  "
                f"grad-norm {norm}  peak-mem {rec['peak_memory_bytes'] / 2**30:.2f} GiB")
        if "eval_loss" in rec:
            text += f"  eval-loss {rec['eval_loss']:.5f}"
        return text

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def _seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1.0 else f"{s:.2f} s"


def _si(x: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"
