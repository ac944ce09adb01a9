"""Text rendering of a Plan: the table `print(plan)` shows and `plan.explain()`.

Pure string functions over the Plan dataclasses; no cost-model calls here (the numbers were
computed by the solver with the cost model and travel inside the Plan). Presentation sits above
the plan type: this module registers its renderers with autopar.plan when imported
(`present`), and plan.py imports nothing of it (tests/unit/test_import_cycles.py). Whatever
hands a user a Plan loads it: autopar.api (parallelize, load_plan), the cost package (the
solver's plans) and the CLI; the runtime, which reads plans, never does.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from autopar.plan import present
from autopar.words import bubble_text, layer_range

if TYPE_CHECKING:
    from autopar.plan import Alternative, Memory, Plan, Prediction, TrainingEstimate

GIB = 1024 ** 3


def _bubble(fraction: float) -> str:
    return bubble_text(fraction)


def _fmt_s(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _fmt_flops(tflops: float) -> str:
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.2f} GFLOP/s"


def _fmt_bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 1024 ** 2:
        return f"{n / 1024 ** 2:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _rank_layout(plan: "Plan") -> str:
    """Megatron rank order, tensor innermost: rank = pp·(t·c·d) + dp·(t·c) + cp·t + tp
    (autopar/runtime/groups.py)."""
    from autopar.runtime.groups import coords_rank
    t, c, d, p = plan.t, plan.c, plan.d, plan.p
    example = []
    for pp in range(min(p, 2)):
        for dp in range(min(d, 2)):
            for cp in range(min(c, 2)):
                ranks = [coords_rank(tp, dp, pp, t, p, d, cp=cp, c=c) for tp in range(t)]
                shown = (", ".join(map(str, ranks)) if t <= 4
                         else f"{ranks[0]}-{ranks[-1]}")
                example.append(f"pp{pp}/dp{dp}" + (f"/cp{cp}" if c > 1 else "")
                               + f": ranks {shown}")
    if c == 1:
        return "tensor innermost, then data, pipeline outermost (rank = pp·t·d + dp·t + tp); " + \
            "; ".join(str(e) for e in example)
    return ("tensor innermost, then context, then data, pipeline outermost (rank = pp·t·c·d + "
            "dp·t·c + cp·t + tp); " + "; ".join(str(e) for e in example))


def format_plan(plan: "Plan") -> str:
    pr = plan.predicted
    lines = [
        f"autopar plan for {plan.model} on {plan.gpus} GPUs ({plan.cluster})",
        "─" * 72,
        f"  degrees        t={plan.t} (tensor)  "
        + (f"c={plan.c} (context: each sequence in {2 * plan.c} chunks of "
           f"{plan.seq_len // (2 * plan.c)} tokens, K/V by {plan.cp_attention})  "
           if plan.c > 1 else "")
        + f"p={plan.p} (pipeline)  d={plan.d} (data)  v={plan.v} (chunks/rank)"
        + (f"  ep={plan.ep} (experts over {plan.ep} of the c·d ranks, tokens by all-to-all)"
           if plan.ep > 1 else ""),
        f"  batch          global {plan.global_batch_size} = micro-batch {plan.micro_batch_size}"
        f" × {plan.num_microbatches} micro-batches × d {plan.d}; sequence {plan.seq_len}",
        f"  schedule       {plan.schedule}{_group(plan)}   recompute {plan.recompute}   "
        f"sequence-parallel {'yes' if plan.sequence_parallel else 'no'}   zero {plan.zero}"
        + (f"   attention {pr.attention}" if pr.attention else "")
        + (f"   elementwise {pr.elementwise}" if pr.elementwise else ""),
        f"  rank layout    {_rank_layout(plan)}",
        "  stages         (layer ranges [first, last): last exclusive, as in the JSON)",
    ]
    lines += _stage_lines(plan)
    lines += [
        "  predicted",
        f"    step time      {_fmt_s(pr.step_time_s)}",
        f"    throughput     {_fmt_flops(pr.tflops_per_gpu)} per GPU   MFU {pr.mfu * 100:.1f}%",
        f"    {_bubble(pr.bubble_fraction)} = {_fmt_s(pr.bubble_s)} per step",
        "    time terms     " + "  ".join(f"{k} {_fmt_s(v)}" for k, v in pr.terms().items() if v),
        f"    memory/GPU     {_fmt_bytes(pr.memory_bytes_per_gpu)}" + _memory_parts(pr),
    ] + _checkpoint_line(pr)
    if plan.training is not None:
        lines += format_training(plan.training, plan.gpus, plan.seq_len)
    return "\n".join(lines)


def _fmt_duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} hours"
    return _fmt_s(seconds)


def format_training(tr: "TrainingEstimate", gpus: int, seq_len: int) -> list[str]:
    """The time-to-train section of a plan: days, GPU-hours, the batch and why."""
    tried = ", ".join(f"{b.global_batch_size}: " + (_fmt_duration(b.train_time_s)
                                                    if b.train_time_s is not None else "no plan")
                      for b in tr.trials)
    return [
        "  time to train",
        f"    tokens         {tr.tokens:.4g} (E_min, small-batch tokens; this batch reads "
        f"{tr.tokens_processed:.4g} in {tr.steps:,.0f} steps)",
        f"    duration       {_fmt_duration(tr.train_time_s)} on {gpus} GPUs = "
        f"{tr.gpu_hours:,.0f} GPU-hours",
        f"    batch          {tr.batch_tokens // seq_len} sequences = {tr.batch_tokens:,} tokens"
        f"; critical batch {tr.critical_batch_tokens:,.0f} tokens ({tr.critical_batch_source})",
        f"    why this batch {tr.batch_reason}",
        f"    batches tried  {tried}",
    ]


def _stage_lines(plan: "Plan") -> list[str]:
    """One line per chunk; runs of plain chunks with equal layer counts fold into one line."""
    out, i, stages = [], 0, plan.stages
    while i < len(stages):
        st, j = stages[i], i
        plain = not (st.embedding or st.head)
        while (plain and j + 1 < len(stages) and not (stages[j + 1].embedding or stages[j + 1].head)
               and stages[j + 1].num_layers == st.num_layers
               and stages[j + 1].kinds == st.kinds):
            j += 1
        if j - i >= 2:
            n = st.num_layers
            out.append(f"    chunks {st.chunk:>3}-{stages[j].chunk:<3} "
                       f"{_ranks_text(st.chunk, stages[j].chunk, plan.p)}: {n} "
                       f"layer{'s' if n != 1 else ''} each, "
                       f"{layer_range(st.first_layer, stages[j].last_layer)}"
                       + (f" ({st.kinds}; {st.layers_ms:g} ms/micro-batch each)"
                          if st.kinds else ""))
        else:
            j = i
            out.append(f"    chunk {st.chunk:>3} on pipeline rank {st.rank:>3}: {st.describe()}")
        i = j + 1
    return out


def _ranks_text(first: int, last: int, p: int) -> str:
    """Where chunks first..last run, in words: chunk c runs on pipeline rank c mod p."""
    if p == 1:
        return "on pipeline rank 0"
    if last - first + 1 >= p:
        return f"on all {p} pipeline ranks (chunk c on rank c mod {p})"
    return "on pipeline ranks " + ", ".join(str(c % p) for c in range(first, last + 1))


def _checkpoint_line(pr: "Prediction") -> list[str]:
    """What a checkpoint save adds (autopar.runtime.checkpoint): each rank writes the shard it
    holds, copied to host one piece (≤ 1/16 of its weights + optimizer state) at a time; an
    asynchronous save stages all of it in (pinned) host memory."""
    m = pr.memory
    if m is None:
        return []
    state = m.weights_bytes + m.optimizer_bytes
    return [f"    checkpoint     each rank writes its own shard: GPU memory + 0, host + "
            f"{_fmt_bytes(state / 16)} per piece (sync), + {_fmt_bytes(state)} staged (async)"]


def _memory_parts(pr: "Prediction | Memory") -> str:
    m = pr.memory if hasattr(pr, "memory") else pr
    if m is None:
        return ""
    return (f" = weights {_fmt_bytes(m.weights_bytes)} + grads {_fmt_bytes(m.gradients_bytes)}"
            f" + optimizer {_fmt_bytes(m.optimizer_bytes)} + activations "
            f"{_fmt_bytes(m.activations_bytes)}"
            + (f" + recompute {_fmt_bytes(m.recompute_bytes)}" if m.recompute_bytes else "")
            + (f" + other {_fmt_bytes(m.other_bytes)}" if m.other_bytes else ""))


def _memory_by_rank(plan: "Plan") -> list[str]:
    """One line per pipeline rank (runs of equal ranks folded): predicted memory by part; the
    first rank usually carries the most (the embedding and the most micro-batches in flight)."""
    ranks = plan.predicted.rank_memory
    if not ranks:
        return []
    heaviest = max(range(len(ranks)), key=lambda r: ranks[r].total_bytes)
    lines = ["", f"Predicted memory per GPU by pipeline rank (heaviest: rank {heaviest}, "
                 f"{_fmt_bytes(ranks[heaviest].total_bytes)}):"]
    r = 0
    while r < len(ranks):
        j = r
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[r] and j + 1 != heaviest \
                and r != heaviest:
            j += 1
        label = f"rank {r}" if j == r else f"ranks {r}-{j}"
        lines.append(f"  {label:<12} {_fmt_bytes(ranks[r].total_bytes):>10}"
                     + _memory_parts(ranks[r]).replace(" = ", "  = ", 1))
        r = j + 1
    return lines


def _table_unit(seconds: float) -> tuple[float, str]:
    """(scale, suffix) of the one time unit a table uses, chosen by its reference time."""
    if seconds >= 1.0:
        return 1.0, "s"
    return (1e3, "ms") if seconds >= 1e-3 else (1e6, "us")


def _in_unit(seconds: float, unit: tuple[float, str]) -> str:
    return f"{seconds * unit[0]:.4g} {unit[1]}"


_SECONDS = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?(?:e[-+]?\d+)?) s\b")


def _reason_in_unit(reason: str, unit: tuple[float, str]) -> str:
    """A solver reason ("slower: 0.005547 s vs 0.00555 s") in the table's unit."""
    return _SECONDS.sub(lambda m: _in_unit(float(m[1]), unit), reason)


def _alt_row(rank: int, alt: "Alternative", best_s: float, chosen: bool = False) -> str:
    pr = alt.predicted
    unit = _table_unit(best_s)
    if pr is None:
        return f"  {rank:>3}. {alt.label():<58} rejected: {_reason_in_unit(alt.reason, unit)}"
    slower = (pr.step_time_s / best_s - 1.0) * 100 if best_s > 0 else 0.0
    terms = ", ".join(f"{k} {_in_unit(v, unit)}" for k, v in pr.terms().items() if v)
    reason = _reason_in_unit(alt.reason or "", unit)
    verdict = "chosen" if chosen else (
        f"+{slower:.1f}%" if alt.feasible else f"infeasible: {reason}")
    return (f"  {rank:>3}. {alt.label():<58} {_in_unit(pr.step_time_s, unit):>10}  "
            f"{_fmt_flops(pr.tflops_per_gpu):>15}/GPU  mem {_fmt_bytes(pr.memory_bytes_per_gpu):>10}  "
            f"{verdict}\n        {terms}" + (f"\n        {reason}" if alt.feasible and
                                               reason else ""))


def _is_plan(plan: "Plan", alt: "Alternative") -> bool:
    """The alternative is the plan's own configuration: every knob it names equal, and its
    predicted step time the plan's."""
    return (alt.feasible and alt.predicted is not None
            and abs(alt.predicted.step_time_s - plan.predicted.step_time_s)
            <= 1e-9 * plan.predicted.step_time_s
            and all(getattr(plan, k, None) == v for k, v in alt.config.items()))


def format_explain(plan: "Plan", top: int = 10) -> str:
    best = plan.predicted.step_time_s
    feasible = [a for a in plan.alternatives if a.feasible and a.predicted is not None]
    feasible.sort(key=lambda a: a.predicted.step_time_s)
    rejected = [a for a in plan.alternatives if not a.feasible]
    lines = [f"Why t={plan.t} c={plan.c} ep={plan.ep} p={plan.p} d={plan.d} v={plan.v} "
             f"b={plan.micro_batch_size} "
             f"{plan.schedule} recompute={plan.recompute} zero={plan.zero}: "
             f"predicted {_fmt_s(best)} per step, {_bubble(plan.predicted.bubble_fraction)},"
             f" the fastest of {len(feasible)} feasible configurations weighed.",
             _degree_reason(plan, feasible, rejected, "c", "Context parallelism", (
                 "no plan with another c was weighed (c pinned, or no c > 1 divides the GPUs "
                 "and the sequence into 2c chunks).")),
             *_cp_attention_reason(plan, feasible, rejected),
             _degree_reason(plan, feasible, rejected, "ep", "Expert parallelism", (
                 "no plan with another ep was weighed (ep pinned, no mixture of experts, or no "
                 "ep > 1 divides both c·d and the experts per layer).")), "",
             "Ranked feasible alternatives (best per knob set):"]
    lines += [_alt_row(i + 1, a, best, chosen=_is_plan(plan, a))
              for i, a in enumerate(feasible[:top])]
    if len(feasible) > top:
        lines.append(f"  … {len(feasible) - top} more feasible configurations, all slower")
    lines += _memory_by_rank(plan)
    if plan.notes:
        lines += ["", "What the graph passes decided for this plan:"]
        lines += [f"  {n}" if not n.startswith(" ") else n for n in plan.notes]
    if rejected:
        lines += ["", "Rejected configurations (and why):"]
        by_reason: dict[str, list[Alternative]] = {}
        for a in rejected:
            by_reason.setdefault(a.reason, []).append(a)
        for reason, alts in sorted(by_reason.items(), key=lambda kv: -len(kv[1]))[:top]:
            sample = "; ".join(a.label() for a in alts[:2])
            more = f" (+{len(alts) - 2} more)" if len(alts) > 2 else ""
            lines.append(f"  - {reason}\n      e.g. {sample}{more}")
    return "\n".join(lines)


_CP_WHY = {   # what each method's exchange is, for the reason line
    "all-gather": "the all-gather moves the K/V once, exposed (cheap when kv heads are few)",
    "ring": "the ring hides each K/V block's transfer under a step's attention, paying c "
            "short-key kernels and c−1 merges",
    "all-to-all": "the all-to-alls trade q, k, v and the output (heads/c of the whole "
                  "sequence per rank): a volume that does not grow with c, exposed",
    "hybrid": "the all-to-alls run over the context ranks inside a node (fast link) and only "
              "the K/V of their heads/k heads is all-gathered across nodes",
    "hybrid-ring": "the all-to-alls run over the context ranks inside a node (fast link) and "
                   "the K/V of their heads/k heads travels round a ring across nodes, each "
                   "hop hidden under a step's attention",
}


def _cp_attention_reason(plan: "Plan", feasible: list, rejected: list) -> list[str]:
    """Why the plan's context attention (c > 1): for each other method, the best weighed plan
    with the same c and that method, its context-parallel cost against the chosen one's, or
    why its plans were rejected (pruned by a lower bound, memory), or the exchange rejection
    that displaced it (at any c: the solver lists each reason once); none for c = 1."""
    if plan.c == 1:
        return []
    head = f"Context attention {plan.cp_attention}: {_CP_WHY[plan.cp_attention]}; "
    best: dict[str, Any] = {}
    for a in feasible + rejected:
        how = a.config.get("cp_attention", "all-gather")
        if a.config.get("c") == plan.c and how != plan.cp_attention and how not in best:
            best[how] = a
    if not best:     # none kept at this c: the best kept plan of each other method, any c
        for a in feasible:
            how = a.config.get("cp_attention", "all-gather")
            if a.config.get("c", 1) > 1 and how != plan.cp_attention and how not in best:
                best[how] = a
        if best:
            return [head + "no other method was kept at this c; the best kept plans with "
                    "another: " + "; ".join(f"{how} {a.label()} {_fmt_s(a.predicted.step_time_s)}"
                                            f" per step" for how, a in best.items())
                    + f" (this plan {_fmt_s(plan.predicted.step_time_s)})."]
    if not best:
        return [head + "no other method was weighed (pinned, or the model does not allow "
                       "it: heads not divisible by t·c for all-to-all or by no divisor of c "
                       "for hybrid, attention written out for ring, all-to-all and hybrid, "
                       "or the pass cannot build it: see the notes)."]
    for a in rejected:   # a method displaced at every knob: its exchange's reason, any c
        how = a.config.get("cp_attention", "all-gather")
        if how not in best and how != plan.cp_attention and a.reason.startswith("slower exch"):
            best[how] = a
    parts = [f"{_fmt_s(a.predicted.cp_comm_s)} with {how} (its best plan {a.label()} "
             f"{_fmt_s(a.predicted.step_time_s)} per step)" if a.feasible else
             f"with {how} not weighed: {a.reason} ({a.label()})" for how, a in best.items()]
    return [head + f"its context-parallel cost is {_fmt_s(plan.predicted.cp_comm_s)} per step "
                   f"(plan {_fmt_s(plan.predicted.step_time_s)}) vs " + "; ".join(parts) + "."]


def _degree_reason(plan: "Plan", feasible: list, rejected: list, knob: str, title: str,
                   none: str) -> str:
    """Why the plan's degree `knob` (c or ep): the best weighed plan with another value (its
    cost terms against the chosen one's), or why none with another value was feasible."""
    mine = getattr(plan, knob)
    others = [a for a in feasible if a.config.get(knob, 1) != mine]
    lost = [a for a in rejected if a.config.get(knob, mine) != mine]
    head = f"{title} {knob}={mine}: "
    if others:
        a = others[0]
        diffs = sorted(((v - plan.predicted.terms()[k], k) for k, v in a.predicted.terms().items()),
                       reverse=True)
        worse = ", ".join(f"{k} {_fmt_s(dv)} larger" for dv, k in diffs[:2] if dv > 0)
        return (head + f"the best plan with {knob}={a.config.get(knob, 1)} ({a.label()}) takes "
                f"{_fmt_s(a.predicted.step_time_s)} per step vs {_fmt_s(plan.predicted.step_time_s)}"
                + (f" ({worse})" if worse else "") + ".")
    if lost:
        return head + f"every weighed plan with another {knob} was rejected, e.g. {knob}=" \
            f"{lost[0].config.get(knob, 1)}: {lost[0].reason}."
    return head + none


def _group(plan: Plan) -> str:
    """' (N=16 micro-batches per chunk visit)' for an interleaved plan with a wider group."""
    if plan.microbatch_group is None:
        return ""
    return f" (N={plan.microbatch_group} micro-batches per chunk visit)"


present(table=format_plan, explain=format_explain)
