"""`compile_program` and `Runner`: this rank's share of a ParallelProgram, ready to train.

compile_program checks everything that can be checked locally (world size = t·p·d,
micro-batches ≥ p, enough layers for p·v chunks) and raises ValueError before any process
blocks; then it joins the process groups, loads the generated source of this rank's chunks,
attaches clones of only their parameters and builds the optimizer over them.

Runner.train_step = one optimizer step:
  1. split this data-parallel replica's batch into num_microbatches micro-batches;
  2. run the schedule's action list (autopar.runtime.executor); the last chunk backpropagates
     loss/m per micro-batch, so the accumulated gradient is that of the replica's mean loss;
  3. all-reduce gradients over the data group and divide by d (the global mean loss);
  4. sum the gradients of parameters held by several pipeline ranks (tied input/output
     embeddings: first and last stage) over the embedding group (Megatron's shared embedding);
  5. clip to max_grad_norm with the global norm: squares summed over tensor and pipeline
     groups, each replicated tensor counted once (tied copies on the first stage only,
     tensor-replicated ones on tensor rank 0 only; data replicas are identical after step 3);
  6. optimizer step; return the global mean loss, the same float on every rank.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autopar.plan import Plan

DEFAULT_TIMEOUT_S = 300.0


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
            f"WORLD_SIZE={world} but the plan needs t·p·d = {plan.t}·{plan.p}·{plan.d} = "
            f"{plan.gpus} ranks; launch exactly {plan.gpus} processes "
            f"(torchrun --nproc_per_node={plan.gpus}) or re-plan with gpus={world}")
    if plan.p > 1 and plan.num_microbatches < plan.p:
        raise ValueError(
            f"plan.num_microbatches={plan.num_microbatches} < p={plan.p}: a pipeline of "
            f"{plan.p} stages needs at least p micro-batches per step to fill; raise the global "
            f"batch, lower micro_batch_size, or use a smaller p")
    layers = num_layers if num_layers is not None else plan.num_layers
    if layers and plan.p * plan.v > 1 and plan.p * plan.v > layers:
        raise ValueError(
            f"p·v = {plan.p}·{plan.v} = {plan.p * plan.v} chunks but the model has {layers} "
            f"layers; each chunk needs at least one layer — use v <= {max(1, layers // plan.p)} "
            f"(or a smaller p)")


def compile_program(prog: Any, optimizer: Callable | None = None,
                    max_grad_norm: float | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                    program_dir: str | Path | None = None, record_timeline: bool = False
                    ) -> "Runner":
    """Build this rank's Runner (inside torchrun, or with a default process group already made).

    program_dir: load the chunk sources from a directory written by `prog.save` instead of
    generating them in memory (edits to those files take effect).
    """
    from autopar.build import build_program
    from autopar.runtime.dist import ProcessGroups, init_distributed
    from autopar.schedules import make_schedule

    plan: Plan = prog.plan
    check_program(plan)
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be > 0 (or None for no clipping)")
    schedule = make_schedule(plan.schedule, plan.p, plan.v, plan.num_microbatches)
    built = build_program(prog)             # local work only: capture, layers, cut
    check_program(plan, built.num_layers)
    init_distributed(plan.gpus, timeout_s=timeout_s)
    pg = ProcessGroups.create(plan.t, plan.p, plan.d, timeout_s=timeout_s)
    return Runner(prog, built, pg, schedule[pg.pp_rank], optimizer, max_grad_norm,
                  Path(program_dir) if program_dir is not None else None, record_timeline)


class Runner:
    """This rank's chunks, optimizer and schedule; see the module docstring for train_step."""

    def __init__(self, prog: Any, built: Any, pg: Any, actions: Sequence[Any],
                 optimizer: Callable | None, max_grad_norm: float | None,
                 program_dir: Path | None, record_timeline: bool):
        from autopar.runtime.executor import PipelineExecutor
        self.prog, self.plan, self.built, self.pg = prog, prog.plan, built, pg
        self.max_grad_norm = max_grad_norm
        self.dp_rank, self.dp_size = pg.dp_rank, pg.d
        all_chunks = built.chunks(pg.tp_rank)
        self._param_ranks = _param_holders(all_chunks)
        self.chunks = self._load_chunks(all_chunks, program_dir)
        self._params: OrderedDict[str, torch.nn.Parameter] = OrderedDict()
        for ch in self.chunks.values():
            for name, param in ch.net.named_parameters():
                self._params.setdefault(self._qual[(ch.index, name)], param)
        self._shared = [q for q in self._params if len(self._param_ranks[q]) > 1]
        self._full_shapes = {k: tuple(v.shape) for k, v in built.gm.named_parameters()}
        make = optimizer or (lambda params: torch.optim.AdamW(params, lr=3e-4))
        self.optimizer = make(list(self._params.values()))
        self.executor = PipelineExecutor(
            chunks=self.chunks, actions=list(actions), p=pg.p,
            num_microbatches=self.plan.num_microbatches, pipeline_ranks=pg.pipeline_ranks,
            pp_rank=pg.pp_rank, p2p_group=pg.pipeline, tensor_group=pg.tensor, t=pg.t,
            tp_rank=pg.tp_rank, record=record_timeline)
        self.steps = 0

    # ---- construction -------------------------------------------------------------------
    def _load_chunks(self, all_chunks: list, program_dir: Path | None) -> dict:
        from autopar.codegen import chunk_file_name, load_chunk_module, render_chunk
        from autopar.runtime.executor import LoadedChunk
        plan, pg = self.plan, self.pg
        shared: dict[str, torch.nn.Parameter] = {}
        self._qual: dict[tuple[int, str], str] = {}
        out = {}
        for c in range(pg.pp_rank, plan.p * plan.v, plan.p):
            gm = all_chunks[c]
            if program_dir is not None:
                path = program_dir / chunk_file_name(c, pg.tp_rank, plan.t)
                if not path.exists():
                    raise ValueError(f"compile: {path} does not exist; program_dir must be a "
                                     f"directory written by prog.save() for this plan")
                source, filename = path.read_text(), str(path)
            else:
                source = render_chunk(gm, plan, pg.tp_rank, model_name=plan.model)
                filename = f"<autopar chunk {c} tp{pg.tp_rank}>"
            module = load_chunk_module(source, filename)
            net = module.CHUNK_CLASS()
            for attr, (qual, _shape, _dtype) in module.PARAMETERS.items():
                if qual not in shared:  # one tensor per name on this rank (tied weights share)
                    value = getattr(gm, attr).detach().clone()
                    shared[qual] = torch.nn.Parameter(value, requires_grad=True)
                net.register_parameter(attr, shared[qual])
                self._qual[(c, attr)] = qual
            for attr, (qual, _shape, _dtype) in module.BUFFERS.items():
                net.register_buffer(attr, getattr(gm, attr).detach().clone())
            for attr, qual in getattr(module, "OBJECTS", {}).items():
                if qual != "tp_group":
                    raise ValueError(f"compile: chunk {c} refers to attribute {attr} ({qual}), "
                                     f"which the runtime does not know how to bind")
                setattr(net, attr, pg.tensor)
            net.train()
            out[c] = LoadedChunk.from_module(c, module, net)
        return out

    # ---- public API ---------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's local parameters (shards when t > 1), each once."""
        return list(self._params.values())

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self._params.items())

    def record_timeline(self, on: bool = True) -> None:
        """Record (pipeline rank, action, start_s, end_s) per action in `runner.timeline`."""
        self.executor.record = on

    @property
    def timeline(self) -> list[tuple[int, str, float, float]]:
        return list(self.executor.events)

    def train_step(self, inputs: Any, targets: torch.Tensor) -> float:
        """One optimizer step on this replica's share; the global mean loss (same everywhere)."""
        mbs = self._microbatches(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        losses = self.executor.run(mbs)
        self._sync_grads()
        if self.max_grad_norm is not None:
            self._clip(self.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        return self._global_loss(losses)

    def full_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The single-device model's state dict (user keys, tied weights under every name),
        gathered on global rank 0; other ranks return an empty dict. Collective: all call it."""
        local: dict[str, torch.Tensor] = {}
        if self.pg.dp_rank == 0:
            for ch in self.chunks.values():
                for attr, (qual, *_rest) in ch.module.PARAMETERS.items():
                    local[qual] = getattr(ch.net, attr).detach().clone()
                for attr, (qual, *_rest) in ch.module.BUFFERS.items():
                    local[qual] = getattr(ch.net, attr).detach().clone()
        if self.pg.t > 1:
            local = self._gather_tensor_parallel(local)
        send = local if (self.pg.dp_rank == 0 and self.pg.tp_rank == 0) else None
        parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(send, parts, dst=0)
        if dist.get_rank() != 0:
            return OrderedDict()
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            if part:
                merged.update(part)
        reference = self.prog.model.state_dict()
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, value in reference.items():
            graph_name = self.built.state_keys.get(key, key)
            out[key] = merged[graph_name] if graph_name in merged else value.detach().clone()
        return out

    # ---- internals ----------------------------------------------------------------------
    def _microbatches(self, inputs: Any, targets: torch.Tensor) -> list[tuple]:
        plan = self.plan
        xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        share = plan.micro_batch_size * plan.num_microbatches
        for name, x in [(f"inputs[{k}]", x) for k, x in enumerate(xs)] + [("targets", targets)]:
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != share:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"train_step: {name} has shape {got}; each data-parallel replica takes "
                    f"global_batch_size/d = {plan.global_batch_size}/{plan.d} = {share} "
                    f"sequences (micro_batch_size {plan.micro_batch_size} × "
                    f"{plan.num_microbatches} micro-batches); pass rows "
                    f"[{share}·dp_rank, {share}·(dp_rank+1)) of the global batch")
        b = plan.micro_batch_size
        return [tuple(x[i * b:(i + 1) * b] for x in xs) + (targets[i * b:(i + 1) * b],)
                for i in range(plan.num_microbatches)]

    def _grads(self, names: Sequence[str]) -> list[torch.Tensor]:
        """Existing gradients of `names` (a parameter no micro-batch reached has none, on
        every replica alike, and AdamW skips it as on one device)."""
        return [self._params[q].grad for q in names if self._params[q].grad is not None]

    def _all_reduce_coalesced(self, grads: list[torch.Tensor], group: Any, scale: float) -> None:
        if not grads:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        flat = _flatten_dense_tensors(grads)
        _all_reduce(flat, group)
        if scale != 1.0:
            flat.mul_(scale)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def _sync_grads(self) -> None:
        names = list(self._params)
        if self.pg.d > 1:
            self._all_reduce_coalesced(self._grads(names), self.pg.data, 1.0 / self.pg.d)
        if self._shared:
            for q in self._shared:
                if set(self._param_ranks[q]) != {0, self.pg.p - 1}:
                    raise ValueError(f"parameter {q} is used on pipeline ranks "
                                     f"{sorted(self._param_ranks[q])}; only weights shared by "
                                     f"the first and last stage (tied embeddings) are supported")
            self._all_reduce_coalesced(self._grads(self._shared), self.pg.embedding, 1.0)

    def _counted_once(self, q: str) -> bool:
        if q in self._shared and self.pg.pp_rank != 0:
            return False  # the first stage counts the tied copy
        replicated = tuple(self._params[q].shape) == self._full_shapes.get(
            self.built.prefix + q, tuple(self._params[q].shape))
        return not (self.pg.t > 1 and replicated and self.pg.tp_rank != 0)

    def _clip(self, max_norm: float) -> float:
        named = [(q, p.grad) for q, p in self._params.items() if p.grad is not None]
        grads = [g for _, g in named]
        sq = torch.zeros((), dtype=torch.float64)
        for q, g in named:
            if self._counted_once(q):
                sq += g.detach().double().pow(2).sum()
        for group, size in ((self.pg.tensor, self.pg.t), (self.pg.pipeline, self.pg.p)):
            if size > 1:
                _all_reduce(sq, group)
        total = float(sq.sqrt())
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def _global_loss(self, losses: list[torch.Tensor]) -> float:
        value = torch.zeros((), dtype=torch.float64)
        if losses:
            value += torch.stack([x.double() for x in losses]).mean()
        if self.pg.p > 1:
            _all_reduce(value, self.pg.pipeline)  # only the last stage contributes
        if self.pg.d > 1:
            _all_reduce(value, self.pg.data)
            value /= self.pg.d
        return float(value)

    def _gather_tensor_parallel(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Un-shard split parameters over the tensor group (all its ranks call this alike)."""
        from autopar.runtime.shard import unshard
        splits: dict[str, tuple[Any, int]] = {}
        for c in self.chunks:
            gm = self.built.chunks(self.pg.tp_rank)[c]
            spec = gm.meta["autopar_chunk"]
            for n in gm.graph.nodes:
                if n.op == "get_attr" and "tp_param" in n.meta and n.target in spec.params:
                    split = n.meta["tp_param"]
                    full = n.meta.get("tp_global_val", n.meta["val"])
                    splits[spec.params[n.target]] = (split, int(full.shape[split.dim]))
        out = dict(local)
        for qual in sorted(local):
            if qual not in splits:
                continue
            split, full_size = splits[qual]
            piece = local[qual].contiguous()
            pieces = [torch.empty_like(piece) for _ in range(self.pg.t)]
            from autopar.runtime.collectives import _peer_guard
            with _peer_guard("all-gather", self.pg.tensor):
                dist.all_gather(pieces, piece, group=self.pg.tensor)
            out[qual] = unshard(pieces, split, full_size)
        return out


def _all_reduce(x: torch.Tensor, group: Any) -> None:
    from autopar.runtime.collectives import _peer_guard
    with _peer_guard("all-reduce", group):
        dist.all_reduce(x, group=group)


def _param_holders(all_chunks: list) -> dict[str, set[int]]:
    """Parameter name -> pipeline ranks whose chunks use it."""
    holders: dict[str, set[int]] = {}
    for gm in all_chunks:
        spec = gm.meta["autopar_chunk"]
        for qual in spec.params.values():
            holders.setdefault(qual, set()).add(spec.rank)
    return holders
