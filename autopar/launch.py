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
   each rank writing its own shard from a background process (--async-save, --keep versions);
   SIGTERM / SIGUSR1 on any rank: every rank saves after the same step and exits 0
   (autopar.runtime.preempt.CheckpointSaver).
5. --export PATH: the trained weights as the single-device state dict (torch.save, rank 0).

Packed documents (autopar/documents.py): `--eod ID` cuts every row at its end-of-document
tokens (`--documents`: the data function yields (inputs, targets, doc_ids) instead); the model
then receives per-document position_ids and the block-diagonal causal mask, each row's
documents balanced over the context ranks. A program built without documents is compiled
again in memory with them (its saved chunks take input_ids alone); one `autopar build
--mean-doc-len N` wrote needs --eod or --documents. A re-plan prices the documents at
build.json's mean length, else --mean-doc-len, else the --data file's (tokens per EOD).

Bad input ends in one line, `launch.py: error: ...` (exit code 2), naming the value, the rule
and the fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.data import BatchShape, open_batches
from autopar.factory import UserModel, load_factory
from autopar.plan import Plan
from autopar import train_log
from autopar.runtime.dist import DEFAULT_TIMEOUT_S, PeerError, init_distributed
from autopar.runtime.preempt import DEFAULT_SAVE_EVERY, CheckpointSaver
from autopar.saved_program import check_saved_precision, read_build
from autopar.user_errors import OneLineParser, quiet_torch_warnings, report

# pins that depend on the GPU count: solved again when the job re-plans for another count
DEGREE_PINS = ("t", "p", "d", "v", "microbatch_group")


def parse_args(argv: list[str] | None, default_model: str | None,
               default_precision: str = "fp32") -> argparse.Namespace:
    """Why this size: declarations only: one add_argument per flag of launch.py."""
    ap = OneLineParser(prog="launch.py", description="Train this saved autopar "
                                 "program under torchrun (see autopar/launch.py).",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=default_model, required=default_model is None,
                    help="file.py:factory (default: the factory autopar build was given)")
    ap.add_argument("--data", required=True,
                    help="a flat uint16/uint32 token file (nanoGPT/Megatron .bin), "
                         "'file.py:function' (returns an iterable of global batches), or "
                         "'random' (random tokens)")
    ap.add_argument("--data-dtype", choices=["uint16", "uint32"], default=None,
                    help="token dtype of the file (default: uint16 if the vocabulary fits)")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the sample order")
    ap.add_argument("--eod", type=int, default=None,
                    help="packed documents: the end-of-document token id (each row's documents "
                         "get their own positions and a block-diagonal causal mask)")
    ap.add_argument("--documents", action="store_true",
                    help="packed documents whose boundaries the data function yields: "
                         "(inputs, targets, doc_ids) per global batch")
    ap.add_argument("--mean-doc-len", type=float, default=None,
                    help="mean document length in tokens, priced when the job re-plans "
                         "(default: build.json's, else measured on --data with --eod)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size (default: model.config.vocab_size)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps in all")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW's peak learning rate")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="clip the global gradient norm (0: no clipping)")
    ap.add_argument("--precision", default=default_precision,
                    choices=["fp32", "bf16", "fp16", "fp8", "fp8-rowwise"],
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
                    help="write checkpoints from a background process per rank while training goes on")
    ap.add_argument("--export", default=None,
                    help="write the trained single-device state dict here (torch.save)")
    ap.add_argument("--losses-out", default=None, help="write the losses as JSON (rank 0)")
    ap.add_argument("--init-seed", type=int, default=0,
                    help="torch seed before the factory runs (the same on every rank)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds any collective may wait for a peer")
    train_log.add_arguments(ap)
    ap.add_argument("--verbose", action="store_true",
                    help="on an error, also print its cause's traceback")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile each chunk (default: as autopar build --compile chose)")
    args = ap.parse_args(argv)
    train_log.check_arguments(args)
    for name in ("steps", "save_every", "keep"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a "
                             f"positive integer")
    _check_paths_and_numbers(args)
    return args


def _check_paths_and_numbers(args: argparse.Namespace) -> None:
    """One-line ValueErrors, before anything runs, for values the optimizer or the end of the
    run would otherwise meet late or take silently (a negative clipping norm flips the
    gradients' sign; an output file in a missing folder fails after training)."""
    for flag, value, what in (("--weight-decay", args.weight_decay, "AdamW's decoupled decay"),
                              ("--max-grad-norm", args.max_grad_norm, "0: no clipping")):
        if not 0 <= value < math.inf:
            raise ValueError(f"{flag} {value}: must be a finite number >= 0 ({what})")
    if args.data_seed < 0:
        raise ValueError(f"--data-seed {args.data_seed}: must be >= 0 (numpy seeds are "
                         f"non-negative)")
    if args.checkpoint and Path(args.checkpoint).exists() and not Path(args.checkpoint).is_dir():
        raise ValueError(f"--checkpoint {args.checkpoint}: is a file; a checkpoint is a "
                         f"directory (resumed if present, created if not): pass another path")
    for flag, value in (("--export", args.export), ("--losses-out", args.losses_out)):
        if value and not Path(value).resolve().parent.is_dir():
            raise ValueError(f"{flag} {value}: its directory {Path(value).resolve().parent} "
                             f"does not exist; create it or pass a path in an existing "
                             f"directory")


def main(program_dir: str | Path, argv: list[str] | None = None) -> int:
    """Run the job (module docstring); the exit code."""
    program_dir = Path(program_dir)
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in argv
    quiet_torch_warnings()
    try:
        return _run(program_dir, [a for a in argv if a != "--verbose"])
    except (ValueError, PeerError) as err:
        # before the process group exists every rank checks the same inputs and fails alike:
        # rank 0 alone says so; after it, each rank names itself
        if dist.is_initialized() or os.environ.get("RANK", "0") == "0":
            where = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
            kind = "" if isinstance(err, ValueError) else f"{type(err).__name__}: "
            report("launch.py", err, verbose=verbose, where=f"{where}{kind}")
        return 2 if isinstance(err, ValueError) else 1


def _run(program_dir: Path, argv: list[str] | None) -> int:
    build = read_build(program_dir)
    args = parse_args(argv, build.get("model"), build.get("precision", "fp32"))
    args.compile = bool(build.get("compile")) if args.compile is None else args.compile
    saved = autopar.load_plan(program_dir / "plan.json")   # a bad file: one line naming it
    if os.environ.get("WORLD_SIZE", str(saved.gpus)) == str(saved.gpus):   # the saved chunks
        check_saved_precision(program_dir, saved, args.precision)
    torch.manual_seed(args.init_seed)
    user = load_factory(args.model)
    _check_inputs(args, user, saved)      # before the process group and the ~20 s compile
    documents = _documents(args, build, args.vocab or _model_vocab(user.model))
    init_distributed(timeout_s=args.timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    plan, chunk_dir = saved, program_dir
    if documents is not None and not build.get("documents"):
        chunk_dir = None   # the saved chunks take input_ids alone: generated again with them
    if world != saved.gpus:
        plan = replan(saved, user, world, build.get("pins", {}), build.get("cluster"),
                      documents)
        chunk_dir = None
        if rank == 0:
            print(f"launch.py: {world} ranks, plan.json is for {saved.gpus}: re-planned for "
                  f"{world} with the same global batch {saved.global_batch_size}\n{plan}",
                  flush=True)
    if rank == 0:
        print(f"launch.py: training {args.model or plan.model} on {world} ranks ({_degrees(plan)}), "
              f"global batch {plan.global_batch_size} × sequence {plan.seq_len}, steps "
              f"{args.steps}, data {args.data}; compiling the program…", flush=True)
    began = time.perf_counter()
    runner = _compile(plan, user, args, chunk_dir, documents)
    if rank == 0:
        print(f"launch.py: compiled in {time.perf_counter() - began:.1f} s", flush=True)
    vocab = args.vocab or getattr(getattr(user.model, "config", None), "vocab_size", None)
    data = open_batches(args.data, BatchShape(
        global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
        dp_rank=runner.dp_rank, dp_size=runner.dp_size),
        vocab_size=vocab, seed=args.data_seed, dtype=args.data_dtype,
        documents=documents is not None, eod=args.eod, context=runner.pg.c)
    start = _resume(runner, data, args.checkpoint, rank)
    if start == 0 and args.pretrained:
        runner.load_pretrained(args.pretrained)
        if rank == 0:
            print(f"loaded pretrained weights from {args.pretrained}", flush=True)
    saver = CheckpointSaver(runner, args.checkpoint, every=args.save_every, last=args.steps,
                            keep=args.keep, async_save=args.async_save)
    losses = _train(runner, plan, data, _eval_data(args, plan, runner, vocab, documents),
                    args, start,
                    rank, saver)
    state = runner.full_state_dict() if args.export else None
    if rank == 0:
        if args.export:
            torch.save(dict(state), args.export)
        if args.losses_out:
            Path(args.losses_out).write_text(json.dumps({"start": start, "losses": losses,
                                                         "world": world}))
    runner.close()   # every rank is done before any leaves; then the groups are destroyed
    return 0


def _train(runner: Any, plan: Plan, data: Any, eval_data: Any, args: argparse.Namespace,
           start: int, rank: int, saver: CheckpointSaver) -> list[float]:
    """Steps [start, --steps): the learning rate of the schedule, one step, the log line and
    metrics record (rank 0; autopar.train_log), an eval loss every --eval-every steps and the
    checkpoint every --save-every (or at a preemption signal: then the loop ends on every
    rank at the same step; autopar.runtime.preempt); the losses."""
    log = train_log.StepLog(plan, total_steps=args.steps, out=sys.stdout if rank == 0 else None,
                            metrics=args.metrics if rank == 0 else None)
    losses = []
    for step in range(start, args.steps):
        lr = train_log.lr_at(step, lr=args.lr, steps=args.steps, warmup_steps=args.warmup_steps,
                             decay=args.lr_decay, min_lr_ratio=args.min_lr_ratio)
        train_log.set_lr(runner.optimizer, lr)
        x, y = data.next()
        began = time.perf_counter()
        losses.append(runner.train_step(x, y))
        elapsed = time.perf_counter() - began
        eval_loss = None
        if eval_data is not None and ((step + 1) % args.eval_every == 0
                                      or step + 1 == args.steps):
            eval_loss = sum(runner.eval_loss(*eval_data.next())
                            for _ in range(args.eval_batches)) / args.eval_batches
        log.record(step, loss=losses[-1], step_time_s=elapsed, lr=lr,
                   grad_norm=runner.last_grad_norm, device=runner.device, eval_loss=eval_loss)
        if saver.after_step(step, user_state={"data": data.state_dict()}):
            break                       # preempted: saved at this step on every rank
    log.close()
    return losses


def _check_inputs(args: argparse.Namespace, user: UserModel, plan: Plan) -> None:
    """What can be checked before compiling: --vocab against the model's vocabulary, the
    data (opened as one replica: its file, dtype and token range) and --pretrained's files."""
    model_vocab = _model_vocab(user.model)
    if args.vocab is not None and args.vocab < 1:
        raise ValueError(f"--vocab {args.vocab}: must be a positive integer (the number of "
                         f"token ids the data may hold); pass --vocab {model_vocab or 'V'}")
    if args.vocab is not None and model_vocab is not None and args.vocab > model_vocab:
        raise ValueError(f"--vocab {args.vocab}: larger than the model's vocabulary "
                         f"({model_vocab} embeddings), so token ids >= {model_vocab} would "
                         f"index past it; pass --vocab {model_vocab} or less, or build the "
                         f"model with a larger vocabulary")
    vocab = args.vocab or model_vocab
    if args.eod is not None and vocab is not None and not 0 <= args.eod < vocab:
        raise ValueError(f"--eod {args.eod}: not a token id of the vocabulary [0, {vocab}); "
                         f"pass the end-of-document token's id")
    for flag, source in (("--data", args.data), ("--eval-data", args.eval_data)):
        if source is not None and source != "random" and not callable(source):
            open_batches(source, BatchShape(global_batch_size=plan.global_batch_size,
                                            seq_len=plan.seq_len),
                         vocab_size=args.vocab or model_vocab, seed=args.data_seed,
                         dtype=args.data_dtype, eod=args.eod)
    if args.pretrained:
        from autopar.runtime.pretrained import weight_files
        weight_files(args.pretrained)


def _model_vocab(model: torch.nn.Module) -> int | None:
    """config.vocab_size, else the rows of the input embedding when the model says which."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None and hasattr(model, "get_input_embeddings"):
        emb = model.get_input_embeddings()
        vocab = getattr(emb, "num_embeddings", None)
    return vocab


def _degrees(plan: Plan) -> str:
    return " ".join(f"{k}={getattr(plan, k)}" for k in ("t", "c", "p", "d", "v"))


def _eval_data(args: argparse.Namespace, plan: Plan, runner: Any, vocab: int | None,
               documents: Any = None) -> Any:
    """The --eval-data batches (this replica's rows, in file order), or None."""
    if args.eval_data is None:
        return None
    return open_batches(args.eval_data, BatchShape(
        global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
        dp_rank=runner.dp_rank, dp_size=runner.dp_size), vocab_size=vocab, seed=args.data_seed,
        dtype=args.data_dtype, documents=documents is not None, eod=args.eod,
        context=runner.pg.c)


def _documents(args: argparse.Namespace, build: dict[str, Any], vocab: int | None) -> Any:
    """The packed documents this job trains on (module doc), or None."""
    from autopar.data import mean_doc_len
    from autopar.documents import PackedDocuments
    built = build.get("documents")
    if not (args.eod is not None or args.documents):
        if built:
            raise ValueError(f"this program was built for packed documents (build.json: "
                             f"{built}); pass --eod ID (the end-of-document token), or "
                             f"--documents when the data function yields doc ids")
        return None
    mean = (built or {}).get("mean_doc_len") or args.mean_doc_len
    if mean is None and args.eod is not None:
        mean = mean_doc_len(args.data, args.eod, dtype=args.data_dtype, vocab_size=vocab)
    return PackedDocuments(mean_doc_len=mean)


def _example(user: UserModel, plan: Plan) -> tuple[tuple, Any]:
    """(example inputs, example targets) at the plan's micro-batch size and sequence."""
    inputs = user.inputs(seq_len=plan.seq_len, batch=plan.micro_batch_size,
                         option="the plan's seq_len")
    targets = user.example_targets
    return inputs, (torch.zeros_like(inputs[0]) if targets is None else targets)


def replan(saved: Plan, user: UserModel, world: int, pins: dict[str, Any],
           cluster: dict[str, Any] | None = None, documents: Any = None) -> Plan:
    """The plan for `world` ranks with saved's global batch, sequence, cluster (build.json's
    fields when given, else the plan's cluster name) and attention kernel and the non-degree
    pins: solved on rank 0, the same on every rank (a planning error is raised on every
    rank)."""
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = ("plan", _solve(saved, user, world, pins, cluster,
                                         documents).to_json())
        except ValueError as err:
            message[0] = ("error", str(err))
    dist.broadcast_object_list(message, src=0)
    kind, text = message[0]
    if kind == "error":
        raise ValueError(f"re-planning for {world} ranks (plan.json is for {saved.gpus}): "
                         f"{text}")
    return Plan.from_json(text)


def _solve(saved: Plan, user: UserModel, world: int, pins: dict[str, Any],
           fields: dict[str, Any] | None, documents: Any = None) -> Plan:
    from autopar.api import plan_program
    from autopar.cost.hardware import cluster_from_dict
    from autopar.request import Pins, PlanRequest
    cluster = (cluster_from_dict(fields, "build.json's cluster") if fields is not None
               else autopar.get_cluster(saved.cluster))
    if saved.predicted.attention and saved.predicted.attention != cluster.attention:
        cluster = dataclasses.replace(cluster, attention=saved.predicted.attention)
    inputs, targets = _example(user, saved)
    keep = Pins.of(pins, "build.json's pins").without(*DEGREE_PINS)
    request = PlanRequest(gpus=world, pins=keep, global_batch_size=saved.global_batch_size,
                          cluster=cluster, name=saved.model, documents=documents)
    prog = plan_program(user.model, request, example_inputs=inputs, loss_fn=user.loss(),
                        example_targets=targets)
    return prog.plan


def _compile(plan: Plan, user: UserModel, args: argparse.Namespace, chunk_dir: Path | None,
             documents: Any = None):
    inputs, targets = _example(user, plan)
    prog = autopar.parallelize(user.model, gpus=plan.gpus, example_inputs=inputs,
                               loss_fn=user.loss(), example_targets=targets, plan=plan,
                               documents=documents)
    lr, wd = args.lr, args.weight_decay
    return prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd),
                        max_grad_norm=args.max_grad_norm or None, precision=args.precision,
                        program_dir=chunk_dir, timeout_s=args.timeout,
                        torch_compile=args.compile)


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
