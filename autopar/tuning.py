"""`autopar tune`: plan, then run the best predicted plans on the ranks at hand, keep the
fastest measured, and refit the cluster's fitted constants to what was measured.

    # inside torchrun (WORLD_SIZE == gpus), or `autopar tune MODEL --gpus N` (local CPU ranks)
    result = autopar.tune(make_model, gpus=2, example_inputs=(ids,),
                          loss_fn=autopar.cross_entropy, global_batch_size=8,
                          cluster="local-cpu", top=4, steps=3)   # make_model() -> the model
    print(result.table()); result.best            # the fastest measured Plan

1. Plan once (one planning capture): the solver's plan and its ranked feasible alternatives;
   the `top` best predicted configurations, plus any the user names (`plans=`, dicts of pins),
   are each solved again with every knob pinned (the Plan the runtime runs).
2. Each candidate in turn is compiled, trained on random tokens for `rounds` rounds
   (`warmup` steps in the first), `steps` timed steps a round, and released before the next
   (`measure_candidates`), as a job holds one plan: its step time is the least disturbed
   round's median of the slowest rank's step times (`measure_plans`); its memory the tensors
   its runner holds between steps (autopar.testing.held_tensor_bytes) plus the most one more
   step adds (the allocator's peak above its start on a GPU,
   autopar.testing.step_peak_tensor_bytes on CPU). `interleaved=True` compiles every
   candidate first and times them in rounds over all of them, so a passing load falls on
   every plan alike; with all of them alive each one measures slower (below).
3. The fastest measured is the choice (written as plan.json by the CLI).
4. Refit (autopar/tune_fit.py `fit_scales`, `refit_cluster`): the cluster's fitted constants
   scaled by how much slower than priced each part of the measured steps ran; plans the
   refit prices far faster than measured are measured once more first (`suspects`).
"""
from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from autopar.collector import collector_paused
from autopar.cost.hardware import Cluster, get_cluster
from autopar.plan import Plan
from autopar.request import Pins
from autopar.tune_fit import (PIN_KEYS, Scales, Trial, fit_scales, measured_trial, pins_label,
                              plan_pins, refit_cluster, rel_error, suspects)

# the candidates measured again after the passes (`measure_candidates`): those within this
# fraction of the fastest measured — the spread of one plan's time from compile to compile
# on 2 CPU ranks (±10%, 2026-11-28)
CONTENDER_MARGIN = 0.1

@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneResult:
    trials: tuple[Trial, ...]
    cluster: Cluster            # the cluster planned with
    refit: Cluster              # the refitted cluster
    scales: Scales

    @property
    def best(self) -> Plan:
        return min(self.trials, key=lambda tr: tr.measured_s).plan

    def table(self) -> str:
        """Predicted against measured for every trial, the errors, the choice."""
        lines = [f"{'plan':<58}{'pred ms':>9}{'meas ms':>9}{'err':>7}{'refit ms':>9}"
                 f"{'pred MiB':>9}{'meas MiB':>9}   (memory without the cluster's reserve)"]
        best = self.best
        for tr in self.trials:
            pred = tr.plan.predicted
            refit = f"{tr.refit_s * 1e3:>9.1f}" if tr.refit_s is not None else f"{'':>9}"
            lines.append(f"{tr.label:<58}{pred.step_time_s * 1e3:>9.1f}"
                         f"{tr.measured_s * 1e3:>9.1f}{rel_error(tr) * 100:>6.0f}%{refit}"
                         f"{predicted_memory_bytes(tr.plan) / 2**20:>9.1f}"
                         f"{tr.measured_memory_bytes / 2**20:>9.1f}"
                         + ("  <- fastest measured" if tr.plan is best else ""))
        before = statistics.median(abs(rel_error(tr)) for tr in self.trials)
        after = [abs(tr.refit_s / tr.measured_s - 1) for tr in self.trials
                 if tr.refit_s is not None]
        lines.append(f"median |error| {before * 100:.0f}% as planned"
                     + (f", {statistics.median(after) * 100:.0f}% refitted ({self.scales})"
                        if after else ""))
        return "\n".join(lines)


def predicted_memory_bytes(plan: Plan) -> float:
    """The plan's predicted bytes per GPU without the cluster's reserve (what the runtime's
    allocator counts)."""
    pred = plan.predicted
    return pred.memory_bytes_per_gpu - (pred.memory.other_bytes if pred.memory else 0.0)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in set(v):   # ties share their mean rank
            idx = [i for i, x in enumerate(v) if x == value]
            r[idx] = np.mean(r[idx])
        return r
    rx, ry = ranks(list(xs)), ranks(list(ys))
    return float(np.corrcoef(rx, ry)[0, 1])
# ---- candidates ----

def candidate_plans(model: torch.nn.Module, *, gpus: int, example_inputs: tuple,
                    loss_fn: Callable | None, example_targets: Any, global_batch_size: int,
                    cluster: Cluster, top: int, named: tuple["Pins | dict", ...] = (),
                    name: str | None = None) -> tuple[list[Plan], Callable[[Cluster, dict], Plan]]:
    """The `top` best predicted plans and the named ones (each solved with every knob
    pinned), and a function that solves pins on another cluster (the same profile).
    Why this size: the planning request's parts (profile, cluster, gpus, batch, pins, precision,
    top, named plans) passed to the solver for each candidate."""
    from autopar.api import over_kinds, plan_profile
    from autopar.cost.solver import solve
    from autopar.plan import parameter_signature

    _, profile = plan_profile(model, example_inputs, loss_fn, example_targets, cluster,
                              gpu_counts=(gpus,), name=name)
    profile = profile.with_training_bytes(4)   # PlanRun compiles in fp32 (compile's default)
    signature = parameter_signature(model)

    def solve_pins(cl: Cluster, pins: "Pins | dict[str, Any]", alternatives: int = 0) -> Plan:
        knobs = Pins.of(pins, "tune").as_dict()
        plan = over_kinds(solve(profile, cl, gpus=gpus, global_batch_size=global_batch_size,
                                max_alternatives=alternatives, **knobs), profile)
        return dataclasses.replace(plan, parameters=signature)

    free = solve_pins(cluster, {}, alternatives=max(50, 4 * top))
    ranked = sorted((a for a in free.alternatives if a.feasible and a.predicted is not None),
                    key=lambda a: a.predicted.step_time_s)
    plans, seen = [free], {pins_label(plan_pins(free))}
    for pins in [{k: a.config[k] for k in PIN_KEYS if k in a.config} for a in ranked]:
        if len(plans) >= top:
            break
        plan = solve_pins(cluster, pins)
        if pins_label(plan_pins(plan)) not in seen:
            seen.add(pins_label(plan_pins(plan)))
            plans.append(plan)
    for pins in named:
        plan = solve_pins(cluster, pins)
        if pins_label(plan_pins(plan)) not in seen:
            seen.add(pins_label(plan_pins(plan)))
            plans.append(plan)
    return plans, solve_pins


# ---- measuring ----

def _batch_for(plan: Plan, vocab: int, runner: Any, seed: int = 0) -> tuple[tuple, torch.Tensor]:
    """Random tokens: this replica's share (global_batch_size / d sequences)."""
    share = plan.global_batch_size // plan.d
    gen = torch.Generator().manual_seed(seed + runner.dp_rank)
    ids = torch.randint(0, vocab, (share, plan.seq_len), generator=gen)
    return (ids,), torch.randint(0, vocab, (share, plan.seq_len), generator=gen)


class PlanRun:
    """One candidate compiled on every rank, timed in rounds (`time_round`), its memory read
    once at the end (`memory_bytes`); every method is collective."""

    def __init__(self, model_fn: Callable[[], torch.nn.Module], plan: Plan, *,
                 example_inputs: tuple, loss_fn: Callable | None, vocab: int,
                 device: torch.device, optimizer: Callable | None = None) -> None:
        from autopar.api import parallelize
        torch.manual_seed(0)
        prog = parallelize(model_fn(), gpus=plan.gpus, example_inputs=example_inputs,
                          loss_fn=loss_fn, plan=plan)
        self.runner = prog.compile(
            optimizer=optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-4)))
        self.batch = _batch_for(plan, vocab, self.runner)
        self.device = device

    def time_round(self, steps: int, warmup: int) -> float:
        """The median over `steps` timed steps (after `warmup`) of the slowest rank's time.
        The cyclic collector is paused while they run (collected once before), as
        torchtitan's training loop runs it: measured interleaved, every plan's runner is
        alive in this process, and a job holds one; with 8 more runners alive a d = 2 step
        here took 113 ms against 95 ms alone, 102 ms with the collector's traversals frozen."""
        for _ in range(warmup):
            self.runner.train_step(*self.batch)
        times = []
        with collector_paused(collect_first=True):
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                self.runner.train_step(*self.batch)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(float(elapsed))
        return statistics.median(times)

    def memory_bytes(self) -> float:
        """The tensors the runner holds between steps (autopar.testing.held_tensor_bytes:
        weights, gradients, optimizer states, buffers; not the allocator's total, which counts
        every runner alive in this process: all candidates', measured interleaved) + the most
        one more step holds above them: the allocator's peak over its start on a GPU,
        step_peak_tensor_bytes on CPU; the largest over ranks."""
        from autopar.testing import held_tensor_bytes, step_peak_tensor_bytes
        held = held_tensor_bytes(self.runner)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.runner.train_step(*self.batch)
            torch.cuda.synchronize(self.device)
            step = torch.cuda.max_memory_allocated(self.device) - start
        else:
            step = step_peak_tensor_bytes(lambda: self.runner.train_step(*self.batch))
        memory = float(held + step)
        mem = torch.tensor([memory], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        return float(mem)


def measure_plans(runs: list[PlanRun], *, steps: int, warmup: int, rounds: int,
                  log: Callable[[str], None]) -> list[tuple[float, float]]:
    """(step seconds, memory bytes) of every run: `rounds` rounds over all the runs in turn
    (warm-up in the first), each run's time the least disturbed round's median — a load that
    comes and goes on a shared machine then falls on every plan alike, not on the plan that
    happened to run during it. One run at a time (`measure_candidates`' default) is its
    rounds back to back."""
    rounds_s: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i, run in enumerate(runs):
            rounds_s[i].append(run.time_round(steps, warmup if r == 0 else 0))
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{min(t) * 1e3:.0f}" for t in rounds_s)
            + " ms")
    return [(min(t), run.memory_bytes()) for t, run in zip(rounds_s, runs)]


def measure_candidates(candidates: list[Plan], compiled: Callable[[int, Plan], PlanRun], *,
                       steps: int, warmup: int, rounds: int, interleaved: bool,
                       log: Callable[[str], None], passes: int = 1) -> list[tuple[float, float]]:
    """(step seconds, memory bytes) of every candidate. One at a time (the default): each
    compiled, measured in its rounds and released (its tensors and process groups) before the
    next is compiled — what a job runs, and what a GPU needs, which holds one candidate's
    weights, optimizer state and communicators, not all of them. interleaved: all compiled
    first, then timed in rounds over all of them (`measure_plans`: a shared host's passing
    load falls on every plan alike). With every runner alive each plan measures slower than
    it runs alone: on 2 CPU ranks (2026-11-27, 17–18 plans of two GPTs, each way run once,
    minutes apart) data-parallel plans 8–18%, t = 2 12–22%, pipelines 3–8%; the untuned
    median error was 12.1% / 14.7% interleaved against 3.9% / 8.8–11.3% one at a time, the
    Spearman 0.882 / 0.978 against 0.907 / 0.916–0.971. `compiled(i, plan)` makes candidate
    i's PlanRun.

    passes (one at a time): the candidates measured again in each further pass, every other
    pass in the opposite order, each compiled afresh; a candidate's time its least over the
    passes (its memory the first pass's). A shared host has slow spells of tens of seconds:
    one pass measured the first four d = 2 plans of a 4-layer GPT 8–27% slower than the
    identical ones after them (2026-11-28), which made a ZeRO level the fastest measured by
    luck (regret 1.11) and the order's Spearman 0.79; a plan measured in two passes, in
    opposite orders, falls in such a spell twice only when the spell outlasts a pass. With
    passes > 1 the contenders — within CONTENDER_MARGIN of the fastest measured — are then
    measured in as many passes more, so that the choice among plans alike is not one
    compile's luck: one plan compiled and timed five times in a row measured 54.8–67.4 ms,
    another 59.7–64.7 (3 rounds of 3 steps each, 2026-11-28)."""
    if interleaved:
        runs = [compiled(i, plan) for i, plan in enumerate(candidates)]
        return measure_plans(runs, steps=steps, warmup=warmup, rounds=rounds, log=log)
    best: dict[int, tuple[float, float]] = {}

    def one_pass(order: list[tuple[int, Plan]], k: int) -> None:
        for i, plan in (order if k % 2 == 0 else order[::-1]):
            run = compiled(i, plan)
            ((sec, mem),) = measure_plans([run], steps=steps, warmup=warmup, rounds=rounds,
                                          log=log)
            best[i] = (min(sec, best[i][0]), best[i][1]) if i in best else (sec, mem)
            run.runner.release_groups()                 # its communicators
            del run
            gc.collect()                                # the runner's tensors, before the next
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    everyone = list(enumerate(candidates))
    for k in range(passes):
        one_pass(everyone, k)
    if passes > 1:                          # the contenders, as many passes more (see above)
        fastest = min(sec for sec, _ in best.values())
        contenders = [(i, plan) for i, plan in everyone
                      if best[i][0] <= (1 + CONTENDER_MARGIN) * fastest]
        for k in range(passes, 2 * passes):
            if len(contenders) > 1:
                one_pass(contenders, k)
    return [best[i] for i in range(len(candidates))]


# ---- the whole run ----

def tune(model_fn: Callable[[], torch.nn.Module], *, gpus: int, example_inputs: tuple,
         loss_fn: Callable | None = None, example_targets: Any = None,
         global_batch_size: int, cluster: Any = "local-cpu", top: int = 4, steps: int = 3,
         warmup: int = 2, rounds: int = 3, plans: tuple[dict, ...] = (),
         vocab: int | None = None, interleaved: bool = False, passes: int = 2,
         name: str | None = None, log: Callable[[str], None] = print) -> TuneResult:
    """Plan, measure, choose, refit (module doc); call on every rank of an initialised
    process group of `gpus` ranks. `model_fn()` builds the model (each trial compiles a fresh
    one, same seed on every rank); rank 0 logs each trial as it is measured. interleaved,
    passes: `measure_candidates`' (default one candidate alive at a time, in two passes);
    with passes > 1 (one at a time) the plans measured far slower than the refit prices them
    (`autopar.tune_fit.suspects`) are measured once more, and the fit made again.
    Why this size: the public entry point of `autopar tune`: the planning keywords of
    parallelize plus the trial budget, measured steps and refit switch."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"tune: passes={passes!r}: must be an int >= 1, the times every "
                         f"candidate is measured (one at a time); pass 1 or 2")
    if not dist.is_initialized() or dist.get_world_size() != gpus:
        raise ValueError(f"tune: gpus={gpus} but the process group has "
                         f"{dist.get_world_size() if dist.is_initialized() else 'no'} ranks; "
                         f"run under torchrun --nproc-per-node={gpus} (or autopar tune)")
    plans = tuple(Pins.of(pins, "tune: plans=") for pins in plans)   # one line per bad knob
    cl = get_cluster(cluster)
    model = model_fn()
    vocab = vocab or getattr(getattr(model, "config", None), "vocab_size", None) or int(
        example_inputs[0].max()) + 1
    candidates, solve_pins = candidate_plans(
        model, gpus=gpus, example_inputs=example_inputs, loss_fn=loss_fn,
        example_targets=example_targets, global_batch_size=global_batch_size, cluster=cl,
        top=top, named=plans, name=name)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")

    def say(line: str) -> None:
        if dist.get_rank() == 0:
            log(line)

    def compiled(i: int, plan: Plan) -> PlanRun:
        run = PlanRun(model_fn, plan, example_inputs=example_inputs, loss_fn=loss_fn,
                      vocab=vocab, device=device)
        say(f"[{i + 1}/{len(candidates)}] compiled {pins_label(plan_pins(plan))}: predicted "
            f"{plan.predicted.step_time_s * 1e3:.1f} ms")
        return run
    measured = measure_candidates(
        candidates, compiled, steps=steps, warmup=warmup, rounds=rounds, log=say,
        interleaved=interleaved, passes=passes)
    trials = [measured_trial(plan, s, m, cl, solve_pins)
              for plan, (s, m) in zip(candidates, measured)]
    note = f"{len(trials)} plans of {name or type(model).__name__}"
    trials, scales, refit = _refitted(trials, cl, solve_pins, note)
    again = suspects(trials) if passes > 1 and not interleaved else []
    if again:   # every rank fitted the same (all-reduced) times: the same plans
        say(f"measuring again {len(again)} plan(s) measured far slower than the refit prices "
            f"them (autopar.tune_fit.suspects)")
        more = measure_candidates([candidates[i] for i in again],
                                  lambda j, plan: compiled(again[j], plan), steps=steps,
                                  warmup=warmup, rounds=rounds, log=say, interleaved=False)
        least = {i: sec for i, (sec, _) in zip(again, more)}
        trials = [dataclasses.replace(tr, measured_s=min(tr.measured_s, least[i]))
                  if i in least else tr for i, tr in enumerate(trials)]
        trials, scales, refit = _refitted(trials, cl, solve_pins, note)
    dist.barrier()   # not runner.close(): that would end the caller's process group
    return TuneResult(trials=tuple(trials), cluster=cl, refit=refit, scales=scales)


def _refitted(trials: list[Trial], cluster: Cluster, solve_pins: Callable[[Cluster, dict], Plan],
              note: str) -> tuple[list[Trial], Scales, Cluster]:
    """The trials with their refit prices, the scales fitted to them, the refitted cluster."""
    scales = fit_scales(trials)
    refit = refit_cluster(cluster, scales, note)
    return ([dataclasses.replace(tr, refit_s=solve_pins(refit, plan_pins(tr.plan))
                                 .predicted.step_time_s) for tr in trials], scales, refit)


# ---- the command line (`autopar tune`) ----

def cli_run(spec: str, *, gpus: int, batch: int | None, seq: int | None, cluster: str,
            top: int, steps: int, out: str, cluster_out: str | None, passes: int = 2) -> None:
    """`autopar tune` on every rank (torchrun's, or local CPU ranks the CLI spawned).
    Why this size: the CLI's parsed flags, passed through to `tune` on every rank."""
    import json

    from autopar.cost.hardware import (CLUSTER_NAMES, local_cluster_path, read_cluster_file,
                                       save_cluster)
    from autopar.presets import load_model

    if ":" not in spec:
        raise ValueError(f"autopar tune {spec}: a preset is a meta-device model with no "
                         f"weights to run; give your model as file.py:factory")

    def model_fn():
        torch.manual_seed(0)
        return load_model(spec, seq_len=seq, device="cpu")[0].model

    user, _ = load_model(spec, seq_len=seq, device="cpu")
    inputs = user.inputs(seq_len=seq, option="--seq") if seq else user.inputs()
    result = tune(model_fn, gpus=gpus, example_inputs=inputs, loss_fn=user.loss(),
                  example_targets=user.example_targets,
                  global_batch_size=batch or inputs[0].shape[0] * gpus, cluster=cluster,
                  top=top, steps=steps, passes=passes, name=user.name)
    if dist.get_rank() != 0:
        return
    print(result.table(), flush=True)
    from pathlib import Path
    Path(out).write_text(result.best.to_json())
    record: dict[str, Any] = {}
    if cluster_out is None:
        if cluster == "local-cpu":
            cluster_out = str(local_cluster_path())
        elif cluster in CLUSTER_NAMES:
            cluster_out = f"{cluster}-tuned.json"
        else:
            cluster_out = cluster
    if Path(cluster_out).is_file():
        try:
            record = read_cluster_file(cluster_out)[1]
        except ValueError:
            record = {}
    record["tune"] = {"plans": [{"plan": tr.label, "predicted_s": tr.plan.predicted.step_time_s,
                                 "measured_s": tr.measured_s, "refit_s": tr.refit_s,
                                 "measured_memory_bytes": tr.measured_memory_bytes,
                                 "dispatch_s": tr.dispatch_s, "tp_s": tr.tp_s,
                                 "cp_s": tr.cp_s} for tr in result.trials],
                      "scales": dataclasses.asdict(result.scales)}
    save_cluster(result.refit, cluster_out, json.loads(json.dumps(record)))
    print(f"wrote {out} (the fastest measured: {pins_label(plan_pins(result.best))}) and the "
          f"refitted cluster {cluster_out} (plan with --cluster {cluster_out})", flush=True)


def _spawned(rank: int, world: int, kwargs: dict[str, Any]) -> None:
    cli_run(**kwargs)
