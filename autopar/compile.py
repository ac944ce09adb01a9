"""`compile_program`: a ParallelProgram becomes this rank's Runner (inside torchrun).

The compiler's last step, run on every rank:
  1. check everything that can be checked locally (world size = t·p·d, micro-batches ≥ p,
     enough layers for p·v chunks, zero level, precision — and that saved chunk files were
     generated for it —, the model's parameter names and shapes against those the plan was
     made for) and raise ValueError before any process
     blocks (`check_program`, `autopar.plan.check_model`);
  2. join the process groups (autopar.runtime.dist; a torchrun restart gets a fresh store);
  3. build this rank's chunk graphs (autopar.build: capture in the precision's compute
     dtype, tensor split, pipeline cut, recompute) with only its own chunks' weights real;
  4. load the generated source of its chunks (autopar.codegen; or the files `prog.save`
     wrote, which must be for the same precision: their PRECISION), attach its parameters and buffers, bind the graph attributes the code names
     (`tp_group`: the tensor group; `tp_rng`: this program's dropout streams;
     `rank_device`: this rank's device, passes/device.py);
  5. describe every local parameter (autopar.runtime.params.LocalParams: user key, full
     shape, this rank's slice), choose the optimizer regime of plan.zero
     (autopar.runtime.regimes) and hand everything to autopar.runtime.runner.Runner.
The runtime never imports the compiler: what it needs arrives here as data.
"""
from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx

from autopar.build import PRECISIONS, BuiltProgram, build_program
from autopar.codegen import load_chunk_module, render_chunk
from autopar.passes import meta as K
from autopar.passes.device import RANK_DEVICE
from autopar.passes.expert_parallel import EP_GROUP_ATTR
from autopar.passes.fp8 import fp8_only_weights
from autopar.passes.recompute import op_mode_refusal
from autopar.passes.router_stats import DATA_GROUP_ATTR
from autopar.passes.tensor_parallel import param_splits
from autopar.plan import Plan, check_model, recorded_chunk_times
from autopar.progress import Progress
from autopar.rules import ZERO_LEVELS
from autopar.runtime.compiled import compile_chunks
from autopar.runtime.context_shard import ContextShard, hybrid_node_ranks
from autopar.runtime.dist import (DEFAULT_TIMEOUT_S, ProcessGroups, init_distributed,
                                  shared_stages)
from autopar.runtime.executor import LoadedChunk
from autopar.runtime.host_memory import keep_freed_memory
from autopar.runtime.loss_scale import LossScaler, LossScaling
from autopar.runtime.params import LocalParams, ParamInfo, StateDictSpec, describe_param
from autopar.runtime.regimes import make_regime
from autopar.runtime.runner import Runner
from autopar.runtime.shard import DropoutStreams, ParamSplit
from autopar.saved_program import check_saved_precision, chunk_file_name
from autopar.schedules import FEWER_MICROBATCHES_THAN_RANKS, make_schedule

def _launched_world_size() -> int | None:
    if dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value is not None and value.isdigit() else None


def check_program(plan: Plan, num_layers: int | None = None) -> None:
    """Local checks of a plan against this launch; ValueError with value, rule and fix."""
    world = _launched_world_size()
    if world is not None and world != plan.gpus:
        raise ValueError(
            f"WORLD_SIZE={world} but the plan needs "
            + (f"t·p·d = {plan.t}·{plan.p}·{plan.d}" if plan.c == 1 else
               f"t·c·p·d = {plan.t}·{plan.c}·{plan.p}·{plan.d}")
            + f" = {plan.gpus} ranks; launch exactly {plan.gpus} processes "
            f"(torchrun --nproc_per_node={plan.gpus}) or re-plan with gpus={world}")
    if plan.zero not in ZERO_LEVELS:
        raise ValueError(
            f"plan.zero={plan.zero}: ZeRO-{plan.zero} is not supported by the runtime; "
            f"use one of {ZERO_LEVELS}")
    # ZeRO-2/3 with a split backward: refused by the Plan itself (autopar/rules.py zero_refusal)
    if plan.c > 1 and plan.sequence_parallel and plan.t > 1 \
            and (plan.seq_len // plan.c) % plan.t:
        raise ValueError(
            f"plan.c={plan.c} with sequence_parallel=True (t={plan.t}): each context rank's "
            f"{plan.seq_len}/{plan.c} = {plan.seq_len // plan.c} tokens are split again between "
            f"the t tensor ranks, which needs them divisible by t; use a sequence length "
            f"divisible by c·t = {plan.c * plan.t}, or sequence_parallel=False")
    if plan.p > 1 and plan.num_microbatches < plan.p \
            and plan.schedule not in FEWER_MICROBATCHES_THAN_RANKS:
        raise ValueError(
            f"plan.num_microbatches={plan.num_microbatches} < p={plan.p}: schedule "
            f"{plan.schedule!r} needs at least p micro-batches per step to fill the pipeline; "
            f"raise the global batch, lower micro_batch_size, use a smaller p, or one of "
            f"{FEWER_MICROBATCHES_THAN_RANKS}")
    layers = num_layers if num_layers is not None else plan.num_layers
    if layers and plan.p * plan.v > 1 and plan.p * plan.v > layers + 2:
        raise ValueError(
            f"p·v = {plan.p}·{plan.v} = {plan.p * plan.v} chunks but the model has {layers} "
            f"layers; a pipeline has at most one chunk per layer plus an embedding-only and a "
            f"head-only chunk — use v <= {max(1, (layers + 2) // plan.p)} (or a smaller p)")


def _check_options(plan: Plan, max_grad_norm: float | None, precision: str) -> None:
    if plan.recompute == "op" and (why := op_mode_refusal()):
        raise ValueError(why)
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be > 0 (or None for no clipping)")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: must be one of {sorted(PRECISIONS)} "
                         f"(bf16 = bf16 compute with fp32 master weights; fp16 = the same with "
                         f"dynamic loss scaling)")


def eager_chunks_of_a_fused_plan(plan: Plan, torch_compile: bool,
                                 device: torch.device) -> str | None:
    """The line to warn with when eager chunks run on a GPU a plan priced with fused
    elementwise ops (as compiled chunks run): they keep more activations than it priced (on an
    H100 a 1.3B GPT held 38.8 GiB against 34.2 priced, and a plan at the memory limit ran out);
    None when they match, on a CPU, or for a plan that does not record its pricing."""
    if torch_compile or device.type != "cuda" or plan.elementwise != "fused":
        return None
    return (f"compile: plan priced for {plan.cluster} with fused elementwise ops (as compiled "
            f"chunks run) runs eager chunks here, which keep more activations than priced; "
            f"pass torch_compile=True (autopar build --compile), or plan with elementwise "
            f"'eager' (--elementwise eager; autopar build without --compile does)")


def compile_program(prog: Any, optimizer: Callable | None = None,
                    max_grad_norm: float | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                    precision: str = "fp32", program_dir: str | Path | None = None,
                    record_timeline: bool = False, bucket_bytes: int | None = None,
                    device: str | torch.device | None = None,
                    torch_compile: bool = False,
                    loss_scaling: LossScaling | None = None) -> Runner:
    """Build this rank's Runner (inside torchrun, or with a default process group already made).

    precision: "fp32" (default) or "bf16" (bf16 compute, fp32 master weights and gradient
    accumulation), or "fp16" (the same in fp16, with one dynamic loss scale for the whole
    job: autopar.runtime.loss_scale; loss_scaling: its knobs, default GradScaler's). program_dir: load the chunk sources from a directory written by
    `prog.save` instead of generating them in memory (edits to those files take effect).
    bucket_bytes: GradSync bucket size (default 25 MiB, as DDP).
    device: the device this rank computes on (default: the backend's, cuda:LOCAL_RANK under
    nccl, else cpu); e.g. "cuda:0" for several gloo ranks sharing one GPU
    (benchmarks/gpu.py), where the collectives gloo runs on CUDA tensors are what it tests.
    torch_compile: compile each
    chunk's forward and backward with torch.compile (Inductor; graph breaks at the
    collectives; autopar.runtime.compiled).
    Why this size: the public run-time entry point: its keywords are the user's run options
    (optimizer, clipping, timeout, precision, program directory, timeline, buckets, device,
    torch.compile, loss scaling); the body reads as the build of one Runner.
    """
    plan: Plan = prog.plan
    check_program(plan)
    check_model(plan, prog.model)
    _check_options(plan, max_grad_norm, precision)
    if program_dir is not None:
        check_saved_precision(program_dir, plan, precision)
    schedule = make_schedule(plan.schedule, plan.p, plan.v, plan.num_microbatches,
                             group=plan.microbatch_group, chunk_times=recorded_chunk_times(plan))
    # a bar on rank 0's terminal only (torchrun sets RANK; a lone process is rank 0)
    rank0 = os.environ.get("RANK", "0") == "0"
    bar = Progress(total=4 + torch_compile, desc="compile", enabled=rank0)
    bar.start("capture (torch.export)")
    built = build_program(prog, precision)  # local work only: capture, layers, cut
    check_program(plan, built.num_layers)
    bar.start("process groups")
    owns_default_group = not dist.is_initialized()   # Runner.close destroys only its own
    backend_device = init_distributed(plan.gpus, timeout_s=timeout_s)
    device = backend_device if device is None else torch.device(device)
    if device.type == "cpu":
        keep_freed_memory()   # glibc keeps what a step frees (runtime/host_memory.py)
    mismatch = eager_chunks_of_a_fused_plan(plan, torch_compile, device)
    if mismatch and rank0:
        warnings.warn(mismatch, stacklevel=2)
    pg = ProcessGroups.create(plan.t, plan.p, plan.d, c=plan.c, ep=plan.ep, timeout_s=timeout_s,
                              hybrid_node_ranks=hybrid_node_ranks(plan))
    # only this rank's chunks hold weights (and of the experts, this expert rank's)
    bar.start("this rank's chunks")
    graphs = built.chunks(pg.tp_rank, pg.pp_rank, ep_rank=pg.ep_rank)
    chunks, names = _load_chunks(built, graphs, pg, device, program_dir)
    shared = _shared_groups(graphs, pg.p)
    pg.add_stage_groups(shared_stages(g, pg.p) for g in shared.values()
                        if g.startswith("stages:"))   # collective: the same on every rank
    params = _local_params(built, graphs, chunks, names, pg, shared)
    if torch_compile:
        bar.start("torch.compile")
        compile_chunks(chunks.values())
    built.release(pg.tp_rank, pg.pp_rank, pg.ep_rank)   # the runner owns its weights now
    dtype = PRECISIONS[precision]
    if dtype != torch.float32:
        _retype_boundaries(chunks, dtype)
    actions = schedule[pg.pp_rank]
    bar.start("optimizer and gradient buckets")
    fp8_weights = frozenset(names[(c, a)] for c in chunks for a in fp8_only_weights(graphs[c])
                            if (c, a) in names)      # ZeRO-2/3 gather them in FP8
    regime = make_regime(plan, params, pg, actions, optimizer=optimizer, compute_dtype=dtype,
                         bucket_bytes=bucket_bytes, fp8_weights=fp8_weights)
    scaler = (LossScaler(loss_scaling or LossScaling(), device) if dtype == torch.float16
              else None)
    bar.start("done")
    bar.close()
    return Runner(plan=plan, chunks=chunks, params=params, regime=regime, groups=pg,
                  actions=actions, device=device, max_grad_norm=max_grad_norm,
                  record_timeline=record_timeline, scaler=scaler,
                  owns_default_group=owns_default_group,
                  state_dict=StateDictSpec.of_model(prog.model, built.state_keys,
                                                    _held_names(graphs)))


# ---- loading this rank's chunks ---------------------------------------------------------
def _load_chunks(built: BuiltProgram, graphs: list[torch.fx.GraphModule], pg: ProcessGroups,
                 device: torch.device, program_dir: str | Path | None
                 ) -> tuple[dict[int, LoadedChunk], dict[tuple[int, str], str]]:
    """(chunk -> LoadedChunk, (chunk, attribute) -> graph name) of this rank's chunks.

    Tensors of the user's model are copied; shards and materialised weights the build made
    for this rank are taken over (the build's cache of them is released by the caller).
    """
    plan = built.plan
    users = built.user_tensors()
    owned: dict[str, torch.nn.Parameter] = {}   # one tensor per name (tied weights share it)
    names: dict[tuple[int, str], str] = {}
    objects = {"tp_group": pg.tensor, "tp_rng": DropoutStreams(pg.tp_rank, pg.cp_rank),
               EP_GROUP_ATTR: pg.expert, DATA_GROUP_ATTR: pg.data,
               RANK_DEVICE: device,
               "cp": ContextShard(group=pg.context, c=pg.c, cp_rank=pg.cp_rank,
                                  seq_len=plan.seq_len, subgroups=pg.context_subgroups,
                                  node_ranks=pg.context_node_ranks)}

    def own(x: torch.Tensor) -> torch.Tensor:
        return (x.detach().clone() if id(x) in users else x.detach()).to(device)
    out = {}
    for c in range(pg.pp_rank, plan.p * plan.v, plan.p):
        gm = graphs[c]
        module = load_chunk_module(*_chunk_source(gm, plan, c, pg.tp_rank, program_dir,
                                                  built.precision))
        net = module.CHUNK_CLASS()
        for attr, (qual, _shape, _dtype) in module.PARAMETERS.items():
            if qual not in owned:   # a frozen weight (Whisper's sinusoidal positions) stays so
                src = getattr(gm, attr)
                owned[qual] = torch.nn.Parameter(own(src), requires_grad=src.requires_grad)
            net.register_parameter(attr, owned[qual])
            names[(c, attr)] = qual
        for attr, (qual, _shape, _dtype) in module.BUFFERS.items():
            net.register_buffer(attr, own(getattr(gm, attr)))
        for attr, qual in getattr(module, "OBJECTS", {}).items():
            if qual not in objects:
                raise ValueError(f"compile: chunk {c} refers to attribute {attr} ({qual}), "
                                 f"which the runtime does not know how to bind "
                                 f"(known: {sorted(objects)})")
            for sub in net.modules():   # the chunk and its graph submodules' classes
                setattr(sub, attr, objects[qual])
        net.train()
        out[c] = LoadedChunk.from_module(c, module, net)
    return out, names


def _chunk_source(gm: torch.fx.GraphModule, plan: Plan, c: int, tp_rank: int,
                  program_dir: str | Path | None, precision: str) -> tuple[str, str]:
    """(source, file name) of chunk c: generated in memory for `precision`, or read from
    `prog.save`'s files (checked to be for the same precision by compile_program)."""
    if program_dir is None:
        return (render_chunk(gm, plan, tp_rank, model_name=plan.model, precision=precision),
                f"<autopar chunk {c} tp{tp_rank}>")
    path = Path(program_dir) / chunk_file_name(c, tp_rank, plan.t)
    if not path.exists():
        raise ValueError(f"compile: {path} does not exist; program_dir must be a "
                         f"directory written by prog.save() for this plan")
    return path.read_text(), str(path)


def _retype_boundaries(chunks: dict[int, LoadedChunk], dtype: torch.dtype) -> None:
    """Floating activations crossing pipeline stages travel in the compute dtype."""
    name = str(dtype).replace("torch.", "")
    for ch in chunks.values():
        for specs in (ch.recv, ch.send):
            for i, spec in enumerate(specs):
                if getattr(torch, spec[2]).is_floating_point:
                    specs[i] = (spec[0], spec[1], name) + tuple(spec[3:])


# ---- describing this rank's parameters ----------------------------------------------------
def _local_params(built: BuiltProgram, graphs: list[torch.fx.GraphModule],
                  chunks: dict[int, LoadedChunk], names: dict[tuple[int, str], str],
                  pg: ProcessGroups, shared: dict[str, str]) -> LocalParams:
    """The LocalParams table of this rank's loaded chunks (see autopar.runtime.params);
    shared: `_shared_groups`."""
    tensors: OrderedDict[str, torch.nn.Parameter] = OrderedDict()
    first_chunk: dict[int, list[str]] = {c: [] for c in chunks}
    used_by: dict[str, set[int]] = {}
    for (c, attr), q in names.items():   # chunk order, then each chunk's PARAMETERS order
        used_by.setdefault(q, set()).add(c)
        if q not in tensors:
            tensors[q] = getattr(chunks[c].net, attr)
            first_chunk[c].append(q)
    splits = _tp_splits(graphs, chunks) if pg.t > 1 else {}
    experts = _expert_slices(graphs, chunks)
    keys = _user_keys(built)
    full_shapes = {k: tuple(v.shape) for k, v in   # tied weights under every name
                   built.gm.named_parameters(remove_duplicate=False)}
    infos: dict[str, ParamInfo] = {}
    for q, p in tensors.items():
        own_keys = keys.get(q, [])
        key = q if (q in own_keys or not own_keys) else own_keys[0]
        infos[q] = describe_param(
            key=key, aliases=tuple(k for k in own_keys if k != key),
            local_shape=tuple(p.shape), global_shape=full_shapes.get(built.prefix + q),
            split=splits.get(q), tp_rank=pg.tp_rank, t=pg.t, shared=shared.get(q, False),
            experts=experts.get(q))
    return LocalParams(tensors=tensors, infos=infos,
                       first_chunk={c: tuple(qs) for c, qs in first_chunk.items()},
                       used_by={q: frozenset(cs) for q, cs in used_by.items()}, splits=splits)


def _expert_slices(graphs: list[torch.fx.GraphModule], chunks: dict[int, LoadedChunk]
                   ) -> dict[str, tuple[int, int, int]]:
    """Graph name -> (experts, start, stop) of this rank's expert parameters, from the
    expert-parallel pass's metadata on the chunk graphs."""
    out: dict[str, tuple[int, int, int]] = {}
    for c in chunks:
        spec = graphs[c].meta[K.CHUNK]
        for n in graphs[c].graph.nodes:
            if n.op == "get_attr" and K.EP_PARAM in n.meta and n.target in spec.params:
                s = n.meta[K.EP_PARAM]
                out[spec.params[n.target]] = (s.experts, s.start, s.stop)
    return out


def _held_names(graphs: list[torch.fx.GraphModule]) -> set[str]:
    """The graph names of the tensors some chunk holds (every rank lists all chunks)."""
    specs = [gm.meta[K.CHUNK] for gm in graphs]
    return {q for spec in specs for q in (*spec.params.values(), *spec.buffers.values())}


def _user_keys(built: BuiltProgram) -> dict[str, list[str]]:
    """Graph name -> the user's state-dict keys of that tensor, sorted (tied: several)."""
    out: dict[str, list[str]] = {}
    for key, name in sorted(built.state_keys.items()):
        out.setdefault(name, []).append(key)
    return out


def _shared_groups(graphs: list[torch.fx.GraphModule], p: int) -> dict[str, str]:
    """Parameter name -> the group its gradients are summed over, for the weights several
    pipeline stages hold (ParamInfo.shared_with): "embedding" (the first and the last stage: a
    tied embedding, a block called at several depths at p = 2), "pipeline" (every stage), or
    "stages:1,2" (a block called at several depths that some stages only hold: the group of
    those stages, ProcessGroups.add_stage_groups). The same on every rank (every rank's
    `graphs` list all chunks)."""
    out = {}
    for q, stages in _pipeline_holders(graphs).items():
        if len(stages) < 2:
            continue
        held = tuple(sorted(stages))
        out[q] = ("embedding" if stages == {0, p - 1} else "pipeline" if len(stages) == p
                  else "stages:" + ",".join(map(str, held)))
    return out


def _pipeline_holders(graphs: list[torch.fx.GraphModule]) -> dict[str, set[int]]:
    """Parameter name -> pipeline ranks whose chunks use it."""
    holders: dict[str, set[int]] = {}
    for gm in graphs:
        spec = gm.meta[K.CHUNK]
        for qual in spec.params.values():
            holders.setdefault(qual, set()).add(spec.rank)
    return holders


def _tp_splits(graphs: list[torch.fx.GraphModule], chunks: dict[int, LoadedChunk]
               ) -> dict[str, tuple[ParamSplit, int]]:
    """Graph name -> (ParamSplit, full size along its dim) of this rank's split parameters
    and buffers (BART's final_logits_bias follows the vocabulary split; full_state_dict
    gathers it), from the tensor-parallel pass's metadata on the chunk graphs."""
    splits: dict[str, tuple[ParamSplit, int]] = {}
    for c in chunks:
        spec = graphs[c].meta[K.CHUNK]
        for target, split in param_splits(graphs[c]).items():
            qual = spec.params.get(target, spec.buffers.get(target))
            if qual is not None:
                splits[qual] = split
    return splits
