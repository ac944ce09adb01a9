"""What combines with what: the rules of a planning request, stated once.

Every rule is a pure function returning why a value or a combination is refused (one line:
the value, the rule, the fix; None when allowed), so each caller raises it under its own name:
the request (`autopar.request.Pins` / `PlanRequest`, built by parallelize, the CLI, tune,
scale and launch's re-plan), the Plan (`autopar.plan`), the solver (`cost/solver.py`, which
also uses them to skip combinations it may not choose) and compile (`autopar/compile.py`).

Rules that read the model (the heads t must divide, the sequence a context split needs on a
profile, the experts ep must divide, the attention methods the context-parallel pass builds)
live with the facts they read: cost/families.py (`tensor_rule`, `context_rule`,
`cp_attention_rule`) and autopar/api.py `context_methods` (the pass tried on the graph).

A new rule (a new knob, a new pair that cannot run together) goes here, with its test in
tests/unit/test_rules.py. A leaf module: it imports only autopar.schedules.
"""
from __future__ import annotations

from typing import Any

from autopar.schedules import GROUPED, SCHEDULE_NAMES, SPLIT_BACKWARD

# activation recomputation (passes/recompute.py): none, Megatron's selective (the attention
# core) and full (whole blocks), and torchtitan's per-op selective ("op": every other GEMM's
# output kept, the rest recomputed)
RECOMPUTE = ("none", "selective", "full", "op")
ZERO_LEVELS = (0, 1, 2, 3)
# how context parallelism's attention reads the other ranks' keys and values: all-gathered
# before attention (Llama 3's method), or passed round the context ranks block by block while
# attending (ring attention, 2310.01889), autopar/runtime/ring_attention.py, or traded for
# heads by all-to-all around attention (DeepSpeed-Ulysses, 2309.14509), runtime/ulysses.py, or
# "hybrid": all-to-all inside a node, the K/V all-gather across (Megatron-Core's a2a+p2p; its
# inner degree: autopar/runtime/groups.py hybrid_inner_degree), or "hybrid-ring": the
# all-to-all inside a node, ring attention across (a2a+p2p as TransformerEngine runs it): the
# methods the solver weighs (the hybrids only where a context group spans nodes and they are
# not dominated; hybrid-ring only where its exchange costs no more than the hybrid's:
# cost/families.py _Exchanges, cost/exchanges.py hybrid_ring_weighed). CP_ATTENTION_PINNED:
# what a pin may name (the same methods).
CP_ATTENTION = ("all-gather", "ring", "all-to-all", "hybrid", "hybrid-ring")
CP_ATTENTION_PINNED = CP_ATTENTION
# the schedules that run several chunks per pipeline rank (v > 1); cost.model's
# SCHEDULE_TRAITS[...].multi_chunk says the same (tests/unit/test_rules.py)
MULTI_CHUNK = ("interleaved-1f1b", "interleaved-zb", "breadth-first")
# what parallelize prices the GEMMs at: "auto" plans bf16 and (where the cluster has an FP8
# rate) fp8 and keeps the faster
PLAN_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "auto")
# the knobs that are counts (degrees and sizes): positive ints
COUNTS = ("t", "c", "ep", "p", "d", "v", "micro_batch_size", "microbatch_group",
          "global_batch_size")
# the knobs that name one of a few choices
CHOICES: dict[str, tuple] = {"schedule": SCHEDULE_NAMES, "recompute": RECOMPUTE,
                             "zero": ZERO_LEVELS, "cp_attention": CP_ATTENTION_PINNED,
                             "precision": PLAN_PRECISIONS}


def knob_refusal(name: str, value: Any, free: bool = True) -> str | None:
    """Why `value` is not a value of the knob `name` (None: it is, or it is None = free).
    free: the fix offers leaving the knob to the solver (a request; not a Plan's field)."""
    if value is None:
        return None
    leave = ", or leave it None for the solver to choose" if free else ""
    if name in COUNTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name}={value!r}: must be a positive integer; pass {name}=1 or more{leave}"
        return None
    if name == "sequence_parallel":
        if not isinstance(value, bool):
            return f"sequence_parallel={value!r}: must be True or False{leave}"
        return None
    choices = CHOICES.get(name)
    if choices is not None and (value not in choices or isinstance(value, bool)):
        return f"{name}={value!r}: must be one of {choices}{leave}"
    return None


def schedule_refusal(schedule: str | None, v: int | None,
                     microbatch_group: int | None) -> str | None:
    """A pinned schedule against the pins only some schedules run: v > 1 chunks per rank,
    micro-batch groups N (the interleaved schedules)."""
    if schedule is None:
        return None
    if v is not None and v > 1 and schedule not in MULTI_CHUNK:
        return (f"v={v} with schedule={schedule!r}: several chunks per pipeline rank need "
                f"schedule {' or '.join(map(repr, MULTI_CHUNK))}; set v=1 or change the "
                f"schedule")
    if microbatch_group is not None and schedule not in GROUPED:
        return (f"microbatch_group={microbatch_group} with schedule={schedule!r}: only the "
                f"interleaved schedules {GROUPED} run micro-batches in groups; unpin one of "
                f"them")
    return None


def recompute_refusal(recompute: str | None, schedule: str | None) -> str | None:
    """'op' recompute runs under PyTorch's selective checkpoint, whose kept outputs a region's
    backward may read once; a split backward (the zero-bubble schedules) runs each chunk's
    backward in two parts, input gradients then weight gradients, and would read them twice."""
    if recompute != "op" or schedule not in SPLIT_BACKWARD:
        return None
    return (f"recompute='op' with schedule={schedule!r}: PyTorch's selective checkpoint lets a "
            f"region's backward run once, and {schedule}'s split backward runs it in two parts "
            f"(input, then weight gradients); use recompute 'full' or 'selective' with it, or "
            f"another schedule")


def zero_refusal(zero: int | None, schedule: str | None) -> str | None:
    """ZeRO-2/3 keep the weights sharded between uses and gather them for each forward and
    backward; a split backward (the zero-bubble schedules) runs a chunk's weight gradients (W)
    later, apart from its input gradients, and the runtime does not gather the weights again
    for them. cost/config.py SCHEDULE_TRAITS' zero_levels say the same to the solver."""
    if zero not in (2, 3) or schedule not in SPLIT_BACKWARD:
        return None
    return (f"zero={zero} with schedule={schedule!r}: sharded weights are not gathered for the "
            f"deferred weight-gradient halves (W) of its split backward; use zero=0 or 1 with "
            f"this schedule, or another schedule for zero={zero}")


def expert_degree_refusal(ep: int, c: int, d: int) -> str | None:
    """ep must divide c·d: the expert-parallel ranks are drawn from the ranks that hold the
    same dense weights (Megatron-Core's rule; the rank math: autopar/runtime/groups.py)."""
    if (c * d) % ep:
        return (f"ep={ep} with c·d = {c}·{d} = {c * d}: the expert-parallel ranks are drawn "
                f"from the c·d data-and-context-parallel ranks, so ep must divide {c * d}; "
                f"pick an ep that divides it (ep=1 for none)")
    return None


def degrees_refusal(gpus: int, *, t: int | None, c: int | None, p: int | None,
                    d: int | None) -> str | None:
    """The pinned degrees against the GPU count: the world is t·c·p·d ranks."""
    pinned = {n: x for n, x in (("t", t), ("c", c), ("p", p), ("d", d)) if x is not None}
    prod = 1
    for x in pinned.values():
        prod *= x
    if not pinned or (gpus % prod == 0 and (len(pinned) < 4 or prod == gpus)):
        return None
    text = "·".join(f"{n}={x}" for n, x in pinned.items())
    return (f"pins {text} multiply to {prod}, "
            + ("which does not divide" if gpus % prod else "not") + f" gpus={gpus}; "
            f"t·c·p·d must equal the GPU count: change a pin or gpus")


def cp_attention_refusal(cp_attention: str | None, c: int | None) -> str | None:
    """The hybrid context method splits the c context ranks into k inner × c/k outer with
    1 < k < c (autopar/runtime/groups.py hybrid_inner_degree), so c needs such a divisor."""
    if (cp_attention not in ("hybrid", "hybrid-ring") or c is None or c == 1
            or not isinstance(c, int)):
        return None
    if any(c % k == 0 for k in range(2, c)):
        return None
    return (f"cp_attention={cp_attention!r} with c={c}: the hybrid splits the c context ranks "
            f"into k inner (all-to-all) × c/k outer (all-gather or ring) with 1 < k < c, and "
            f"{c} has no such divisor; pin cp_attention='all-to-all' (or 'all-gather'), or a c "
            f"such as 4")


def context_split_refusal(seq_len: int, c: int | None) -> str | None:
    """Context parallelism cuts each sequence into 2c equal chunks (rank i holds chunks i and
    2c-1-i: the causal work balanced)."""
    if c is None or c == 1 or seq_len % (2 * c) == 0:
        return None
    return (f"c={c} with sequence length {seq_len}: context parallelism cuts each sequence "
            f"into 2c = {2 * c} equal chunks; pad the sequence to a multiple of {2 * c} or pick "
            f"a smaller c")
