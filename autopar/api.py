"""`autopar.parallelize`: capture → layers → profile → solve, returning a ParallelProgram.

The planning path is the front of the compiler's pipeline (passes/manager.py): capture (the
entry, Module -> GraphModule), the layers pass, then two analyses that return results rather
than graphs: the cost model's profile (passes/graph_profile.py) and the price of the tensor-parallel
pass's decisions (passes/tp_cost.py).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch

from autopar.cost.critical_batch import (check_training_inputs,
                                         critical_batch_tokens_from_params,
                                         loss_nats_from_params)
from autopar.cost.documents import with_documents
from autopar.cost.hardware import get_cluster
from autopar.cost.imbalance import with_expert_load
from autopar.cost.kinds import (kind_layer_ns, kinds_in, layer_weights, mixed_profile,
                                plan_config, stage_layers)
from autopar.cost.layout import layers_over_kinds
from autopar.cost.time_to_train import plan_for_tokens
from autopar.documents import program_inputs
from autopar.passes import meta as K
from autopar.passes.capture import capture
from autopar.passes.layers import LAYERS_PASS
from autopar.passes.manager import run_passes
from autopar.passes.sharding import ContextVerdict, context_verdict
from autopar.passes.graph_profile import profile_from_graph
from autopar.passes.tensor_parallel import tp_report
from autopar.passes.tp_cost import with_tp_corrections
from autopar.losses import cross_entropy
from autopar.plan import Plan, layer_range, parameter_signature
from autopar import report as _report  # noqa: F401 (registers print(plan) / plan.explain())
from autopar.request import Pins, PlanRequest
from autopar.rules import CP_ATTENTION, knob_refusal


class ParallelProgram:
    """A planned model: `.plan`, the generated per-chunk source, and `compile()` for torchrun."""

    def __init__(self, *, model: torch.nn.Module, plan: Plan, profile: Any,
                 example_inputs: tuple, loss_fn: Callable | None, example_targets: Any,
                 cluster: Any, init: Callable | None = None,
                 pins: dict[str, Any] | None = None):
        """Why this size: ParallelProgram holds what compile and save need (model, plan, profile,
        inputs, loss, targets, cluster, init, pins); keyword-only."""
        self.model = model
        self.plan = plan
        self.profile = profile
        self.example_inputs = example_inputs
        self.loss_fn = loss_fn
        self.example_targets = example_targets
        self.cluster = cluster
        self.init = init  # re-runs the model's own init on meta parameters, one module at a time
        self.pins = dict(pins or {})   # the knobs the caller pinned (save() records them)
        self.precision: str | None = None   # the precision planned with (parallelize's)
        self.input_keywords: tuple[str, ...] = ()   # inputs passed by name (documents.KEYWORDS)
        self.documents: Any = None   # the PackedDocuments planned with (build.json records it)

    def __repr__(self) -> str:
        cp = f"c{self.plan.c}·" if self.plan.c > 1 else ""
        ep = f" ep{self.plan.ep}" if self.plan.ep > 1 else ""
        return f"ParallelProgram(plan=t{self.plan.t}·{cp}p{self.plan.p}·d{self.plan.d}{ep}, " \
               f"v={self.plan.v}, schedule={self.plan.schedule!r})"

    # build and codegen imported where used: planning (`autopar plan`) needs neither
    def _build(self):
        from autopar.build import build_program
        return build_program(self)

    def source(self, chunk: int = 0, tp_rank: int = 0, precision: str = "fp32") -> str:
        """The generated Python of one pipeline chunk (as tensor rank `tp_rank` runs it in
        `precision`)."""
        from autopar.codegen import chunk_source
        return chunk_source(self, chunk=chunk, tp_rank=tp_rank, precision=precision)

    def save(self, directory: str | Path, *, model: str | None = None,
             precision: str = "fp32") -> Path:
        """Write plan.json, one .py per chunk, launch.py and its run scripts into `directory`.
        model: the `file.py:factory` the launcher builds by default (else it needs --model).
        precision: the one the chunks are generated for ("fp32" or "bf16": the graph is
        captured in the compute dtype); compile(program_dir=...) refuses another."""
        from autopar.codegen import save_program
        return save_program(self, Path(directory), model=model, precision=precision)

    def compile(self, optimizer: Callable | None = None, max_grad_norm: float | None = None,
                **kwargs: Any):
        """Build this rank's program inside torchrun (or an existing process group); see
        autopar.compile.compile_program for the keyword arguments."""
        # imported here: the runtime pulls in torch.distributed.pipelining (~1.5 s), which
        # planning alone (`import autopar`, the CLI's `plan`) never needs
        from autopar.compile import compile_program
        return compile_program(self, optimizer=optimizer, max_grad_norm=max_grad_norm, **kwargs)


def _default_targets(example_inputs: tuple) -> torch.Tensor:
    """Language-model convention: targets have the shape and dtype of the input ids (so only
    for integer ids: a model reading pixels or features must be given example_targets)."""
    first = example_inputs[0]
    if not isinstance(first, torch.Tensor):
        raise ValueError(
            f"parallelize: loss_fn is given but example_targets is not, and the first example "
            f"input is a {type(first).__name__}, not a tensor of token ids; pass "
            f"example_targets=<a tensor shaped like the targets loss_fn expects>")
    if first.is_floating_point() or first.is_complex():
        raise ValueError(
            f"parallelize: loss_fn is given but example_targets is not, and the first example "
            f"input ({first.dtype}, shape {list(first.shape)}) is not token ids (pixels, "
            f"features), so its targets cannot be guessed; pass example_targets=<a tensor "
            f"shaped like the targets loss_fn expects, e.g. class labels of shape "
            f"[{first.shape[0] if first.dim() else 1}]>")
    return torch.zeros_like(first)


def parallelize(model: torch.nn.Module, gpus: int, *, example_inputs: tuple,
                loss_fn: Callable | None = None, example_targets: Any = None,
                global_batch_size: int | None = None, cluster: Any = "dgx-a100-80gb",
                tokens: float | None = None, critical_batch_tokens: float | None = None,
                precision: str | None = None, name: str | None = None,
                plan: Plan | None = None, init: Callable | None = None,
                documents: Any = None, moe_imbalance: Any = None,
                **pins: Any) -> ParallelProgram:
    """Plan `model` for `gpus` GPUs; see docs/DESIGN.md §2. Anything not pinned is solved for.

    `**pins`: the knobs to fix, by name (autopar.request.Pins: t, c, cp_attention, ep, p, d,
    v, micro_batch_size, schedule, recompute, zero, sequence_parallel, microbatch_group);
    together with gpus, the batch, cluster, tokens, precision, documents and moe_imbalance they
    make the `PlanRequest` that `plan_program` plans (validated once: autopar/rules.py).

    `moe_imbalance=` (a mixture of experts): the most loaded expert's tokens over the mean
    expert's (e.g. 1.3), or an ExpertLoad measured by autopar.expert_load.measure_expert_load;
    the expert GEMMs and all-to-alls are priced at the most loaded expert rank
    (cost/imbalance.py). None: balanced routing.

    `init=` (the model's per-module init, e.g. GPT.init_weights) is applied, with each
    module's own reset_parameters(), when a meta-device model's local shards are materialised
    by compile().
    `plan=` reuses a plan made earlier (e.g. read from plan.json on every torchrun rank) instead
    of solving again; it must be for the same GPU count. `microbatch_group` pins N, the
    consecutive micro-batches per chunk visit of the interleaved schedules (p <= N <= m, N | m).

    `tokens=T` plans for the shortest time to train T tokens (E_min of 2001.08361 §5: the tokens
    a small-batch run needs; cost/critical_batch.py): the global batch is chosen too, trading
    steps against step time by the critical batch `critical_batch_tokens` (None: estimated from
    the model's non-embedding parameters by 2001.08361's fits). An explicit `global_batch_size`
    pins the batch: the plan is then the fastest at that batch, with its time to train. The
    plan's `training` holds days, GPU-hours, the batch and why it was chosen.

    `c` pins the context-parallel degree (each sequence split over c ranks in 2c chunks; the
    world is t·c·p·d); None lets the solver choose it with the others. `cp_attention` pins
    how attention meets the other context ranks' keys and values: "all-gather" (before
    attention, Llama 3's method), "ring" (blocks passed round the context ranks while
    attending, autopar/runtime/ring_attention.py) or "all-to-all" (tokens traded for heads
    around attention, DeepSpeed-Ulysses, autopar/runtime/ulysses.py: heads divisible by t·c)
    or "hybrid" (the all-to-all inside a node, the K/V all-gather across: Megatron-Core's
    a2a+p2p; its inner degree autopar/runtime/groups.py hybrid_inner_degree: weighed where a
    context group spans nodes) or "hybrid-ring" (the same with ring attention across, weighed
    where its exchange costs no more than the hybrid's);
    None: the cheapest, as the cost model prices them (cost.model.context_comm_s), among those
    the context-parallel pass can build.

    `ep` pins the expert-parallel degree of a mixture of experts: the experts of every layer
    spread over ep of the c·d ranks that hold the same dense weights (ep divides c·d and the
    number of experts; autopar/runtime/groups.py expert_groups; under ZeRO the experts are
    sharded over the c·d/ep ranks holding the same ones); None lets the solver choose it with
    the ZeRO level.

    `precision` prices the run's GEMMs: None / "fp32" / "bf16" / "fp16" at the 16-bit rate
    (fp32 with 4-byte activations, gradients and gathered weights),
    "fp8" / "fp8-rowwise" the blocks' linear GEMMs at the cluster's FP8 rate (with their
    casts; a cluster without one refuses), "auto" plans both and keeps the faster
    (`prog.precision` says which; compile(precision=prog.precision) runs it).

    `documents=autopar.PackedDocuments(mean_doc_len=...)`: the rows are packed documents
    (autopar/documents.py): the program takes (input_ids, position_ids, attention_mask), the
    last two passed to the model by those keywords, and prices attention at the tiles the
    block-diagonal mask leaves (cost/documents.py).
    Why this size: the public entry point: every planning knob is a keyword (the names of `Pins`
    and the CLI flags, docs/DESIGN.md §2); the body builds one PlanRequest and reads as the
    pipeline it runs (capture, profile, context offer, solve, notes).
    """
    try:
        request = PlanRequest(gpus=gpus, pins=Pins.of(pins, "parallelize"),
                              global_batch_size=global_batch_size, cluster=cluster,
                              tokens=tokens, critical_batch_tokens=critical_batch_tokens,
                              precision=precision, name=name, documents=documents,
                              moe_imbalance=moe_imbalance)
    except ValueError as exc:
        raise ValueError(f"parallelize: {exc}") from None
    if plan is not None:
        return program_of_plan(model, plan, request, example_inputs=example_inputs,
                               loss_fn=loss_fn, example_targets=example_targets, init=init)
    return plan_program(model, request, example_inputs=example_inputs, loss_fn=loss_fn,
                        example_targets=example_targets, init=init)


def plan_program(model: torch.nn.Module, request: PlanRequest, *, example_inputs: tuple,
                 loss_fn: Callable | None = None, example_targets: Any = None,
                 init: Callable | None = None) -> ParallelProgram:
    """The planning pipeline: the inputs checked against the model and the request → the
    planning capture and its profile → the context-parallel split and methods the pass can
    build → the solve (per precision; under a token budget, per batch) → the plan's notes."""
    inputs = _checked_inputs(model, request, example_inputs, loss_fn, example_targets)
    cl = get_cluster(request.cluster)
    pins = request.pins
    captured, profile = plan_profile(model, inputs.example_inputs, loss_fn, inputs.targets, cl,
                                     gpu_counts=(request.gpus,), t=pins.t,
                                     sequence_parallel=pins.sequence_parallel,
                                     name=request.name, keywords=inputs.keywords)
    profile = with_documents(profile, request.documents)   # attention at the mask's tiles
    profile = with_expert_load(profile, request.moe_imbalance)   # uneven routing, priced
    offer = context_offer(captured.gm, inputs.seq_len, pins)
    if pins.p is not None and pins.p > profile.num_layers:
        raise ValueError(f"parallelize: p={pins.p} pipeline stages but the model has "
                         f"{profile.num_layers} layers; a stage holds at least one layer — "
                         f"pin p <= {profile.num_layers} (or leave p to the solver)")
    profiles = precision_profiles(profile, cl, request.precision)
    plan, chosen = _solve(request, profiles, cl, offer, inputs.batch, profile)
    layers = captured.gm.meta.get(K.LAYERS)   # how the finder saw the blocks, where it says
    notes = (list(layers.notes if layers is not None else ()) + _graph_notes(plan, captured)
             + _kind_notes(profile))
    if profile.expert_load is not None:
        notes.append(profile.expert_load.describe(plan.ep, profile.block.experts))
    if request.precision is not None:
        notes.append(f"precision: {chosen}" + (
            f" (priced faster than {sorted(set(profiles) - {chosen})})"
            if request.precision == "auto" and len(profiles) > 1 else ""))
    notes += offer.notes(plan.c, inputs.seq_len)
    plan = dataclasses.replace(plan, notes=tuple(notes), parameters=parameter_signature(model))
    prog = ParallelProgram(model=model, plan=plan, profile=profiles[chosen],
                           example_inputs=inputs.example_inputs, loss_fn=loss_fn,
                           example_targets=inputs.targets, cluster=cl, init=init,
                           pins=pins.as_dict())
    prog.precision = chosen
    prog.input_keywords, prog.documents = inputs.keywords, request.documents
    return prog


def program_of_plan(model: torch.nn.Module, plan: Plan, request: PlanRequest, *,
                    example_inputs: tuple, loss_fn: Callable | None = None,
                    example_targets: Any = None, init: Callable | None = None) -> ParallelProgram:
    """A plan made earlier (plan.json on every torchrun rank): nothing to solve, so no
    planning capture; compile() captures the full model itself."""
    inputs = _checked_inputs(model, request, example_inputs, loss_fn, example_targets)
    if request.tokens is not None:
        raise ValueError("parallelize: tokens= with plan=: a given plan is not re-planned; "
                         "drop tokens= (the plan keeps its time to train) or drop plan=")
    if plan.gpus != request.gpus:
        raise ValueError(f"parallelize: plan is for t·c·p·d = {plan.gpus} GPUs but "
                         f"gpus={request.gpus}; pass gpus={plan.gpus} or re-plan")
    prog = ParallelProgram(model=model, plan=plan, profile=None,
                           example_inputs=inputs.example_inputs, loss_fn=loss_fn,
                           example_targets=inputs.targets, cluster=get_cluster(request.cluster),
                           init=init)
    prog.input_keywords, prog.documents = inputs.keywords, request.documents
    return prog


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Inputs:
    example_inputs: tuple
    targets: Any          # example_targets, or the language-model default
    batch: int            # the example batch (the global batch when the request has none)
    seq_len: int
    keywords: tuple[str, ...] = ()   # the last inputs passed by name (packed documents)


def _checked_inputs(model: Any, request: PlanRequest, example_inputs: Any,
                    loss_fn: Callable | None, example_targets: Any) -> _Inputs:
    """The example inputs checked against the model (its context length, a language model
    under cross_entropy) and the request (the sequence a pinned c splits, the token budget)."""
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise ValueError("parallelize: example_inputs must be a non-empty tuple of model inputs, "
                         "e.g. example_inputs=(input_ids,)")
    example_inputs, keywords = program_inputs(model, tuple(example_inputs), request.documents)
    _check_context(model, example_inputs)
    if loss_fn is cross_entropy:
        _check_language_model(model)
    seq_len = _seq_len(example_inputs)
    if request.tokens is not None:
        check_training_inputs(request.tokens, request.critical_batch_tokens, seq_len,
                              "parallelize")
    try:
        request.check_sequence(seq_len)
    except ValueError as exc:
        raise ValueError(f"parallelize: {exc}") from None
    if loss_fn is not None and example_targets is None:
        example_targets = _default_targets(example_inputs)
    first = example_inputs[0]
    return _Inputs(example_inputs=example_inputs, targets=example_targets, seq_len=seq_len,
                   batch=first.shape[0] if isinstance(first, torch.Tensor) else 1,
                   keywords=keywords)


def _solve(request: PlanRequest, profiles: dict[str, Any], cluster: Any, offer: "ContextOffer",
           example_batch: int, profile: Any) -> tuple[Plan, str]:
    """The fastest plan over the priced precisions (and, under a token budget, the batch that
    trains the tokens soonest), and the precision it won at."""
    # imported here: a plan made earlier (plan=) needs no solver, so a machine without
    # ortools (the GPU image benchmarks/gpu.py runs on) can still compile and train it
    from autopar.cost.solver import solve
    knobs = {**request.pins.as_dict(), "cp_attentions": offer.methods}
    if offer.c is not None:
        knobs["c"] = offer.c
    won: dict[str, str] = {}

    def solve_at(batch_size: int, max_alternatives: int = 50) -> Plan:
        plans = {name: over_kinds(solve(prof, cluster, gpus=request.gpus,
                                        global_batch_size=batch_size,
                                        max_alternatives=max_alternatives, **knobs), prof)
                 for name, prof in profiles.items()}
        won["precision"] = min(plans, key=lambda k: plans[k].predicted.step_time_s)
        return plans[won["precision"]]

    batch = request.global_batch_size or example_batch
    if request.tokens is None:
        return solve_at(batch), won["precision"]
    crit, source = critical_batch(profile, request.critical_batch_tokens)
    # the batch search weighs no alternatives; the chosen batch is solved once more with
    # them, for explain()
    pins = request.pins
    plan = plan_for_tokens(lambda b: solve_at(b, 0), tokens=request.tokens,
                           critical_batch_tokens=crit, critical_batch_source=source,
                           seq_len=profile.seq_len, gpus=request.gpus,
                           pinned_batch=request.global_batch_size,
                           multiple=(pins.d or 1) * (pins.micro_batch_size or 1))
    plan = dataclasses.replace(solve_at(plan.global_batch_size), training=plan.training)
    return plan, won["precision"]


def precision_profiles(profile: Any, cluster: Any, precision: str | None) -> dict[str, Any]:
    """precision -> the profile priced for it: the one asked for, or under "auto" bf16 and,
    where the cluster has an FP8 rate, fp8 (the solver compares them only then)."""
    if why := knob_refusal("precision", precision):
        raise ValueError(f"parallelize: {why}")
    if precision == "auto":
        out = {"bf16": profile.with_gemm_precision("bf16", cluster)}
        if cluster.fp8_flops:
            out["fp8"] = profile.with_gemm_precision("fp8", cluster)
        return out
    name = precision or "bf16"
    gemm = "fp8" if name.startswith("fp8") else "bf16"
    recipe = "rowwise" if name == "fp8-rowwise" else "tensorwise"   # build.FP8_RECIPES
    try:   # an fp32 run moves 4-byte activations and gradients (GEMMs priced as 16-bit)
        priced = profile.with_gemm_precision(gemm, cluster, recipe)
        return {name: priced.with_training_bytes(4) if name == "fp32" else priced}
    except ValueError as exc:
        raise ValueError(f"parallelize: {exc}") from None


def plan_profile(model: torch.nn.Module, example_inputs: tuple, loss_fn: Callable | None,
                 example_targets: Any, cluster: Any, *, gpu_counts: tuple[int, ...],
                 t: int | None = None, sequence_parallel: bool | None = None,
                 name: str | None = None, keywords: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """The planning capture and the cost model's profile of `model`, with the tensor-parallel
    pass priced at every t the solver may pick for any of `gpu_counts` (one capture serves a
    sweep over GPU counts and batches: autopar/scaling.py).
    Why this size: the planning capture's inputs (model, example inputs, loss, targets, cluster,
    sequence, precision, documents, init) are the caller's, passed through unchanged."""
    cl = get_cluster(cluster)
    captured = capture(model, example_inputs, loss_fn, example_targets, repeat_limit=2,
                       keywords=keywords)
    structure = run_passes(captured.gm, [LAYERS_PASS]).meta[K.LAYERS]
    name = name or type(model).__name__
    sp = (False, True) if sequence_parallel is None else (sequence_parallel,)
    # a stack of several kinds (dense and MoE layers, ...): each kind profiled as its own
    # one-kind model, the stack priced as mean layers (cost/kinds.py)
    subs = ([structure.only(k) for k in range(len(structure.kinds))] if structure.mixed
            else [structure])
    from autopar.cost.solver import tensor_degrees
    parts = []
    for sub in subs:
        profile = profile_from_graph(captured, sub, name=name)
        # what the tensor-parallel pass keeps replicated at each t the solver may pick, priced
        degrees = sorted({k for g in gpu_counts for k in tensor_degrees(profile, cl, g, t)})
        parts.append(with_tp_corrections(profile, captured, sub, degrees, sequence_parallel=sp))
    if not structure.mixed:
        return captured, parts[0]
    return captured, mixed_profile(parts, [k.layer_ids for k in structure.kinds],
                                   [k.label for k in structure.kinds])


def over_kinds(plan: Plan, profile: Any) -> Plan:
    """`plan` with its stages in the model's layers: a profile of several kinds of block
    counts repeat units (one layer of each), and the stages are cut over the kinds' layers in
    order (cost.layout.layers_over_kinds); a profile of one kind: `plan` unchanged."""
    if not profile.layer_kinds:
        return plan
    if profile.mixed:
        return _over_mixed_kinds(plan, profile)
    counts = layers_over_kinds([st.num_layers for st in plan.stages], profile.layer_kinds)
    stages, first = [], 0
    for st, n in zip(plan.stages, counts):
        stages.append(dataclasses.replace(st, first_layer=first, last_layer=first + n))
        first += n
    return dataclasses.replace(plan, stages=tuple(stages), num_layers=first)


def _over_mixed_kinds(plan: Plan, profile: Any) -> Plan:
    """`plan`'s chunks, counted in mean layers, cut over the model's layers by the kinds'
    per-layer times at the plan's configuration (cost.kinds.stage_layers); each stage says
    which kinds it holds and their time per micro-batch (forward + backward)."""
    cl = get_cluster(plan.cluster)
    per_kind = kind_layer_ns(profile, cl, plan_config(plan))
    weights = layer_weights(profile, per_kind)
    counts = stage_layers([st.num_layers for st in plan.stages], weights)
    stages, first = [], 0
    for st, n in zip(plan.stages, counts):
        stages.append(dataclasses.replace(
            st, first_layer=first, last_layer=first + n,
            kinds=kinds_in(profile, first, first + n),
            layers_ms=round(sum(weights[first:first + n]) / 1e6, 3)))
        first += n
    return dataclasses.replace(plan, stages=tuple(stages), num_layers=first)


def _kind_notes(profile: Any) -> list[str]:
    """Which layers are which stack's, and how the stacks were priced (several kinds only)."""
    if not profile.layer_kinds or profile.mixed:
        return []
    out, first = [], 0
    for k in profile.layer_kinds:
        out.append(f"{layer_range(first, first + k.num_layers)}: {k.name} "
                   f"({k.fwd_flops / 1e9:.3g} GFLOP forward per sequence each)")
        first += k.num_layers
    out.append(f"the stacks are priced as {profile.num_layers} units of one layer of each; "
               f"stages are cut where the layers' forward FLOPs match the solver's split of "
               f"units; the encoder's output and shared values (masks, position bias) cross "
               f"every later cut")
    return out


def critical_batch(profile: Any, critical_batch_tokens: float | None) -> tuple[float, str]:
    """The critical batch in tokens and where it came from (given, or 2001.08361's fits at the
    model's non-embedding parameter count: the repeated blocks, as Kaplan et al. count N)."""
    if critical_batch_tokens is not None:
        return float(critical_batch_tokens), "given (critical_batch_tokens=)"
    n = profile.num_layers * profile.block.params_elems
    loss = loss_nats_from_params(n)
    return (critical_batch_tokens_from_params(n),
            f"2001.08361 eq. 5.3 at L(N) = {loss:.3f} nats (eq. 1.1, N = {n:.3g} non-embedding "
            f"parameters)")


def _seq_len(example_inputs: tuple) -> int:
    first = example_inputs[0]
    return int(first.shape[1]) if isinstance(first, torch.Tensor) and first.dim() > 1 else 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextOffer:
    """What the context-parallel pass can build for this model: `c` for the solver (the pin;
    1 when the sequence cannot be split and c is free; None: free), the attention `methods`
    it builds (autopar.rules.CP_ATTENTION) and why the others are not offered."""
    c: int | None
    methods: tuple[str, ...]
    split_refused: str | None = None
    refused: dict = dataclasses.field(default_factory=dict)

    def notes(self, planned_c: int, seq_len: int) -> list[str]:
        out = []
        if self.split_refused is not None and seq_len > 1:
            out.append(f"context parallelism not offered (c=1): {self.split_refused}")
        if planned_c > 1:
            out += [f"{how} attention not offered: {why}" for how, why in self.refused.items()
                    if why is not None]
        return out


def context_offer(gm: Any, seq_len: int, pins: Pins) -> ContextOffer:
    """The context split and attention methods the pass can build for the planning graph `gm`
    (at the pinned c, or c = 2), asked of the sharding engine alone (`context_verdict`: one
    walk, the graph neither copied nor changed); a pinned c or cp_attention it cannot build is
    a one-line ValueError naming the node and the user's source line."""
    c, how = pins.c, pins.cp_attention
    trial = c if c is not None and c > 1 else 2
    verdict = (ContextVerdict(split=None) if c == 1 or seq_len % (2 * trial)   # refused apart
               else context_verdict(gm, trial, seq_len))
    split = verdict.split
    if split is not None and c is not None and c > 1:
        raise ValueError(f"parallelize: c={c}: {split}") from None
    if split is not None and c is None:
        c = 1   # the solver may not choose a sequence split the pass cannot build
    if c == 1 or how == "all-gather":
        return ContextOffer(c=c, methods=CP_ATTENTION, split_refused=split)
    refused = {m: verdict.refusal(m) for m in (CP_ATTENTION if how is None else (how,))
               if m != "all-gather"}
    if how is not None and refused.get(how) is not None:
        raise ValueError(f"parallelize: cp_attention={how!r}: {refused[how]}") from None
    return ContextOffer(c=c, methods=tuple(m for m in CP_ATTENTION if refused.get(m) is None),
                        split_refused=split, refused=refused)


def _graph_notes(plan: Plan, captured: Any) -> list[str]:
    """What the tensor-parallel pass would do under `plan`, analysed on the planning graph."""
    if plan.t == 1:
        return []
    return tp_report(plan, captured.gm)


def load_plan(path: str | Path) -> Plan:
    """Read a plan.json written by `ParallelProgram.save` or `autopar plan --json`. A file
    that is not JSON, or JSON that is not a plan, is a one-line ValueError naming the file
    (the parser's error chained)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"load_plan: cannot read {str(path)!r} ({exc.strerror}); pass the "
                         f"plan.json written by prog.save() or `autopar plan --json`") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"load_plan: {path} is not valid JSON ({exc.msg} at line {exc.lineno} "
                         f"column {exc.colno}); write it again with prog.save() or "
                         f"`autopar plan --json > {path.name}`") from exc
    try:
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return Plan.from_dict(data)
    except (KeyError, TypeError) as exc:
        what = f"missing field {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"load_plan: {path} is JSON but not an autopar plan ({what}); pass "
                         f"the plan.json written by prog.save() or `autopar plan --json`") from exc


_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "block_size", "n_ctx")


def _check_context(model: Any, example_inputs: tuple) -> None:
    """A sequence longer than the model's position table (its config's context length)."""
    first = example_inputs[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 2:
        return
    config = getattr(model, "config", None)
    for attr in _CONTEXT_ATTRS:
        limit = getattr(config, attr, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            if first.shape[1] > limit:
                raise ValueError(f"parallelize: the example inputs have sequence length "
                                 f"{first.shape[1]} but the model's context is {limit} "
                                 f"positions (config.{attr}); use a sequence of at most "
                                 f"{limit} (autopar plan --seq {limit})")
            return


def _check_language_model(model: Any) -> None:
    """cross_entropy over token ids needs a model that embeds tokens."""
    if not isinstance(model, torch.nn.Module):
        return
    if not any(isinstance(m, torch.nn.Embedding) for m in model.modules()):
        raise ValueError(f"parallelize: the model is a {type(model).__name__} with no "
                         f"nn.Embedding, but loss_fn=cross_entropy expects a language model "
                         f"(token ids in, logits out); return the transformer itself (e.g. a "
                         f"transformers AutoModelForCausalLM), or pass your own loss_fn and "
                         f"example_targets")

