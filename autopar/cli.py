"""Command line: `autopar plan | build | scale | timeline | calibrate | clusters | tune | demo` (the same engine as
the API).

MODEL is a preset or `file.py:factory`, whose factory() returns the model or a dict with
'model' and optionally 'example_inputs', 'loss_fn', 'example_targets' (autopar.factory).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

from autopar.plan import CP_ATTENTION_PINNED, RECOMPUTE
from autopar.user_errors import OneLineParser


def _pins_from_args(args: argparse.Namespace) -> "Pins":
    """The flags that pin a knob (--micro-batch is micro_batch_size) as the request's Pins."""
    from autopar.request import Pins
    pins = {k: getattr(args, k, None) for k in ("t", "c", "cp_attention", "ep", "p", "d", "v",
                                                "schedule", "recompute", "zero")}
    return Pins(**pins, micro_batch_size=getattr(args, "micro_batch", None))


def priced_kinds(args: argparse.Namespace) -> dict[str, str]:
    """The cluster fields a command overrides: --attention, --elementwise; `build` prices
    elementwise ops as the built program runs them unless --elementwise says otherwise:
    fused with --compile (Inductor fuses the chunks' chains), else eager, which keeps more
    (on an H100 a plan priced fused for eager chunks ran out of memory: docs/known-gaps.md)."""
    kinds = {k: getattr(args, k) for k in ("attention", "elementwise")
             if getattr(args, k, None) is not None}
    if getattr(args, "fn", None) is cmd_build and "elementwise" not in kinds:
        kinds["elementwise"] = "fused" if args.compile else "eager"
    return kinds


def _plan_from_args(args: argparse.Namespace):
    import autopar
    from autopar.api import plan_program
    from autopar.presets import load_model
    from autopar.request import PlanRequest

    if args.cluster is None:           # named among the defaults the user did not set
        args.cluster, args.cluster_defaulted = DEFAULT_CLUSTER, True

    user, defaults = load_model(args.model, seq_len=args.seq)
    inputs = user.example_inputs
    tokens = getattr(args, "tokens", None)
    if tokens is not None:  # time to train: the batch is chosen unless --batch pins it
        batch = args.batch
    else:
        batch = args.batch or (defaults.global_batch_size if defaults else inputs[0].shape[0])
        _note_defaults(args, batch, inputs)
    moe_imbalance = getattr(args, "moe_imbalance", None)
    if getattr(args, "data", None) is not None:   # the routers' load on a batch of the data
        from autopar.expert_load import check_before_loading, load_from_token_file
        check_before_loading(user.model, args.data)   # the file, and the weights fit here
        real, _ = load_model(args.model, seq_len=args.seq, device="cpu")   # weights to route
        moe_imbalance = load_from_token_file(real.model, real.example_inputs, args.data)
    cluster = args.cluster
    kinds = priced_kinds(args)
    if kinds:  # the cluster's attention kernel / elementwise execution, overridden
        cluster = dataclasses.replace(autopar.get_cluster(cluster), **kinds)
    try:
        request = PlanRequest(gpus=args.gpus, pins=_pins_from_args(args),
                              global_batch_size=batch, cluster=cluster, name=user.name,
                              tokens=tokens,
                              critical_batch_tokens=getattr(args, "critical_batch", None),
                              precision=getattr(args, "precision", None),
                              documents=_documents(args), moe_imbalance=moe_imbalance)
    except ValueError as exc:
        raise ValueError(f"parallelize: {exc}") from None
    start = time.perf_counter()
    prog = plan_program(user.model, request, example_inputs=inputs, loss_fn=user.loss(),
                        example_targets=user.example_targets)
    seconds = time.perf_counter() - start
    _resume_collector()   # planned: what follows (build's save, ...) collects as usual
    return prog, seconds


DEFAULT_CLUSTER = "dgx-a100-80gb"


def _documents(args: argparse.Namespace):
    """--mean-doc-len N: the rows are packed documents of that mean length (autopar/documents.py)."""
    if getattr(args, "mean_doc_len", None) is None:
        return None
    from autopar.documents import PackedDocuments
    return PackedDocuments(mean_doc_len=args.mean_doc_len)


def _note_defaults(args: argparse.Namespace, batch: int, inputs: tuple) -> None:
    """Record the values the user did not choose (printed in the plan header, and appended to
    an error, so a default never surfaces as a puzzling rule violation)."""
    chosen = []
    if getattr(args, "cluster_defaulted", False):
        chosen.append(f"cluster {DEFAULT_CLUSTER} (--cluster)")
    if args.batch is None:
        chosen.append(f"global batch {batch} (--batch)")
    if args.seq is None and inputs and getattr(inputs[0], "dim", lambda: 0)() > 1:
        chosen.append(f"sequence {inputs[0].shape[1]} (--seq)")
    args.defaults_used = chosen


def _defaults_line(args: argparse.Namespace) -> str:
    used = getattr(args, "defaults_used", [])
    return f"defaults you did not set: {', '.join(used)}" if used else ""


_POSITIVE = ("gpus", "batch", "seq", "t", "c", "ep", "p", "d", "v", "micro_batch", "top", "ranks", "steps")


def _check_args(args: argparse.Namespace) -> None:
    """Flag values argparse's types let through: each count must be >= 1 (0 is not 'unset')."""
    for name in _POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value}: must be a positive integer; pass {flag} 1 or "
                             f"more" + ("" if name in ("gpus", "top") else
                                        ", or leave it out for the default / the solver"))


def cmd_plan(args: argparse.Namespace) -> int:
    prog, seconds = _plan_from_args(args)
    if args.json:
        print(prog.plan.to_json())
        return 0
    if _defaults_line(args):
        print(_defaults_line(args))
    print(prog.plan)
    if args.explain:
        print()
        print(prog.plan.explain(top=args.top))
    print(f"\n(planned in {seconds:.2f} s)")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    if ":" not in args.model:
        raise ValueError(f"autopar build {args.model}: a preset is planned on the meta device "
                         f"and has no weights to train; give your model as file.py:factory "
                         f"(plan a preset with autopar plan)")
    _check_out_dir(Path(args.out))
    prog, seconds = _plan_from_args(args)
    precision = {None: "fp32", "auto": prog.precision}.get(args.precision, args.precision)
    out = prog.save(args.out, model=args.model, precision=precision)
    if args.compile:   # launch.py's default --compile
        from autopar.saved_program import BUILD_FILE
        info = json.loads((out / BUILD_FILE).read_text())
        (out / BUILD_FILE).write_text(json.dumps({**info, "compile": True}, indent=2))
    print(prog.plan)
    files = sorted(p.name for p in out.iterdir())
    print(f"\n(planned in {seconds:.2f} s) wrote {out}: {', '.join(files)}")
    print(f"train: torchrun --standalone --nproc_per_node={prog.plan.gpus} "
          f"{out / 'launch.py'} --data tokens.bin --steps 1000 --checkpoint ckpt")
    return 0


def _check_out_dir(out: Path) -> None:
    """--out must be a directory we may write: new, or an earlier build (plan.json in it)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory; pass a new directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "plan.json").is_file():
        raise ValueError(f"--out {out}: a non-empty directory that is not an autopar build "
                         f"(no plan.json); pass a new or empty directory")
    parent = out if out.exists() else next(p for p in out.parents if p.exists())
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {out}: {parent} is not writable; pass a directory you can "
                         f"write")


def cmd_timeline(args: argparse.Namespace) -> int:
    prog, _ = _plan_from_args(args)
    from autopar.timeline import plan_timeline
    path = plan_timeline(prog.plan, args.out)
    print(f"wrote {path}")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from autopar.presets import load_model
    from autopar.scaling import scale_sweep

    user, _ = load_model(args.model, seq_len=args.seq)
    counts = tuple(int(g) for g in args.gpus_list.split(",")) if args.gpus_list else None
    res = scale_sweep(user.model, example_inputs=user.example_inputs, tokens=args.tokens,
                      gpus_max=args.gpus_max, gpus_min=args.gpus_min, gpu_counts=counts,
                      cluster=args.cluster, loss_fn=user.loss(),
                      example_targets=user.example_targets, name=user.name,
                      critical_batch_tokens=args.critical_batch,
                      families=tuple(args.families.split(",")))
    print(res.table())
    if args.out:
        print(f"wrote {res.plot(args.out)}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.cost.calibrate import calibrate
    result = calibrate(out=args.out, name=args.name, quick=args.quick,
                       peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
                       ranks=args.ranks, precision=args.precision, base=args.base)
    if result is not None:   # rank 0
        cluster, path = result
        print(_cluster_summary(cluster, header=True))
        print(f"wrote {path} (plan with --cluster {path}"
              + (" or --cluster local-cpu)" if args.out is None else ")"))
    return 0


def _cluster_summary(cluster, header: bool = False) -> str:
    """One line of a cluster's key numbers (and a header line)."""
    line = (f"{cluster.name:<16}{cluster.gpus_per_node:>5}{cluster.peak_flops / 1e12:>10.4g}"
            f"{cluster.memory_bytes / 1e9:>8.1f}{cluster.hbm_bandwidth_Bps / 1e9:>10.4g}"
            f"{cluster.intra_node_bandwidth_Bps / 1e9:>11.4g}"
            f"{cluster.intra_node_latency_s * 1e6:>8.4g}"
            f"{cluster.inter_node_bandwidth_Bps / 1e9:>11.4g}"
            f"{cluster.inter_node_latency_s * 1e6:>8.4g}{cluster.gemm_max_efficiency:>6.2f}"
            f"  {cluster.attention}/{cluster.elementwise}")
    head = (f"{'cluster':<16}{'gpus':>5}{'TFLOP/s':>10}{'mem GB':>8}{'HBM GB/s':>10}"
            f"{'intra GB/s':>11}{'lat us':>8}{'inter GB/s':>11}{'lat us':>8}{'e_max':>6}"
            f"  attention/elementwise")
    return f"{head}\n{line}" if header else line


def cmd_clusters(args: argparse.Namespace) -> int:
    """The presets (and cluster files given) with their key numbers; -v: every source."""
    from autopar.cost.hardware import CLUSTER_NAMES, get_cluster
    names = list(args.files or CLUSTER_NAMES)
    clusters = [get_cluster(n) for n in names]
    print(_cluster_summary(clusters[0], header=True).splitlines()[0])
    for cluster in clusters:
        print(_cluster_summary(cluster))
        if args.verbose:
            for source in cluster.sources:
                print(f"    - {source}")
    if not args.verbose:
        print("(per GPU, one direction; -v lists every number's source; a file: autopar "
              "clusters my-cluster.json)")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    """`autopar tune`: under torchrun on its ranks, else on --gpus local CPU ranks."""
    from autopar import tuning as T
    if args.passes < 1:
        raise ValueError(f"autopar tune --passes {args.passes}: must be >= 1, the times every "
                         f"plan is measured; pass 1 or 2")
    kwargs = dict(spec=args.model, gpus=args.gpus, batch=args.batch, seq=args.seq,
                  cluster=args.cluster, top=args.top, steps=args.steps, out=args.out,
                  cluster_out=args.cluster_out, passes=args.passes)
    if "WORLD_SIZE" in os.environ:
        from autopar.runtime.dist import init_distributed
        init_distributed()
        T.cli_run(**kwargs)
    else:
        from autopar.testing import spawn
        spawn(T._spawned, args.gpus, kwargs, timeout_s=args.timeout, pg_timeout_s=120)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from autopar.demo import run_demo
    return run_demo(ranks=args.ranks, steps=args.steps)


_CLUSTER_HELP = ("a preset (autopar clusters lists them: dgx-a100-80gb, dgx-h100-80gb, "
                 "hgx-b200-180gb, gb200-nvl72, mi300x-192gb, local-cpu, ...) or a cluster file "
                 "FILE.json (autopar calibrate writes one)")


def _add_plan_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("model", help="preset name (gpt3-175b, megatron-1t, llama3-405b, …) or "
                                   "file.py:factory")
    sp.add_argument("--gpus", type=int, required=True, help="number of GPUs to plan for")
    sp.add_argument("--cluster", default=None,
                    help=_CLUSTER_HELP + f" (default {DEFAULT_CLUSTER})")
    sp.add_argument("--attention", help="the attention kernel priced: flash (fused, the GPU "
                                        "presets' default) | materialized (scores written out)")
    sp.add_argument("--elementwise", help="how elementwise ops run: fused (single kernels, the "
                                          "GPU presets' default, as Megatron-LM or torch.compile) "
                                          "| eager (op by op, as autopar's runtime today)")
    sp.add_argument("--batch", type=int, help="global batch size (sequences per step)")
    sp.add_argument("--seq", type=int, help="sequence length")
    for knob in ("t", "c", "p", "d", "v", "zero"):
        sp.add_argument(f"--{knob}", type=int, help=f"pin {knob}")
    sp.add_argument("--ep", type=int, help="pin the expert-parallel degree (a mixture of "
                                           "experts: experts over ep of the c·d ranks)")
    sp.add_argument("--moe-imbalance", dest="moe_imbalance", type=float,
                    help="a mixture of experts: the most loaded expert's tokens over the mean "
                         "expert's (e.g. 1.3); expert GEMMs and all-to-alls priced at the most "
                         "loaded expert rank (default: balanced)")
    sp.add_argument("--data", help="a flat token file (uint16/uint32): one example batch of "
                                   "it is run through the model's routers on this machine and "
                                   "the measured expert load priced (instead of "
                                   "--moe-imbalance)")
    sp.add_argument("--cp-attention", dest="cp_attention", choices=list(CP_ATTENTION_PINNED),
                    help="pin how context parallelism's attention meets the other ranks' K/V "
                         "(default: the cheaper as priced)")
    sp.add_argument("--micro-batch", type=int, help="pin the micro-batch size")
    sp.add_argument("--mean-doc-len", type=float, dest="mean_doc_len",
                    help="packed documents of this mean length in tokens: the model gets "
                         "per-document positions and a block-diagonal causal mask, attention "
                         "priced at the tiles it leaves; train with launch.py --eod ID")
    sp.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b", "breadth-first",
                                               "interleaved-zb"])
    sp.add_argument("--recompute", choices=list(RECOMPUTE),
                    help="pin activation recomputation: none, selective (the attention core), "
                         "full (whole blocks) or op (torchtitan's per-op selective: every "
                         "other GEMM's output kept)")
    sp.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "auto"],
                    help="the run's precision, priced (fp8: the blocks' GEMMs at the cluster's "
                         "FP8 rate; auto: bf16 and fp8 compared) and, for build, the chunks' "
                         "(bf16: bf16 compute, fp32 master weights; fp16: the same with dynamic "
                         "loss scaling; fp8 / fp8-rowwise: bf16 with the blocks' linear GEMMs "
                         "in FP8, tensorwise / rowwise scaling; default fp32 chunks)")
    _add_tokens_args(sp, required=False)


def _add_tokens_args(sp: argparse.ArgumentParser, *, required: bool) -> None:
    sp.add_argument("--tokens", type=float, required=required,
                    help="plan for the shortest time to train this many tokens (e.g. 300e9): "
                         "the global batch is chosen too unless --batch pins it")
    sp.add_argument("--critical-batch", type=float, dest="critical_batch",
                    help="critical batch in tokens (default: 2001.08361's estimate from the "
                         "model's non-embedding parameters)")


def build_parser() -> argparse.ArgumentParser:
    """Why this size: declarations only: one add_argument per flag of every subcommand."""
    ap = OneLineParser(prog="autopar", description=__doc__)
    ap.add_argument("--verbose", action="store_true",
                    help="on an error, also print its cause's traceback (anywhere on the line)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("plan", help="plan a model for a GPU count and print the plan")
    _add_plan_args(sp)
    sp.add_argument("--json", action="store_true", help="print the plan as JSON")
    sp.add_argument("--explain", action="store_true", help="also print the ranked alternatives")
    sp.add_argument("--top", type=int, default=10, help="alternatives shown by --explain")
    sp.set_defaults(fn=cmd_plan)
    bd = sub.add_parser("build", help="plan a model and write the program (plan.json, chunk "
                                      "sources, launch.py, run scripts)")
    _add_plan_args(bd)
    bd.add_argument("--out", required=True, help="directory to write the program into")
    bd.add_argument("--compile", action="store_true",
                    help="launch.py torch.compiles each chunk (Inductor); planned with "
                         "elementwise ops fused (without --compile: eager, as the chunks run) "
                         "unless --elementwise says otherwise")
    bd.set_defaults(fn=cmd_build)
    tl = sub.add_parser("timeline", help="draw the simulated schedule of a plan as a PNG")
    _add_plan_args(tl)
    tl.add_argument("--out", default="schedule.png")
    tl.set_defaults(fn=cmd_timeline)
    sc = sub.add_parser("scale", help="time to train and cost against GPU count, per schedule "
                                      "family (table, and a PNG with --out)")
    sc.add_argument("model", help="preset name or file.py:factory")
    _add_tokens_args(sc, required=True)
    sc.add_argument("--gpus-max", type=int, required=True, help="largest GPU count swept")
    sc.add_argument("--gpus-min", type=int, help="smallest GPU count (default gpus-max/64)")
    sc.add_argument("--gpus-list", help="comma-separated GPU counts instead of powers of two")
    sc.add_argument("--cluster", default="dgx-a100-80gb", help=_CLUSTER_HELP)
    sc.add_argument("--seq", type=int, help="sequence length")
    sc.add_argument("--families", default="interleaved,breadth-first",
                    help="schedule families: 1f1b, interleaved, breadth-first (comma-separated)")
    sc.add_argument("--out", help="write the plot here (PNG)")
    sc.set_defaults(fn=cmd_scale)
    cb = sub.add_parser("calibrate", help="measure a cluster and write its cluster file (alone: "
                                          "this machine on local CPU ranks, as local-cpu; "
                                          "under torchrun: its ranks and nodes)")
    cb.add_argument("--out", help="the cluster file to write (default: this machine's "
                                  "local-cpu file, ~/.cache/autopar/local-cpu.json)")
    cb.add_argument("--name", default="local-cpu", help="the cluster's name in the file")
    cb.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for tests)")
    cb.add_argument("--ranks", type=int, default=None,
                    help="local ranks when not under torchrun (default: one per GPU, or 2 CPU "
                         "processes on a machine without one)")
    cb.add_argument("--base", default=None, metavar="CLUSTER",
                    help="a preset or cluster file whose link numbers a single rank (one GPU: "
                         "no link to measure) keeps beside its measured device numbers")
    cb.add_argument("--precision", choices=["fp32", "bf16"],
                    help="the training precision compute is measured in (default: bf16 on "
                         "GPU, fp32 on CPU)")
    cb.add_argument("--peak-tflops", type=float, dest="peak_tflops",
                    help="the datasheet's dense peak per GPU in the training precision "
                         "(gemm_max_efficiency is then measured against it)")
    cb.set_defaults(fn=cmd_calibrate)
    cl = sub.add_parser("clusters", help="list the cluster presets (or files) with their key "
                                         "numbers and sources")
    cl.add_argument("files", nargs="*", help="cluster names or files (default: every preset)")
    cl.add_argument("-v", "--verbose", action="store_true", help="every number's source")
    cl.set_defaults(fn=cmd_clusters)
    tn = sub.add_parser("tune", help="run the best predicted plans for a few steps, keep the "
                                     "fastest measured (plan.json), refit the cluster")
    tn.add_argument("model", help="file.py:factory (a model with weights to run)")
    tn.add_argument("--gpus", type=int, required=True, help="ranks (local CPU ranks when not "
                                                            "under torchrun)")
    tn.add_argument("--cluster", default="local-cpu", help=_CLUSTER_HELP)
    tn.add_argument("--batch", type=int, help="global batch size (default: gpus × the example's)")
    tn.add_argument("--seq", type=int, help="sequence length")
    tn.add_argument("--top", type=int, default=4, help="the best predicted plans to run")
    tn.add_argument("--steps", type=int, default=3, help="timed steps per plan (after one "
                                                         "warm-up step)")
    tn.add_argument("--passes", type=int, default=2,
                    help="times every plan is measured, one plan at a time, every other pass "
                         "in the opposite order, then as many more over the plans within 10%% "
                         "of the fastest; each plan's least counts (default 2: a shared "
                         "host's slow spells fall on a plan twice only if they outlast a pass)")
    tn.add_argument("--out", default="plan.json", help="where the fastest measured plan goes")
    tn.add_argument("--cluster-out", dest="cluster_out",
                    help="the refitted cluster file (default: the --cluster file; local-cpu's "
                         "own file; NAME-tuned.json for a preset)")
    tn.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    tn.set_defaults(fn=cmd_tune)
    dm = sub.add_parser("demo", help="plan a large model, then train a small one on CPU ranks")
    dm.add_argument("--ranks", type=int, default=8, help="local CPU ranks for the small model")
    dm.add_argument("--steps", type=int, default=3)
    dm.set_defaults(fn=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    from autopar.user_errors import quiet_torch_warnings, report

    own_process = argv is None   # the `autopar` command itself: see _pause_collector
    if own_process:
        _pause_collector()
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in argv       # accepted anywhere on the line
    quiet_torch_warnings()
    args = build_parser().parse_args([a for a in argv if a != "--verbose"])
    try:
        _check_args(args)
        if args.fn not in _PLANNING:
            _resume_collector()
        return args.fn(args)
    except ValueError as err:
        # Bad input: the message already names the value, the rule and the fix (one line;
        # any cause is shown with --verbose); defaults the user did not set are named, since
        # a rule they break is otherwise a puzzle.
        extra = f" ({_defaults_line(args)})" if _defaults_line(args) else ""
        report("autopar", err, verbose=verbose, extra=extra)
        return 2
    finally:
        if own_process:
            _freeze_heap()


_PAUSED = []   # [True] while main() holds the collector off for this process's start-up
_PLANNING = (cmd_plan, cmd_build, cmd_timeline)   # resume it once planned (_plan_from_args)


def _pause_collector() -> None:
    """For the `autopar` process itself: the cyclic collector off from the start until the plan
    is made (_resume_collector). Importing torch, torch._dynamo (torch.export's) and a model's
    transformers module, building the meta model and capturing it allocate millions of
    long-lived objects and free few; the collections they trigger found almost nothing and
    cost ~0.6 s (the 1T preset) to ~0.9 s (Qwen3-235B-A22B) of CPU, measured with gc.callbacks
    2026-11-26 (the solve pauses it too: cost/solver.py). Peak memory +~30 MB."""
    if gc.isenabled():
        gc.disable()
        _PAUSED.append(True)


def _resume_collector() -> None:
    """The collector back on (a no-op unless _pause_collector paused it), the start-up's
    objects frozen first (_freeze_heap) so its collections skip them."""
    if _PAUSED:
        _PAUSED.clear()
        _freeze_heap()
        gc.enable()


def _freeze_heap() -> None:
    """For the `autopar` process itself (main() without an argv list): every object alive
    moved to the cyclic collector's permanent generation (gc.freeze), so the collections
    while planning and the interpreter's last one at exit skip torch's import-time objects
    (the exit's alone ~0.7 s of CPU with torch and torch._dynamo loaded, measured
    2026-11-26); objects are still freed by their reference counts. Not for an argv list:
    tests and embedders call main() inside a longer-lived process."""
    gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
