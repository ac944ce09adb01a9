"""Predicted against measured: a GPT-like model on 2 local CPU ranks, after `autopar calibrate`.

The free plan (the solver's choice) and a fixed set of plans spanning t, p, d, c, schedules,
ZeRO levels, recompute and micro-batch sizes, each predicted on the cluster (the local-cpu
cluster file, or --cluster) and measured as `autopar tune` measures them
(autopar.tuning.measure_candidates: one plan at a time, compiled, timed in its rounds and
released, in two passes over the plans in opposite orders, then two more over the plans
within 10% of the fastest; each the least disturbed round's median of the timed steps after
warm-up, the slowest rank; `--interleaved`: every plan compiled first, then rounds over all
of them in turn, each plan then measuring 3–22% slower than alone). Prints the table,
Spearman's rank correlation of predicted and measured, the median and worst relative error,
the regret (the free plan's measured step time over the fastest measured), and the same
errors after the refit (autopar.tune_fit.refit_cluster, least squares over these plans).

Goals (issue 29): regret <= 1.05, Spearman >= 0.9, median |error| <= 15%, and the refit halves
the median error. The machine is shared: run it when it is quiet, and rerun before believing a
single number.

    autopar calibrate                       # this machine's local-cpu cluster file
    python benchmarks/plan_vs_measured.py [--cluster FILE.json] [--steps 3] [--rounds 3]
        [--passes 2] [--refit-out F] [--trials-out T.json]
        [--model gpt|llama] [--hidden 128] [--layers 4] [--seq 128] [--kv-heads K] [--batch 8]
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

# knobs the solver must otherwise choose are pinned per row; the rest are the solver's (a row
# the solver resolves to an earlier one is measured once: ZeRO levels and context methods are
# pinned besides, so that at least 12 distinct plans remain whatever the solver prefers)
PLANS = (
    dict(d=2, micro_batch_size=1),
    dict(d=2, micro_batch_size=2),
    dict(d=2, micro_batch_size=4),
    dict(d=2, zero=0, micro_batch_size=4),
    dict(d=2, zero=1, micro_batch_size=4),
    dict(d=2, zero=2, micro_batch_size=4),
    dict(d=2, zero=3, micro_batch_size=4),
    dict(d=2, recompute="full", micro_batch_size=4),
    dict(d=2, recompute="selective", micro_batch_size=4),
    dict(d=2, recompute="op", micro_batch_size=4),
    dict(t=2, micro_batch_size=4),
    dict(t=2, sequence_parallel=True, micro_batch_size=4),
    dict(p=2, schedule="1f1b", micro_batch_size=1),
    dict(p=2, schedule="gpipe", micro_batch_size=2),
    dict(p=2, v=2, schedule="interleaved-1f1b", micro_batch_size=2),
    dict(p=2, v=2, schedule="interleaved-zb", micro_batch_size=2),
    dict(c=2, cp_attention="all-gather", micro_batch_size=4),
    dict(c=2, cp_attention="ring", micro_batch_size=4),
)
GPT_CONFIG = dict(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128)
BATCH = 8


def _model(kind: str = "gpt", hidden: int = 128, layers: int = 4, seq: int = 128,
           kv_heads: int | None = None):
    """The measured model: the examples' GPT (the default, GPT_CONFIG) or Llama-style decoder
    (RMSNorm, rotary, SwiGLU; grouped-query attention with --kv-heads), 4 heads."""
    torch.manual_seed(0)
    cfg = dict(GPT_CONFIG, n_embd=hidden, n_layer=layers, block_size=seq)
    if kind == "llama":
        from autopar.examples.llama import LlamaStyle, LlamaStyleConfig
        return LlamaStyle(LlamaStyleConfig(**cfg, n_kv_head=kv_heads))
    from autopar.examples.gpt import GPT, GPTConfig
    return GPT(GPTConfig(**cfg))


def _worker(rank: int, world: int, cluster: str, steps: int, top: int, rounds: int,
            shape: dict, batch: int, interleaved: bool = False, passes: int = 2):
    from autopar import cross_entropy
    from autopar.tuning import tune

    ids = torch.zeros(1, shape["seq"], dtype=torch.long)
    return tune(functools.partial(_model, **shape), gpus=world, example_inputs=(ids,),
                loss_fn=cross_entropy, global_batch_size=batch, cluster=cluster, top=top,
                steps=steps, plans=PLANS, rounds=rounds, vocab=GPT_CONFIG["vocab_size"],
                interleaved=interleaved, passes=passes,
                name=f"{shape['kind']}-{shape['layers']}x{shape['hidden']}",
                log=lambda line: print(line, flush=True))


def report(result) -> bool:
    """Print the table and the goals; whether every goal is met."""
    from autopar.tuning import rel_error, spearman

    trials = result.trials
    free = trials[0]
    fastest = min(tr.measured_s for tr in trials)
    rho = spearman([tr.plan.predicted.step_time_s for tr in trials],
                   [tr.measured_s for tr in trials])
    errors = [abs(rel_error(tr)) for tr in trials]
    refit = [abs(tr.refit_s / tr.measured_s - 1) for tr in trials]
    regret = free.measured_s / fastest
    print(result.table())
    print(f"\n{len(trials)} plans; free plan: {free.label}")
    goals = [("regret (free plan measured / fastest measured)", regret, regret <= 1.05, "<= 1.05"),
             ("Spearman (predicted vs measured order)", rho, rho >= 0.9, ">= 0.9"),
             ("median |error|", statistics.median(errors), statistics.median(errors) <= 0.15,
              "<= 15%"),
             ("worst |error|", max(errors), True, "reported"),
             ("median |error| after the refit", statistics.median(refit),
              statistics.median(refit) <= statistics.median(errors) / 2, "<= half the above"),
             ("worst |error| after the refit", max(refit), True, "reported"),
             ("Spearman after the refit", spearman([tr.refit_s for tr in trials],
                                                   [tr.measured_s for tr in trials]), True,
              "reported")]
    for name, value, ok, goal in goals:
        shown = f"{value * 100:.1f}%" if "error" in name else f"{value:.3f}"
        print(f"  {name:<50}{shown:>9}   goal {goal:<20}{'ok' if ok else 'MISSED'}")
    return all(ok for _, _, ok, _ in goals)


def save_trials(trials, path: str) -> None:
    """Each trial's label, measured and predicted seconds and `tune_fit._columns` (what
    `fit_scales` fits), as JSON: a list of rows, each column a name -> seconds."""
    import json

    from autopar.tune_fit import _columns
    cols = _columns(trials)
    rows = [{"plan": tr.label, "measured_s": tr.measured_s,
             "predicted_s": tr.plan.predicted.step_time_s, "refit_s": tr.refit_s,
             "columns": {k: float(v[i]) for k, v in cols.items()}}
            for i, tr in enumerate(trials)]
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="local-cpu")
    ap.add_argument("--steps", type=int, default=3)
    # 2 passes of 3 rounds, not one pass of 3: a round's median of 3 steps wanders ~8% here,
    # so among the d = 2 plans priced alike the least disturbed of 3 rounds left them up to
    # 18% apart by luck (regret 1.183 once; 6 rounds: regret 1.000-1.034, Spearman
    # 0.912-0.956 over three shapes, 2026-11-27); and the host has slow spells of tens of
    # seconds, which one pass of 6 rounds met on the first four plans of a run (8-27% slow:
    # regret 1.111, Spearman 0.791, 2026-11-28); a second pass in the opposite order
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of each plan a pass")
    ap.add_argument("--passes", type=int, default=2, help="passes over the plans, every other "
                    "one in the opposite order (autopar.tuning.measure_candidates)")
    ap.add_argument("--interleaved", action="store_true",
                    help="every plan alive at once, rounds over all of them in turn")
    ap.add_argument("--top", type=int, default=1, help="best predicted plans besides PLANS")
    ap.add_argument("--refit-out", help="save the refitted cluster file here")
    ap.add_argument("--trials-out", help="save each plan's measured time and the predicted "
                    "seconds the refit scales (autopar.tune_fit's columns) as JSON here: a "
                    "fit rule compared offline on the same measurements, not on a noisy rerun")
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                    help="another model than the default GPT: fit mechanisms, not these plans")
    ap.add_argument("--hidden", type=int, default=GPT_CONFIG["n_embd"])
    ap.add_argument("--layers", type=int, default=GPT_CONFIG["n_layer"])
    ap.add_argument("--seq", type=int, default=GPT_CONFIG["block_size"])
    ap.add_argument("--kv-heads", type=int, help="llama: grouped-query attention's kv heads")
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch (a multiple of 8: "
                    "the pinned micro-batch sizes 1, 2, 4 divide its share at d = 2)")
    args = ap.parse_args()
    if args.passes < 1:
        ap.error(f"--passes {args.passes}: must be >= 1, the passes over the plans; pass 2")
    if args.batch % 8:
        ap.error(f"--batch {args.batch}: the pinned plans need a multiple of 8; pass 8, 16, ...")
    shape = dict(kind=args.model, hidden=args.hidden, layers=args.layers, seq=args.seq,
                 kv_heads=args.kv_heads)
    from autopar.testing import spawn
    start = time.perf_counter()
    result = spawn(_worker, 2, args.cluster, args.steps, args.top, args.rounds, shape,
                   args.batch, args.interleaved, args.passes, timeout_s=3000,
                   pg_timeout_s=300)[0]
    ok = report(result)
    if args.refit_out:
        from autopar.cost.hardware import save_cluster
        print(f"wrote {save_cluster(result.refit, args.refit_out)}")
    if args.trials_out:
        save_trials(result.trials, args.trials_out)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    how = "interleaved" if args.interleaved else f"one plan at a time, {args.passes} passes"
    print(f"({time.perf_counter() - start:.0f} s, {how}; cluster {args.cluster}; load average "
          f"{load} on {os.cpu_count()} cores: timings on a shared machine are noisy)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
