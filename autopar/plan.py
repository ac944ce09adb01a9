"""`Plan`: the inspectable result of planning (degrees, stages, predictions, alternatives).

A Plan is a frozen keyword-only dataclass with a JSON round-trip. `print(plan)` shows a table;
`plan.explain()` ranks the alternatives the solver weighed and says why each one lost.
Field names are the public contract of docs/DESIGN.md §2.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from autopar.words import BUBBLE_MEANING, bubble_text, layer_range  # noqa: F401 (re-exported)
# what combines with what, and the knobs' values: autopar/rules.py (re-exported here)
from autopar.rules import (CP_ATTENTION, CP_ATTENTION_PINNED, MULTI_CHUNK, RECOMPUTE, ZERO_LEVELS,  # noqa: F401
                           cp_attention_refusal, expert_degree_refusal, knob_refusal,
                           recompute_refusal, zero_refusal)
from autopar.schedules import GROUPED, SCHEDULE_NAMES, check_group

SCHEDULES = SCHEDULE_NAMES

# Plan's text ("table": print(plan), "explain": plan.explain()), registered by autopar/report.py
_RENDERERS: dict[str, Callable[..., str]] = {}


def present(*, table: Callable[..., str], explain: Callable[..., str]) -> None:
    """Register the renderers of `print(plan)` and `plan.explain()` (autopar/report.py calls
    this once, when imported: presentation sits above the plan type)."""
    _RENDERERS.update(table=table, explain=explain)

GB = 1024 ** 3

@dataclass(frozen=True, kw_only=True)
class Stage:
    """One pipeline chunk: blocks [first_layer, last_layer) on pipeline rank `rank`.

    `embedding` / `head`: whether the chunk also holds the embedding (first chunk) or the head
    and loss (last chunk). Chunk c runs on pipeline rank c mod p (interleaved placement).
    """
    chunk: int
    rank: int
    first_layer: int
    last_layer: int
    embedding: bool = False
    head: bool = False
    # a stack of several kinds of layer (cost/kinds.py): the kinds the chunk holds
    # ("3 × layers [dense] + 1 × layers [MoE]") and its layers' time per micro-batch
    # (forward + backward, ms); "" / 0 for a stack of one kind
    kinds: str = ""
    layers_ms: float = 0.0
    # the cost model's forward and backward of the chunk per micro-batch (ms: its layers, the
    # embedding or the head; cost/layout.py chunk_times_s), by which interleaved-zb places its
    # weight-gradient W's (autopar.schedules.make_schedule chunk_times); 0: not recorded (a
    # plan from before 2026-11-27 or written by hand: equal chunks assumed)
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer

    def describe(self) -> str:
        parts = []
        if self.embedding:
            parts.append("embedding")
        if self.num_layers:
            parts.append(layer_range(self.first_layer, self.last_layer)
                         + (f" ({self.kinds}; {self.layers_ms:g} ms/micro-batch)"
                            if self.kinds else ""))
        if self.head:
            parts.append("head+loss")
        return " + ".join(parts) or "(empty)"


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Predicted bytes per GPU of one pipeline rank (by default the most loaded), by part.

    activations_bytes: what the rank's in-flight micro-batches keep for their backwards (the
    tensors autograd saves, or a recomputed layer's inputs); recompute_bytes: the backward's
    working set beside them, the larger of one recomputed layer's activations saved again
    while its backward runs (0 without recompute) and, on the last stage, the loss's
    gradients over the vocabulary; other_bytes: the reserve (CUDA context, workspaces,
    fragmentation)."""
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    other_bytes: float = 0.0
    recompute_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.recompute_bytes + self.other_bytes)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted step: time, throughput, memory, and the per-term breakdown of the step time.

    The terms are the exposed (not overlapped) time of each kind on the critical path; they add
    up to step_time_s. tflops_per_gpu follows the papers' definition (model FLOPs including
    recompute FLOPs, divided by GPUs × step time); mfu uses model FLOPs without recompute.
    """
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    memory_bytes_per_gpu: float
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble_s: float
    optimizer_s: float = 0.0
    # context parallelism's K/V exchange on the critical rank: the all-gathers (and their
    # reduce-scatters in backward) exposed, or under ring attention the block transfers its
    # steps' attention does not hide plus the ring's overheads; 0 for c = 1 (and in plans
    # written before c existed)
    cp_comm_s: float = 0.0
    # the experts' token all-to-alls (dispatch and combine, forward and backward) of expert
    # parallelism on the critical rank; 0 for ep = 1 (and in plans written before ep existed)
    ep_comm_s: float = 0.0
    memory: Memory | None = None
    # per pipeline rank, by part (`memory` is the heaviest of them); and the attention kernel
    # the prediction priced ("flash" | "materialized", cost/hardware.py Cluster.attention)
    rank_memory: tuple[Memory, ...] = ()
    attention: str = ""
    # and how its elementwise ops run ("fused" | "eager", Cluster.elementwise)
    elementwise: str = ""

    def terms(self) -> dict[str, float]:
        return {"compute": self.compute_s, "tensor-parallel comm": self.tp_comm_s,
                "pipeline p2p": self.pp_comm_s, "data-parallel comm": self.dp_comm_s,
                "bubble": self.bubble_s, "optimizer": self.optimizer_s,
                "context-parallel comm": self.cp_comm_s,
                "expert-parallel comm": self.ep_comm_s}


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A configuration the solver weighed: its knobs, its prediction (if feasible), its fate."""
    config: dict[str, Any]
    predicted: Prediction | None
    feasible: bool
    reason: str

    def label(self) -> str:
        c = self.config
        keys = ("t", "c", "cp_attention", "ep", "p", "d", "v", "micro_batch_size", "schedule",
                "recompute", "zero", "sequence_parallel")
        short = {"micro_batch_size": "b", "sequence_parallel": "sp"}
        return " ".join(f"{short.get(k, k)}={c[k]}" for k in keys if k in c)


@dataclass(frozen=True, kw_only=True)
class BatchTrial:
    """One global batch the time-to-train search planned: its time to train, or why none."""
    global_batch_size: int          # sequences per step
    train_time_s: float | None      # None: no plan (memory, divisibility); see note
    step_time_s: float | None = None
    steps: float | None = None
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class TrainingEstimate:
    """Time to train `tokens` under a plan (cost/time_to_train.py; critical batch from
    2001.08361 §5, cost/critical_batch.py). `tokens` is E_min: the tokens a small-batch run
    needs; at this batch the run takes `steps` steps and reads `tokens_processed` tokens."""
    tokens: float
    critical_batch_tokens: float
    critical_batch_source: str      # "given" or how it was estimated
    batch_tokens: int               # global batch × sequence length
    steps: float
    tokens_processed: float
    train_time_s: float
    gpu_hours: float
    batch_reason: str               # why this batch: critical batch, memory, pipeline fill
    trials: tuple[BatchTrial, ...] = ()

    @property
    def days(self) -> float:
        return self.train_time_s / 86400.0


@dataclass(frozen=True, kw_only=True)
class Plan:
    t: int
    p: int
    d: int
    # context parallelism: each sequence split over c ranks (2c chunks, rank i holding chunks
    # i and 2c-1-i); the world is t·c·p·d. Old plan.json files have no c: 1.
    c: int = 1
    # how attention meets the other context ranks' K/V (CP_ATTENTION; meaningful for c > 1):
    # "all-gather" before attention, "ring" (blocks passed round while attending) or
    # "all-to-all" (tokens traded for heads around attention: heads divisible by c) or
    # "hybrid" (all-to-all inside a node, all-gather across: groups.hybrid_inner_degree) or
    # "hybrid-ring" (the same, ring attention across: cost/exchanges.py hybrid_ring_weighed). Old
    # plan.json files have none: "all-gather", the only method before ring attention.
    cp_attention: str = "all-gather"
    # expert parallelism: the experts of a mixture split over ep of the c·d ranks that hold the
    # same dense weights (each holds experts/ep of them; tokens reach their experts by
    # all-to-all); expert gradients are reduced over the c·d/ep ranks holding the same experts
    # (autopar/runtime/groups.py expert_groups). Old plan.json files have no ep: 1.
    ep: int = 1
    v: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    recompute: str
    sequence_parallel: bool
    zero: int
    stages: tuple[Stage, ...]
    predicted: Prediction
    global_batch_size: int
    seq_len: int
    cluster: str
    model: str = "model"
    num_layers: int = 0
    # N consecutive micro-batches per chunk visit of the interleaved schedules (None: p,
    # Megatron's order; m: the breadth-first end; Llama 3's tunable N in between)
    microbatch_group: int | None = None
    # how the plan priced elementwise ops (Cluster.elementwise: "fused" as compiled chunks run,
    # "eager" op by op; None: not recorded, a plan from before 2026-11-26): compile() says
    # when eager chunks run a plan priced fused, which keeps fewer activations than they do
    elementwise: str | None = None
    # The user model's parameters the plan was made for, "name (d0, d1, ...)" in the model's
    # named_parameters() order: compile() checks the model it is given against them (empty:
    # not recorded, e.g. a plan written by hand)
    parameters: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = field(default=(), compare=False)
    # What the graph passes decided for this plan (e.g. tensor-parallel splits and fallbacks).
    notes: tuple[str, ...] = field(default=(), compare=False)
    # Time to train a token budget under this plan (parallelize(tokens=...)); None otherwise.
    training: TrainingEstimate | None = None

    def __post_init__(self) -> None:
        _validate_plan(self)

    @property
    def gpus(self) -> int:
        return self.t * self.c * self.p * self.d

    # ----- presentation: autopar/report.py, above this module, renders the text and registers
    # its renderers here when imported (`present`); this module imports nothing of it. The
    # schedule's Gantt chart: autopar.timeline.plan_timeline ---------------------------------
    def __str__(self) -> str:
        render = _RENDERERS.get("table")
        return render(self) if render is not None else repr(self)

    def explain(self, top: int = 10) -> str:
        """Why this plan: the ranked alternatives the solver weighed, each with its cost terms
        or the rule that rejected it (autopar/report.py `format_explain`)."""
        render = _RENDERERS.get("explain")
        if render is None:
            raise RuntimeError("Plan.explain: the plan text lives in autopar.report, which is "
                               "not loaded; import autopar.report (parallelize, load_plan, the "
                               "solver and the CLI load it)")
        return render(self, top=top)

    # ----- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        data = dict(data)
        data["stages"] = tuple(Stage(**s) for s in data["stages"])
        data["notes"] = tuple(data.get("notes", ()))
        data["parameters"] = tuple(data.get("parameters", ()))
        data["predicted"] = _prediction_from_dict(data["predicted"])
        data["alternatives"] = tuple(
            Alternative(config=a["config"], feasible=a["feasible"], reason=a["reason"],
                        predicted=_prediction_from_dict(a["predicted"]))
            for a in data.get("alternatives", ()))
        if data.get("training") is not None:
            tr = dict(data["training"])
            tr["trials"] = tuple(BatchTrial(**b) for b in tr.get("trials", ()))
            data["training"] = TrainingEstimate(**tr)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"plan JSON has unknown fields {sorted(unknown)}; "
                             f"known fields are {sorted(known)}; was it written by a newer autopar?")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def recorded_chunk_times(plan: "Plan") -> list[tuple[float, float]] | None:
    """(forward, backward) ms of every chunk as the plan's stages record them, or None when
    any stage records none (the schedules then take equal chunks)."""
    times = [(st.fwd_ms, st.bwd_ms) for st in plan.stages]
    return times if times and all(f > 0 or b > 0 for f, b in times) else None


def parameter_signature(model: Any) -> tuple[str, ...]:
    """What Plan.parameters records of a model: "name (d0, d1, ...)" per parameter (tied
    weights once), in named_parameters() order; shapes only, so a meta model gives the same."""
    return tuple(f"{name} {tuple(int(n) for n in p.shape)}"
                 for name, p in model.named_parameters())


def check_model(plan: Plan, model: Any, where: str = "compile") -> None:
    """ValueError naming the first parameter (in the plan's order) that the model lacks or
    holds at another shape, or else the first one the plan lacks; nothing if the plan records
    no parameters."""
    if not plan.parameters:
        return
    want = dict(entry.split(" ", 1) for entry in plan.parameters)
    have = dict(entry.split(" ", 1) for entry in parameter_signature(model))
    fix = ("build the model the plan was made for (the same class and configuration), or "
           "re-plan for this model")
    head = f"{where}: the model does not match the plan (made for {plan.model!r})"
    for name, shape in want.items():
        if name not in have:
            raise ValueError(f"{head}: the plan has parameter {name!r} {shape}, the model has "
                             f"none of that name ({len(have)} parameters, the plan "
                             f"{len(want)}); {fix}")
        if have[name] != shape:
            raise ValueError(f"{head}: parameter {name!r} is {have[name]} in the model but "
                             f"{shape} in the plan; {fix}")
    extra = next(name for name in have if name not in want) if len(have) > len(want) else None
    if extra is not None:
        raise ValueError(f"{head}: the model has parameter {extra!r} {have[extra]}, which the "
                         f"plan does not ({len(have)} parameters, the plan {len(want)}); {fix}")


def _prediction_from_dict(d: dict[str, Any] | None) -> Prediction | None:
    if d is None:
        return None
    d = dict(d)
    if d.get("memory") is not None:
        d["memory"] = Memory(**d["memory"])
    d["rank_memory"] = tuple(Memory(**m) for m in d.get("rank_memory", ()))
    return Prediction(**d)


def _validate_plan(plan: Plan) -> None:
    for name in ("t", "p", "d", "c", "ep", "v", "micro_batch_size", "num_microbatches",
                 "cp_attention", "schedule", "recompute", "zero"):
        value = getattr(plan, name)
        why = knob_refusal("v" if name == "num_microbatches" else name, value, free=False)
        if why or value is None:
            raise ValueError(f"Plan.{name}={value!r}: " + (why.split(": ", 1)[1] if why else
                                                           "must be set"))
    if why := expert_degree_refusal(plan.ep, plan.c, plan.d):
        raise ValueError(f"Plan.{why}")
    if why := cp_attention_refusal(plan.cp_attention, plan.c):
        raise ValueError(f"Plan.{why}")
    if why := recompute_refusal(plan.recompute, plan.schedule) or zero_refusal(plan.zero,
                                                                              plan.schedule):
        raise ValueError(f"Plan.{why}")
    if plan.c > 1 and plan.seq_len % (2 * plan.c):
        raise ValueError(f"Plan.c={plan.c} with seq_len={plan.seq_len}: context parallelism cuts "
                         f"each sequence into 2c = {2 * plan.c} equal chunks; use a sequence "
                         f"length divisible by {2 * plan.c} or a smaller c")
    if plan.v > 1 and plan.schedule not in MULTI_CHUNK:
        raise ValueError(f"Plan.v={plan.v} with schedule={plan.schedule!r}: several chunks per "
                         f"pipeline rank need schedule 'interleaved-1f1b', 'interleaved-zb' or "
                         f"'breadth-first'; set v=1 or change the schedule")
    if plan.microbatch_group is not None:
        if plan.schedule not in GROUPED:
            raise ValueError(f"Plan.microbatch_group={plan.microbatch_group} with schedule="
                             f"{plan.schedule!r}: only the interleaved schedules {GROUPED} run "
                             f"micro-batches in groups; set microbatch_group=None")
        check_group(plan.p, plan.num_microbatches, plan.microbatch_group, "Plan")
    expected = plan.micro_batch_size * plan.num_microbatches * plan.d
    if expected != plan.global_batch_size:
        raise ValueError(
            f"Plan: micro_batch_size·num_microbatches·d = {plan.micro_batch_size}·"
            f"{plan.num_microbatches}·{plan.d} = {expected} != global_batch_size="
            f"{plan.global_batch_size}; the global batch must split exactly into micro-batches "
            f"and data-parallel replicas")
    if len(plan.stages) != plan.p * plan.v:
        raise ValueError(f"Plan.stages has {len(plan.stages)} chunks; p·v = {plan.p}·{plan.v} "
                         f"= {plan.p * plan.v} are needed, one per chunk")
    prev_end = 0
    for c, st in enumerate(plan.stages):
        if st.chunk != c or st.rank != c % plan.p:
            raise ValueError(f"Plan.stages[{c}] = chunk {st.chunk} on rank {st.rank}: chunk c "
                             f"must be stages[c] and run on pipeline rank c mod p = {c % plan.p}")
        if st.first_layer != prev_end or st.last_layer < st.first_layer:
            raise ValueError(f"Plan.stages[{c}] covers layers [{st.first_layer}, "
                             f"{st.last_layer}); chunks must cover the layers in order without "
                             f"gaps (expected to start at {prev_end})")
        prev_end = st.last_layer
    if plan.num_layers and prev_end != plan.num_layers:
        raise ValueError(f"Plan.stages end at layer {prev_end} but the model has "
                         f"{plan.num_layers} layers; the chunks must cover every layer")
    if plan.stages and not (plan.stages[0].embedding and plan.stages[-1].head):
        raise ValueError("Plan.stages: the embedding must be in the first chunk and the head "
                         "and loss in the last")
