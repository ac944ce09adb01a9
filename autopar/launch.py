"""The training job of a saved program: what the generated `launch.py` runs on every rank.

    torchrun --standalone --nproc-per-node=N launch.py --data tokens.bin --steps 1000 \\
        --checkpoint ckpt [--model my_model.py:factory]

1. The model: `file.py:factory` (autopar.factory; by default the one `autopar build` was
   given), built after seeding torch with --init-seed, so every rank starts from the same
   weights.
2. The plan: plan.json beside launch.py. When the job runs on another number of ranks — a
   node lost under `torchrun --nnodes=MIN:MAX`, or a relaunch on fewer GPUs — rank 0 plans
   again for the launched world size with the same global batch, sequence and cluster (and
   the pins `autopar build` was given, the parallel degrees excepted), and every rank takes
   its plan. The saved chunk files are then not used (they are for the other rank count).
3. Compile; resume from --checkpoint when it exists: weights and optimizer state resharded to
   this plan, the data's read position restored (autopar.data). A fresh job with --pretrained
   DIR starts from the weights of a `transformers` save_pretrained directory instead, each rank
   reading only its slices (Runner.load_pretrained).
4. Train until --steps optimizer steps in all (counted from the first run of the job), each
   data-parallel replica reading its rows of every global batch from --data; print each
   step's loss (rank 0); save every --save-every steps (default 500) and after the last,
   each rank writing its own shard on a background thread (--async-save, --keep versions);
   SIGTERM / SIGUSR1 on any rank: every rank saves after the same step and exits 0
   (autopar.runtime.preempt.CheckpointSaver).
5. --export PATH: the trained weights as the single-device state dict (torch.save, rank 0).

Bad input ends in one line, `launch.py: error: ...` (exit code 2), naming the value, the rule
and the fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.data import BatchShape, open_batches
from autopar.factory import UserModel, load_factory
from autopar.plan import Plan
from autopar.runtime.dist import DEFAULT_TIMEOUT_S, PeerError, init_distributed
from autopar.runtime.preempt import DEFAULT_SAVE_EVERY, CheckpointSaver

BUILD_FILE = "build.json"
# pins that depend on the GPU count: solved again when the job re-plans for another count
DEGREE_PINS = ("t", "p", "d", "v", "microbatch_group")


def build_info(model: str | None, pins: dict[str, Any], precision: str = "fp32") -> str:
    """The JSON of build.json: the factory `autopar build` was given (absolute path), the
    pins it planned with and the precision its chunks were generated for."""
    if model is not None:
        path, _, fn = model.rpartition(":")
        model = f"{Path(path).resolve()}:{fn}"
    return json.dumps({"model": model, "pins": pins, "precision": precision}, indent=2)


def parse_args(argv: list[str] | None, default_model: str | None,
               default_precision: str = "fp32") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch.py", description="Train this saved autopar "
                                 "program under torchrun (see autopar/launch.py).")
    ap.add_argument("--model", default=default_model, required=default_model is None,
                    help="file.py:factory (default: the factory autopar build was given)")
    ap.add_argument("--data", required=True,
                    help="a flat uint16/uint32 token file (nanoGPT/Megatron .bin), "
                         "'file.py:function' (returns an iterable of global batches), or "
                         "'random' (random tokens)")
    ap.add_argument("--data-dtype", choices=["uint16", "uint32"], default=None,
                    help="token dtype of the file (default: uint16 if the vocabulary fits)")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the sample order")
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size (default: model.config.vocab_size)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps in all")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="clip the global gradient norm (0: no clipping)")
    ap.add_argument("--precision", default=default_precision, choices=["fp32", "bf16"],
                    help="default: the precision the program was built for (build.json)")
    ap.add_argument("--checkpoint", default=None, help="checkpoint path (resumed if present)")
    ap.add_argument("--pretrained", default=None,
                    help="a transformers save_pretrained directory (safetensors) to start from "
                         "when no checkpoint is resumed")
    ap.add_argument("--save-every", type=int, default=DEFAULT_SAVE_EVERY,
                    help="optimizer steps between checkpoints (and after the last step, and at "
                         "SIGTERM / SIGUSR1)")
    ap.add_argument("--keep", type=int, default=2,
                    help="checkpoint versions kept; a load falls back to an older one when the "
                         "newest is damaged")
    ap.add_argument("--async-save", default=True, action=argparse.BooleanOptionalAction,
                    help="write checkpoints on a background thread while training goes on")
    ap.add_argument("--export", default=None,
                    help="write the trained single-device state dict here (torch.save)")
    ap.add_argument("--losses-out", default=None, help="write the losses as JSON (rank 0)")
    ap.add_argument("--init-seed", type=int, default=0,
                    help="torch seed before the factory runs (the same on every rank)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds any collective may wait for a peer")
    args = ap.parse_args(argv)
    for name in ("steps", "save_every", "keep"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a "
                             f"positive integer")
    return args


def main(program_dir: str | Path, argv: list[str] | None = None) -> int:
    """Run the job (module docstring); the exit code."""
    program_dir = Path(program_dir)
    try:
        return _run(program_dir, argv)
    except (ValueError, PeerError) as err:
        where = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
        kind = "" if isinstance(err, ValueError) else f"{type(err).__name__}: "
        print(f"launch.py: error: {where}{kind}{err}", file=sys.stderr, flush=True)
        return 2 if isinstance(err, ValueError) else 1


def _run(program_dir: Path, argv: list[str] | None) -> int:
    build = _read_build(program_dir)
    args = parse_args(argv, build.get("model"), build.get("precision", "fp32"))
    saved = autopar.load_plan(program_dir / "plan.json")   # a bad file: one line naming it
    if os.environ.get("WORLD_SIZE", str(saved.gpus)) == str(saved.gpus):   # the saved chunks
        from autopar.codegen import check_saved_precision  # run (codegen imports this module)
        check_saved_precision(program_dir, saved, args.precision)
    torch.manual_seed(args.init_seed)
    user = load_factory(args.model)
    init_distributed(timeout_s=args.timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    plan, chunk_dir = saved, program_dir
    if world != saved.gpus:
        plan, chunk_dir = replan(saved, user, world, build.get("pins", {})), None
        if rank == 0:
            print(f"launch.py: {world} ranks, plan.json is for {saved.gpus}: re-planned for "
                  f"{world} with the same global batch {saved.global_batch_size}\n{plan}",
                  flush=True)
    runner = _compile(plan, user, args, chunk_dir)
    vocab = args.vocab or getattr(getattr(user.model, "config", None), "vocab_size", None)
    data = open_batches(args.data, BatchShape(
        global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
        dp_rank=runner.dp_rank, dp_size=runner.dp_size),
        vocab_size=vocab, seed=args.data_seed, dtype=args.data_dtype)
    start = _resume(runner, data, args.checkpoint, rank)
    if start == 0 and args.pretrained:
        runner.load_pretrained(args.pretrained)
        if rank == 0:
            print(f"loaded pretrained weights from {args.pretrained}", flush=True)
    losses = []
    saver = CheckpointSaver(runner, args.checkpoint, every=args.save_every, last=args.steps,
                            keep=args.keep, async_save=args.async_save)
    for step in range(start, args.steps):
        x, y = data.next()
        losses.append(runner.train_step(x, y))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.5f}", flush=True)
        if saver.after_step(step, user_state={"data": data.state_dict()}):
            break                       # preempted: saved at this step on every rank
    state = runner.full_state_dict() if args.export else None
    if rank == 0:
        if args.export:
            torch.save(dict(state), args.export)
        if args.losses_out:
            Path(args.losses_out).write_text(json.dumps({"start": start, "losses": losses,
                                                         "world": world}))
    runner.close()   # every rank is done before any leaves; then the groups are destroyed
    return 0


def _read_build(program_dir: Path) -> dict[str, Any]:
    file = program_dir / BUILD_FILE
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc}); rewrite it with autopar build, or "
                         f"delete it and pass --model") from exc


def _example(user: UserModel, plan: Plan) -> tuple[tuple, Any]:
    """(example inputs, example targets) at the plan's micro-batch size and sequence."""
    inputs = user.inputs(seq_len=plan.seq_len, batch=plan.micro_batch_size,
                         option="the plan's seq_len")
    targets = user.example_targets
    return inputs, (torch.zeros_like(inputs[0]) if targets is None else targets)


def replan(saved: Plan, user: UserModel, world: int, pins: dict[str, Any]) -> Plan:
    """The plan for `world` ranks with saved's global batch, sequence, cluster and attention
    kernel and the non-degree pins: solved on rank 0, the same on every rank (a planning
    error is raised on every rank)."""
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = ("plan", _solve(saved, user, world, pins).to_json())
        except ValueError as err:
            message[0] = ("error", str(err))
    dist.broadcast_object_list(message, src=0)
    kind, text = message[0]
    if kind == "error":
        raise ValueError(f"re-planning for {world} ranks (plan.json is for {saved.gpus}): "
                         f"{text}")
    return Plan.from_json(text)


def _solve(saved: Plan, user: UserModel, world: int, pins: dict[str, Any]) -> Plan:
    cluster = autopar.get_cluster(saved.cluster)
    if saved.predicted.attention and saved.predicted.attention != cluster.attention:
        cluster = dataclasses.replace(cluster, attention=saved.predicted.attention)
    inputs, targets = _example(user, saved)
    keep = {k: v for k, v in pins.items() if k not in DEGREE_PINS}
    prog = autopar.parallelize(user.model, gpus=world, example_inputs=inputs,
                               loss_fn=user.loss(), example_targets=targets,
                               global_batch_size=saved.global_batch_size, cluster=cluster,
                               name=saved.model, **keep)
    return prog.plan


def _compile(plan: Plan, user: UserModel, args: argparse.Namespace, chunk_dir: Path | None):
    inputs, targets = _example(user, plan)
    prog = autopar.parallelize(user.model, gpus=plan.gpus, example_inputs=inputs,
                               loss_fn=user.loss(), example_targets=targets, plan=plan)
    lr, wd = args.lr, args.weight_decay
    return prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd),
                        max_grad_norm=args.max_grad_norm or None, precision=args.precision,
                        program_dir=chunk_dir, timeout_s=args.timeout)


def _resume(runner: Any, data: Any, checkpoint: str | None, rank: int) -> int:
    """The step to start from: the checkpoint's (weights, optimizer state and the data's read
    position restored), else 0."""
    if not checkpoint or not Path(checkpoint).exists():
        return 0
    from autopar.runtime.checkpoint import read_user_state
    start = runner.load_checkpoint(checkpoint)
    state = read_user_state(runner.checkpoint_version or checkpoint).get("data")
    if state is None:
        raise ValueError(f"--checkpoint {checkpoint}: it holds no data read position (saved "
                         f"by another training loop); pass a new checkpoint path, or resume "
                         f"it with the loop that saved it")
    data.load_state_dict(state)
    if rank == 0:
        print(f"resumed from {checkpoint} at step {start}", flush=True)
    return start
