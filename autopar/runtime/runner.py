"""`compile_program` and `Runner`: this rank's share of a ParallelProgram, ready to train.

compile_program checks everything that can be checked locally (world size = t·p·d,
micro-batches ≥ p, enough layers for p·v chunks, zero level, precision) and raises ValueError
before any process blocks; then it joins the process groups, loads the generated source of this
rank's chunks, attaches clones of only their parameters and builds the training components:

    ZeroOptimizer (zero=1: fp32 master shard made from the fp32 weights)   data-parallel 1/d
    MixedPrecision (precision="bf16": bf16 weights, fp32 main_grad [+ fp32 masters if no ZeRO])
    GradSync (zero=0, d>1: bucketed async all-reduce; its hook runs after MixedPrecision's)

in that order (each one's hooks/casts assume the previous ones). Breadth-first + zero=1 uses
one ZeroOptimizer shard per chunk (_ChunkedZero), reduce-scattered at the chunk's REDUCE
action. zero=3 (breadth-first only, fp32) builds Zero3Chunks instead of all three: each
chunk's weights, gradients and optimizer state sharded over the data group; parameters two
chunks use (tied embeddings) stay replicated (Runner._build_zero3). Every local parameter is
described by a ParamInfo (user key, full shape, this rank's real slice; from the tensor-parallel
metadata 'tp_param'/'tp_global_val' of the chunk graphs), which clipping, ZeRO and checkpoints
read.

Runner.train_step = one optimizer step:
  1. split this data-parallel replica's batch into num_microbatches micro-batches;
  2. run the schedule's action list (autopar.runtime.executor); the last chunk backpropagates
     loss/m per micro-batch, so the accumulated gradient is that of the replica's mean loss.
     zero=0, d>1: right before the last backward of each local chunk (the last one that reaches
     a parameter, for a parameter used by two local chunks) GradSync arms that chunk's
     parameters, so their buckets' all-reduces overlap the rest of the backward;
     The executor's before_action hook also runs, under zero=1 + breadth-first, a chunk's
     reduce-scatter at its REDUCE action, and under zero=3 the ops of
     zero3.plan_gathers (all-gather a chunk's weights once per pass, prefetched one compute
     ahead; release after the pass; reduce-scatter after its last backward) plus the wait
     for a chunk's weights before each of its F/B; zero=3 then lands the reduce-scatters,
     averages the replicated weights' gradients, clips over the world and steps the shards;
  3. zero=0: GradSync.finish() (gradients now averaged over d);
  4. sum the gradients of parameters held by two pipeline ranks (tied input/output embeddings
     on the first and last stage) over the embedding group (Megatron's shared embedding);
  5. zero=1: reduce-scatter the gradients (ZeroOptimizer.reduce_grads);
  6. clip to max_grad_norm with the global norm (autopar.runtime.clip: squares summed over the
     tensor and pipeline groups — and data group under ZeRO — each replicated tensor once);
  7. optimizer step (on fp32 masters under bf16; ZeRO steps its shard and all-gathers);
     return the global mean loss, the same float on every rank.

Checkpoints (autopar.runtime.checkpoint): every tensor is stored as its slice of the logically
full tensor, keyed by the user's state-dict key, so a checkpoint loads under any other plan.
Parameters whose tensor-parallel split is not one contiguous range (fused q/k/v: each rank
holds a slice of every block) are gathered over the tensor group and stored whole.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autopar.plan import Plan
from autopar.runtime.executor import PipelineExecutor
from autopar.runtime.params import ParamInfo

DEFAULT_TIMEOUT_S = 300.0
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    if plan.zero not in (0, 1, 3):
        raise ValueError(
            f"plan.zero={plan.zero}: ZeRO-{plan.zero} is not supported by the runtime; "
            f"use zero=0/1, or zero=3 with schedule='breadth-first'")
    if plan.zero == 3 and plan.schedule != "breadth-first":
        raise ValueError(
            f"plan.zero=3 with schedule={plan.schedule!r}: ZeRO-3 is not yet supported by the "
            f"runtime; use zero=0/1 with this schedule, or schedule='breadth-first' (it "
            f"gathers each chunk's weights once per pass, not once per micro-batch)")
    if plan.p > 1 and plan.num_microbatches < plan.p:
        raise ValueError(
            f"plan.num_microbatches={plan.num_microbatches} < p={plan.p}: a pipeline of "
            f"{plan.p} stages needs at least p micro-batches per step to fill; raise the global "
            f"batch, lower micro_batch_size, or use a smaller p")
    layers = num_layers if num_layers is not None else plan.num_layers
    if layers and plan.p * plan.v > 1 and plan.p * plan.v > layers:
        raise ValueError(
            f"p·v = {plan.p}·{plan.v} = {plan.p * plan.v} chunks but the model has {layers} "
            f"layers; a pipeline has at most one chunk per layer — use v <= "
            f"{max(1, layers // plan.p)} (or a smaller p)")


def compile_program(prog: Any, optimizer: Callable | None = None,
                    max_grad_norm: float | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                    precision: str = "fp32", program_dir: str | Path | None = None,
                    record_timeline: bool = False, bucket_bytes: int | None = None
                    ) -> "Runner":
    """Build this rank's Runner (inside torchrun, or with a default process group already made).

    precision: "fp32" (default) or "bf16" (bf16 compute, fp32 master weights and gradient
    accumulation). program_dir: load the chunk sources from a directory written by
    `prog.save` instead of generating them in memory (edits to those files take effect).
    bucket_bytes: GradSync bucket size (default 25 MiB, as DDP).
    """
    from autopar.build import build_program
    from autopar.runtime.dist import ProcessGroups, init_distributed
    from autopar.schedules import make_schedule

    plan: Plan = prog.plan
    check_program(plan)
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be > 0 (or None for no clipping)")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: must be one of {sorted(PRECISIONS)} "
                         f"(bf16 = bf16 compute with fp32 master weights)")
    if plan.zero == 3 and precision != "fp32":
        raise ValueError(f"precision={precision!r} with zero=3: the ZeRO-3 runtime runs fp32 "
                         f"only for now; use precision='fp32', or zero=1 for bf16")
    schedule = make_schedule(plan.schedule, plan.p, plan.v, plan.num_microbatches)
    built = build_program(prog)             # local work only: capture, layers, cut
    check_program(plan, built.num_layers)
    _init_restarted_group(plan.gpus, timeout_s)
    device = init_distributed(plan.gpus, timeout_s=timeout_s)
    pg = ProcessGroups.create(plan.t, plan.p, plan.d, timeout_s=timeout_s)
    options = _Options(optimizer=optimizer, max_grad_norm=max_grad_norm, precision=precision,
                       program_dir=Path(program_dir) if program_dir is not None else None,
                       record_timeline=record_timeline, device=device,
                       bucket_bytes=bucket_bytes)
    return Runner(prog, built, pg, schedule[pg.pp_rank], options)


def _init_restarted_group(world_size: int, timeout_s: float) -> None:
    """Under torchrun restarts, create the default group on a store prefix of this attempt.

    torchrun (torch 2.13, --standalone / c10d rendezvous) hands restarted workers the same
    agent TCPStore, which still holds the previous attempt's gloo addresses: a restarted rank
    can read a dead rank's address and fail with "Connection refused" (measured). Prefixing
    the store with TORCHELASTIC_RESTART_COUNT gives every attempt fresh keys. Outside torchrun
    restarts (or when a default group already exists) this does nothing.
    """
    from autopar.runtime.dist import _check_world, _env_int, timeout
    restart = _env_int("TORCHELASTIC_RESTART_COUNT")
    if dist.is_initialized() or not restart or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    _check_world(world_size, _env_int("WORLD_SIZE"))
    td = timeout(timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          _env_int("WORLD_SIZE"), is_master=False, timeout=td)
    store = dist.PrefixStore(f"autopar/attempt{restart}", store)
    kwargs: dict[str, Any] = {}
    backend = "gloo"
    if torch.cuda.is_available():
        backend = "nccl"
        kwargs["device_id"] = torch.device("cuda", _env_int("LOCAL_RANK") or 0)
        torch.cuda.set_device(kwargs["device_id"])
    dist.init_process_group(backend, store=store, rank=_env_int("RANK"),
                            world_size=_env_int("WORLD_SIZE"), timeout=td, **kwargs)


@dataclass(frozen=True, kw_only=True)
class _Options:
    optimizer: Callable | None
    max_grad_norm: float | None
    precision: str
    program_dir: Path | None
    record_timeline: bool
    device: torch.device
    bucket_bytes: int | None


class Runner:
    """This rank's chunks, optimizer and schedule; see the module docstring for train_step."""

    def __init__(self, prog: Any, built: Any, pg: Any, actions: Sequence[Any],
                 options: _Options):
        self.prog, self.plan, self.built, self.pg = prog, prog.plan, built, pg
        self.max_grad_norm = options.max_grad_norm
        self.precision = options.precision
        self.device = options.device
        self.dp_rank, self.dp_size = pg.dp_rank, pg.d
        all_chunks = built.chunks(pg.tp_rank)
        self._param_ranks = _param_holders(all_chunks)
        self.chunks = self._load_chunks(all_chunks, options.program_dir)
        self._params: OrderedDict[str, torch.nn.Parameter] = OrderedDict()
        self._chunk_params: dict[int, list[str]] = {}
        for c, ch in self.chunks.items():
            for name, param in ch.net.named_parameters():
                q = self._qual[(c, name)]
                if q not in self._params:
                    self._params[q] = param
                    self._chunk_params.setdefault(c, []).append(q)
        self._shared = [q for q in self._params if len(self._param_ranks[q]) > 1]
        for q in self._shared:
            if set(self._param_ranks[q]) != {0, pg.p - 1}:
                raise ValueError(f"parameter {q} is used on pipeline ranks "
                                 f"{sorted(self._param_ranks[q])}; only weights shared by the "
                                 f"first and last stage (tied embeddings) are supported")
        self._full_shapes = {k: tuple(v.shape) for k, v in  # tied weights under every name
                             built.gm.named_parameters(remove_duplicate=False)}
        self._splits = self._tp_splits(all_chunks)
        self._blocked: dict[str, tuple[Any, int]] = {}   # q -> (ParamSplit, full size)
        self.param_infos = {q: self._param_info(q) for q in self._params}
        self._build_training(options)
        self._zero3_ops = self._zero3_schedule(actions)
        self._chunk_index = {c: i for i, c in enumerate(sorted(self._chunk_params))}
        self.executor = PipelineExecutor(
            chunks=self.chunks, actions=list(actions), p=pg.p,
            num_microbatches=self.plan.num_microbatches, pipeline_ranks=pg.pipeline_ranks,
            pp_rank=pg.pp_rank, p2p_group=pg.pipeline, tensor_group=pg.tensor, t=pg.t,
            tp_rank=pg.tp_rank, record=options.record_timeline,
            before_action=self._before_action, after_run=self._after_run)
        # weight gradients accumulate in W when the schedule splits backwards, else in B
        self._final_kind = "W" if any(a.kind == "W" for a in actions) else "B"
        self._arm_at = self._arming_points(actions)
        built.release(pg.tp_rank, pg.pp_rank)   # the runner owns its weights now
        self.steps = 0

    # ---- construction -------------------------------------------------------------------
    def _load_chunks(self, all_chunks: list, program_dir: Path | None) -> dict:
        from autopar.codegen import chunk_file_name, load_chunk_module, render_chunk
        from autopar.runtime.executor import LoadedChunk
        plan, pg = self.plan, self.pg
        shared: dict[str, torch.nn.Parameter] = {}
        self._qual: dict[tuple[int, str], str] = {}
        # Tensors of the user's model are copied; shards and materialised weights the build
        # made for this rank are taken over (the build's cache of them is released below).
        users = self.built.user_tensors()

        def own(x: torch.Tensor) -> torch.Tensor:
            return (x.detach().clone() if id(x) in users else x.detach()).to(self.device)
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
                    shared[qual] = torch.nn.Parameter(own(getattr(gm, attr)), requires_grad=True)
                net.register_parameter(attr, shared[qual])
                self._qual[(c, attr)] = qual
            for attr, (qual, _shape, _dtype) in module.BUFFERS.items():
                net.register_buffer(attr, own(getattr(gm, attr)))
            for attr, qual in getattr(module, "OBJECTS", {}).items():
                if qual != "tp_group":
                    raise ValueError(f"compile: chunk {c} refers to attribute {attr} ({qual}), "
                                     f"which the runtime does not know how to bind")
                setattr(net, attr, pg.tensor)
            net.train()
            out[c] = LoadedChunk.from_module(c, module, net)
        return out

    def _tp_splits(self, all_chunks: list) -> dict[str, tuple[Any, int]]:
        """Graph name -> (ParamSplit, full size along its dim) of this rank's split parameters."""
        splits: dict[str, tuple[Any, int]] = {}
        if self.pg.t == 1:
            return splits
        for c in self.chunks:
            gm = all_chunks[c]
            spec = gm.meta["autopar_chunk"]
            for n in gm.graph.nodes:
                if n.op == "get_attr" and "tp_param" in n.meta and n.target in spec.params:
                    split = n.meta["tp_param"]
                    full = n.meta.get("tp_global_val", n.meta["val"])
                    splits[spec.params[n.target]] = (split, int(full.shape[split.dim]))
        return splits

    def _param_info(self, q: str) -> ParamInfo:
        """Where local parameter `q` sits in the single-device model (see params.py)."""
        keys = sorted(k for k, g in self.built.state_keys.items() if g == q)
        key = q if (q in keys or not keys) else keys[0]
        aliases = tuple(k for k in keys if k != key)
        shape = self._full_shapes.get(self.built.prefix + q)
        shared = "embedding" if q in self._shared else None
        if q not in self._splits:
            shape = shape or tuple(self._params[q].shape)
            return ParamInfo(key=key, aliases=aliases, global_shape=shape, shared_with=shared)
        split, full = self._splits[q]
        if shape is None:   # the full shape: the local one with the split dim at full size
            shape = tuple(full if i == split.dim else n
                          for i, n in enumerate(self._params[q].shape))
        t, r = self.pg.t, self.pg.tp_rank
        if split.padded:
            n = split.padded // t
            start, stop = min(r * n, full), min((r + 1) * n, full)
        elif len(split.blocks) == 1:
            start, stop = r * (full // t), (r + 1) * (full // t)
        else:  # a slice of every block: not one range; counted on every tp rank, saved whole
            self._blocked[q] = (split, full)
            return ParamInfo(key=key, aliases=aliases, global_shape=shape,
                             replicated_over_tp=False, shared_with=shared)
        return ParamInfo(key=key, aliases=aliases, global_shape=shape, split_dim=split.dim,
                         start=start, stop=stop, replicated_over_tp=False, shared_with=shared)

    def _build_training(self, options: _Options) -> None:
        """ZeroOptimizer, then MixedPrecision, then GradSync (the order their hooks need)."""
        from autopar.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradSync
        from autopar.runtime.precision import MixedPrecision
        from autopar.runtime.zero import ZeroOptimizer
        make = options.optimizer or (lambda params: torch.optim.AdamW(params, lr=3e-4))
        params = list(self._params.values())
        infos = [self.param_infos[q] for q in self._params]
        self.zero = self.mp = self.grad_sync = self.zero3 = None
        self._replicated: list[str] = []
        if self.plan.zero == 3:
            self._build_zero3(make, options)
            return
        if self.plan.zero == 1 and self.plan.schedule == "breadth-first":
            self.zero = _ChunkedZero(
                [([self._params[q] for q in qs], [self.param_infos[q] for q in qs],
                  any(q in self._shared for q in qs))
                 for c, qs in sorted(self._chunk_params.items())], make, self.pg.data)
        elif self.plan.zero == 1:
            self.zero = ZeroOptimizer(params, infos, make, self.pg.data)
        if self.precision == "bf16":
            self.mp = MixedPrecision(params, compute_dtype=PRECISIONS["bf16"],
                                     master_weights=self.zero is None)
            self._retype_boundaries(PRECISIONS["bf16"])
        if self.zero is not None:
            self.optimizer = self.zero.optimizer
        else:
            self.optimizer = make(self.mp.master_params if self.mp else params)
        # the tensors the optimizer steps, by graph name (fp32 masters under bf16)
        self._stepped = OrderedDict(zip(self._params, self.mp.master_params)) \
            if (self.mp and self.zero is None) else OrderedDict(self._params)
        if self.zero is None and self.pg.d > 1:
            chunks = [[self._params[q] for q in self._chunk_params.get(c, [])]
                      for c in sorted(self.chunks)]
            self.grad_sync = GradSync(params, self.pg.data, chunks=[c for c in chunks if c],
                                      bucket_bytes=options.bucket_bytes or DEFAULT_BUCKET_BYTES)

    def _build_zero3(self, make: Callable, options: _Options) -> None:
        """zero=3 (breadth-first): Zero3Chunks shards each local chunk's weights, gradients
        and optimizer state over the data group (autopar.runtime.zero3).

        Parameters that two chunks use — the tied input/output embedding, on the first and
        the last chunk (two pipeline ranks, or one rank's first and last chunk when p = 1) —
        stay out of the chunk shards: Zero3Chunks needs each parameter in one flat buffer, and
        a tied weight must be whole on both stages for its gradient sum (Megatron's embedding
        all-reduce). They are kept replicated: their gradients are averaged over d with one
        all-reduce after the schedule, summed over the embedding group, and the same optimizer
        steps them (full copies, not shards: vocab × hidden per stage, like ZeRO-1's weights).
        """
        from autopar.runtime.zero3 import Zero3Chunks
        if self.precision != "fp32":
            raise ValueError(f"precision={self.precision!r} with zero=3: the ZeRO-3 runtime "
                             f"runs fp32 only for now; use precision='fp32', or zero=1 for bf16")
        users: dict[str, set[int]] = {}
        for (c, _attr), q in self._qual.items():
            users.setdefault(q, set()).add(c)
        self._replicated = [q for q in self._params
                            if q in self._shared or len(users.get(q, ())) > 1]
        chunk_names = {c: [q for q in qs if q not in self._replicated]
                       for c, qs in self._chunk_params.items()}
        chunk_names = {c: qs for c, qs in chunk_names.items() if qs}
        replicated = [self._params[q] for q in self._replicated]
        self.zero3 = Zero3Chunks(
            {c: [self._params[q] for q in qs] for c, qs in chunk_names.items()}, self.pg.data,
            lambda masters: make(list(masters) + replicated), names=chunk_names)
        self.optimizer = self.zero3.optimizer
        self._stepped = OrderedDict(self._params)
        # (master piece, ParamInfo of the parameter it is cut from), for clipping
        self._zero3_pieces = [(m, self.param_infos[chunk_names[c][s.param]])
                              for c, ch in self.zero3.chunks.items()
                              for s, m in zip(ch.segments, ch.master)]

    def _zero3_schedule(self, actions: Sequence[Any]) -> dict[int, list[tuple[str, int]]]:
        """Action index -> the ZeRO-3 ops to run before it (autopar.runtime.zero3.plan_gathers;
        index len(actions): after the schedule). Empty unless zero=3."""
        if self.zero3 is None:
            return {}
        from autopar.runtime.zero3 import plan_gathers
        ops: dict[int, list[tuple[str, int]]] = {}
        for n, op, c in plan_gathers(list(actions)):
            if c in self.zero3.chunks:        # a chunk whose weights are all replicated
                ops.setdefault(n, []).append((op, c))
        return ops

    def _before_action(self, n: int, a: Any) -> None:
        """Executor hook before actions[n]: GradSync arming (zero=0, d>1) before a chunk's
        last B (its last W when the schedule splits backwards); under zero=3 the gathers / releases / reduce-scatters planned at n, then the
        wait for chunk a.chunk's weights before its F/B."""
        if self.grad_sync is not None and a.kind == self._final_kind:
            self._arm(a)
        if a.kind == "REDUCE" and isinstance(self.zero, _ChunkedZero) \
                and a.chunk in self._chunk_index:
            self.zero.reduce_chunk(self._chunk_index[a.chunk])
        if self.zero3 is not None:
            self._run_zero3_ops(n)
            if a.kind in ("F", "B") and a.chunk in self.zero3.chunks:
                self.zero3.wait(a.chunk)

    def _after_run(self) -> None:
        if self.zero3 is not None:
            self._run_zero3_ops(len(self.executor.actions))

    def _run_zero3_ops(self, n: int) -> None:
        for op, c in self._zero3_ops.get(n, ()):
            self.zero3.run(op, c)

    def _retype_boundaries(self, dtype: torch.dtype) -> None:
        """Floating activations crossing pipeline stages travel in the compute dtype."""
        name = str(dtype).replace("torch.", "")
        for ch in self.chunks.values():
            for specs in (ch.recv, ch.send):
                for i, spec in enumerate(specs):
                    if getattr(torch, spec[2]).is_floating_point:
                        specs[i] = (spec[0], spec[1], name) + tuple(spec[3:])

    def _arming_points(self, actions: Sequence[Any]) -> dict[tuple[int, int], list]:
        """(chunk, micro-batch) of a B action -> the parameters whose gradient it makes final:
        those of the chunk whose last B it is (for a parameter two local chunks use, the later
        of their last Bs). With split backwards (W actions) the weight gradients accumulate in
        W, so W takes B's place here (self._final_kind)."""
        uses: dict[int, set[str]] = {}
        for (c, _attr), q in self._qual.items():
            uses.setdefault(c, set()).add(q)
        last: dict[str, tuple[int, int, int]] = {}
        for pos, a in enumerate(actions):
            if a.kind == self._final_kind:
                for q in uses.get(a.chunk, ()):
                    last[q] = (pos, a.chunk, a.mb)
        out: dict[tuple[int, int], list] = {}
        for q, (_pos, c, mb) in last.items():
            out.setdefault((c, mb), []).append(self._params[q])
        return out

    def _arm(self, a: Any) -> None:
        params = self._arm_at.get((a.chunk, a.mb))
        if params:
            self.grad_sync.begin_final_microbatch(params)

    # ---- public API ---------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's local parameters (shards when t > 1), each once. Under zero=3 the
        chunk weights are released between steps (0-byte storage): read full_state_dict()."""
        return list(self._params.values())

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self._params.items())

    def record_timeline(self, on: bool = True) -> None:
        """Record (pipeline rank, action, start_s, end_s) per action in `runner.timeline`."""
        self.executor.record = on

    @property
    def timeline(self) -> list[tuple[int, str, float, float]]:
        return list(self.executor.events)

    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's optimizer-state tensors (Adam's m, v, ...; 1/d under ZeRO-1)."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))

    def train_step(self, inputs: Any, targets: torch.Tensor) -> float:
        """One optimizer step on this replica's share; the global mean loss (same everywhere)."""
        mbs = self._microbatches(inputs, targets)
        self._zero_grads()
        losses = self.executor.run(mbs)
        if self.zero3 is not None:
            self._zero3_update()
            self.steps += 1
            return self._global_loss(losses)
        if self.grad_sync is not None:
            self.grad_sync.finish()
        self._sum_tied_grads()
        if self.zero is not None:
            self.zero.reduce_grads()
            if self.max_grad_norm is not None:
                self.zero.clip_grad_norm_(self.max_grad_norm, self.pg)
            self.zero.step()
            self.zero.zero_grad()
        else:
            if self.max_grad_norm is not None:
                from autopar.runtime.clip import clip_grad_norm_
                clip_grad_norm_(list(self._stepped.values()),
                                [self.param_infos[q] for q in self._stepped],
                                self.max_grad_norm, self.pg)
            if self.mp is not None:
                self.mp.step(self.optimizer)
            else:
                self.optimizer.step()
        self.steps += 1
        return self._global_loss(losses)

    def _zero3_update(self) -> None:
        """zero=3 after the schedule: land the per-chunk reduce-scatters, average the
        replicated (tied) gradients over d and sum them over the embedding group, clip with
        the global norm, step the shards (new weights reach each chunk at its next gather)."""
        z = self.zero3
        z.finish_reduces()
        if self._replicated and self.pg.d > 1:
            from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
            params = [self._params[q] for q in self._replicated]
            for p in params:
                if p.grad is None:          # keep the collective's shape equal on all ranks
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            _all_reduce(flat, self.pg.data)
            flat.div_(self.pg.d)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self._sum_tied_grads()
        if self.max_grad_norm is not None:
            self._clip_zero3(self.max_grad_norm)
        z.step()
        z.zero_grad()

    def _clip_zero3(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping under zero=3: shard pieces count on every rank (each dp rank
        holds different elements), replicated parameters on dp rank 0 only; one all-reduce
        over the world, then torch's clip_grad_norm_ coefficient."""
        from autopar.runtime.clip import local_sq_sum
        pieces = [m for m, _ in self._zero3_pieces]
        total = local_sq_sum([m.grad for m in pieces], [i for _, i in self._zero3_pieces],
                             self.pg, real_parts=False)
        reps = [self._params[q] for q in self._replicated]
        if self.pg.dp_rank == 0 and reps:
            total = total + local_sq_sum([p.grad for p in reps],
                                         [self.param_infos[q] for q in self._replicated],
                                         self.pg)
        if dist.get_world_size() > 1:
            _all_reduce(total, self.pg.world)
        norm = total.sqrt()
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        for g in [m.grad for m in pieces] + [p.grad for p in reps]:
            if g is not None:
                g.detach().mul_(coef.to(g.device, g.dtype))
        return norm

    def full_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The single-device model's state dict (user keys, tied weights under every name,
        fp32 master values under bf16), gathered on global rank 0; other ranks return an empty
        dict. Collective: all ranks call it."""
        weights = self._fp32_weights()
        local: dict[str, torch.Tensor] = {}
        if self.pg.dp_rank == 0:
            for ch in self.chunks.values():
                for attr, (qual, *_rest) in ch.module.PARAMETERS.items():
                    local[qual] = weights[qual].detach().cpu().clone()
                for attr, (qual, *_rest) in ch.module.BUFFERS.items():
                    local[qual] = getattr(ch.net, attr).detach().cpu().clone()
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

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save weights (fp32 masters under bf16), optimizer state and step to `path`,
        atomically (see autopar.runtime.checkpoint). Collective: every rank calls it."""
        self._no_zero3_checkpoints("save_checkpoint")
        from autopar.runtime.checkpoint import optimizer_state_by_key, save_checkpoint
        weights = self._fp32_weights()
        if self.zero is not None:
            ostate = self.zero.gathered_state()
        else:
            ostate = optimizer_state_by_key(
                self.optimizer, {self.param_infos[q].key: p for q, p in self._stepped.items()})
        tensors = {}
        for q, w in weights.items():
            info = self.param_infos[q]
            if q in self._blocked:      # fused q/k/v: store the whole tensor (tp rank 0 writes)
                w = self._unshard_blocked(q, w)
                st = ostate.get(info.key, {})
                ostate[info.key] = {k: (v if v.dim() == 0 else self._unshard_blocked(q, v))
                                    for k, v in sorted(st.items())}
                info = _whole(info)
            tensors[info.key] = (w.detach().cpu(), info)
        ostate = {k: {n: v.detach().cpu() for n, v in st.items()} for k, st in ostate.items()}
        from autopar.runtime.collectives import _peer_guard
        with _peer_guard("checkpoint save with", self.pg.world):
            save_checkpoint(path, tensors, ostate, self.steps, self.pg, self.plan.to_json())

    def load_checkpoint(self, path: str | os.PathLike) -> int:
        """Load a checkpoint saved under this or any other plan (other t, p, d, v, zero,
        precision); return its step count. Keys and full shapes must match this model's:
        otherwise ValueError naming them, on every rank. Collective: every rank calls it."""
        self._no_zero3_checkpoints("load_checkpoint")
        from autopar.runtime.checkpoint import load_checkpoint, read_layout
        layout = read_layout(path)
        self._check_checkpoint_keys(path, layout)
        targets: dict[str, tuple[torch.Tensor, ParamInfo]] = {}
        for q, p in self._params.items():
            info = self.param_infos[q]
            if q in self._blocked:
                info = _whole(info)
            targets[info.key] = (torch.zeros(info.global_shape if q in self._blocked
                                             else p.shape, dtype=torch.float32), info)
        ostate: dict[str, dict[str, torch.Tensor]] = {}
        step = load_checkpoint(path, targets, self.pg, optimizer_state=ostate, strict=False)
        weights: dict[str, torch.Tensor] = {}
        for q in self._params:
            key = self.param_infos[q].key
            w = targets[key][0]
            if q in self._blocked:
                w = self._shard_blocked(q, w)
                ostate[key] = {k: (v if v.dim() == 0 else self._shard_blocked(q, v))
                               for k, v in ostate.get(key, {}).items()}
            weights[q] = w
        self._install(weights, ostate)
        self.steps = step
        return step

    def close(self) -> None:
        """End the job on this rank: wait for every rank, then destroy the process groups.
        Collective: every rank calls it once, after its last step. The barrier keeps any rank
        from exiting while a peer is still in its last step's collectives or p2p messages (a
        peer that vanishes mid-exchange is a failure of the job); a dead rank is a PeerError."""
        from autopar.runtime.collectives import _peer_guard
        if not dist.is_initialized():
            return
        with _peer_guard("the closing barrier with", self.pg.world):
            dist.barrier(group=self.pg.world)
        dist.destroy_process_group()

    def _no_zero3_checkpoints(self, what: str) -> None:
        if self.zero3 is not None:
            raise ValueError(f"{what}: checkpoints under zero=3 are not supported yet (the "
                             f"optimizer state is sharded per chunk); train with zero=1 to "
                             f"checkpoint, or use full_state_dict() for the weights")

    # ---- internals: training ------------------------------------------------------------
    def _zero_grads(self) -> None:
        if self.zero3 is not None:
            self.zero3.zero_grad()
            for q in self._replicated:
                self._params[q].grad = None
        elif self.zero is not None:
            self.zero.zero_grad()
        elif self.mp is not None:
            self.mp.zero_grad()
        else:
            for p in self._params.values():
                p.grad = None

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
        xs = tuple(x.to(self.device) for x in xs)
        targets = targets.to(self.device)
        b = plan.micro_batch_size
        return [tuple(x[i * b:(i + 1) * b] for x in xs) + (targets[i * b:(i + 1) * b],)
                for i in range(plan.num_microbatches)]

    def _sum_tied_grads(self) -> None:
        """Tied embedding copies on the first and last stage: sum their gradients."""
        if not self._shared:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        grads = []
        for q in self._shared:
            p = self._params[q]
            if hasattr(p, "main_grad"):
                grads.append(p.main_grad)
            else:
                if p.grad is None:   # keep the collective's shape equal on both stages
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        flat = _flatten_dense_tensors(grads)
        _all_reduce(flat, self.pg.embedding)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def _global_loss(self, losses: list[torch.Tensor]) -> float:
        value = torch.zeros((), dtype=torch.float64)
        if losses:
            value += torch.stack([x.double().cpu() for x in losses]).mean()
        if self.pg.p > 1:
            _all_reduce(value, self.pg.pipeline)  # only the last stage contributes
        if self.pg.d > 1:
            _all_reduce(value, self.pg.data)
            value /= self.pg.d
        return float(value)

    # ---- internals: weights and checkpoints ---------------------------------------------
    def _fp32_weights(self) -> "OrderedDict[str, torch.Tensor]":
        """Graph name -> this rank's local weights at full precision (the fp32 masters under
        bf16). Collective over the data group under ZeRO-1 + bf16 (masters are sharded) and
        under ZeRO-3 (weights are sharded: every chunk is gathered)."""
        if self.zero3 is not None:
            full = self.zero3.full_parameters()
            return OrderedDict((q, full[q] if q in full else p.detach())
                               for q, p in self._params.items())
        if self.zero is not None and self.mp is not None:
            return OrderedDict(zip(self._params, self.zero.gathered_masters()))
        return OrderedDict((q, p.detach()) for q, p in self._stepped.items())

    def _install(self, weights: dict[str, torch.Tensor],
                 ostate: dict[str, dict[str, torch.Tensor]]) -> None:
        """Loaded fp32 weights and per-key optimizer state -> parameters, masters, optimizer."""
        from autopar.runtime.checkpoint import load_optimizer_state
        with torch.no_grad():
            for q, w in weights.items():
                self._stepped[q].copy_(w)
                self._params[q].copy_(w)
        if self.mp is not None and self.zero is None:
            self.mp.to_compute()
        if self.zero is not None:
            self.zero.load_masters([weights[q] for q in self._params])
            if ostate:
                self.zero.load_gathered_state(ostate)
        else:
            load_optimizer_state(self.optimizer, {self.param_infos[q].key: p
                                                  for q, p in self._stepped.items()}, ostate)

    def _check_checkpoint_keys(self, path: Any, layout: dict) -> None:
        """Every rank's parameters together must be exactly the checkpoint's, with the same
        full shapes; else the same ValueError on every rank, naming the keys."""
        mine = {info.key: list(info.global_shape) for info in self.param_infos.values()}
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        model: dict[str, list[int]] = {}
        for part in parts:
            model.update(part)
        from autopar.runtime.checkpoint import check_fits
        check_fits(layout, model, where=f"load_checkpoint: {path}", fix="(the plan may differ)")

    def _unshard_blocked(self, q: str, local: torch.Tensor) -> torch.Tensor:
        from autopar.runtime.collectives import _peer_guard
        from autopar.runtime.shard import unshard
        split, full = self._blocked[q]
        piece = local.detach().contiguous()
        pieces = [torch.empty_like(piece) for _ in range(self.pg.t)]
        with _peer_guard("all-gather with", self.pg.tensor):
            dist.all_gather(pieces, piece, group=self.pg.tensor)
        return unshard(pieces, split, full)

    def _shard_blocked(self, q: str, full: torch.Tensor) -> torch.Tensor:
        from autopar.runtime.shard import local_shard
        split, _ = self._blocked[q]
        return local_shard(full, split, self.pg.tp_rank, self.pg.t)

    def _gather_tensor_parallel(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Un-shard split parameters over the tensor group (all its ranks call this alike)."""
        from autopar.runtime.collectives import _peer_guard
        from autopar.runtime.shard import unshard
        out = dict(local)
        for qual in sorted(local):
            if qual not in self._splits:
                continue
            split, full_size = self._splits[qual]
            piece = local[qual].contiguous()
            pieces = [torch.empty_like(piece) for _ in range(self.pg.t)]
            with _peer_guard("all-gather with", self.pg.tensor):
                dist.all_gather(pieces, piece, group=self.pg.tensor)
            out[qual] = unshard(pieces, split, full_size)
        return out


class _ChunkedZero:
    """ZeRO-1 for breadth-first: one ZeroOptimizer flat shard per chunk, all stepped by one
    optimizer, so each chunk's gradients are reduce-scattered at the schedule's REDUCE R{c}
    (right after the chunk's last backward) instead of once after the schedule — the
    per-chunk reduction of layered gradient accumulation (2106.02679 §4). Chunks holding a
    tied weight (held by two pipeline stages) are reduced after the schedule instead: their
    full gradient must first be summed over the embedding group. Same interface as
    ZeroOptimizer (what the runner and checkpoints call); parameters are concatenated in chunk
    order, which is the runner's parameter order."""

    def __init__(self, chunks: list[tuple[list, list, bool]], make: Callable, group: Any):
        from autopar.runtime.zero import ZeroOptimizer
        self.parts = [ZeroOptimizer(ps, infos, lambda _masters: None, group)
                      for ps, infos, _tied in chunks]
        self._deferred = {i for i, (_ps, _infos, tied) in enumerate(chunks) if tied}
        self.optimizer = make([m for part in self.parts for m in part.master])
        for part in self.parts:
            part.optimizer = self.optimizer
        self._reduced: set[int] = set()

    def reduce_chunk(self, i: int) -> None:
        """Reduce-scatter chunk i's gradients now (at its REDUCE action), unless deferred."""
        if i not in self._deferred and i not in self._reduced:
            self.parts[i].reduce_grads(async_op=True)   # overlaps the backward below it
            self._reduced.add(i)

    def reduce_grads(self) -> None:
        for i, part in enumerate(self.parts):
            if i not in self._reduced:
                part.reduce_grads()
                self._reduced.add(i)
            part.finish_reduce()

    def clip_grad_norm_(self, max_norm: float, groups: Any) -> torch.Tensor:
        from autopar.runtime.clip import clip_grad_norm_
        self.reduce_grads()
        masters = [m for part in self.parts for m in part.master]
        infos = [part.param_infos[s.index] for part in self.parts for s in part.segments]
        return clip_grad_norm_(masters, infos, max_norm, groups, dp_sharded=True,
                               real_parts=False)

    @torch.no_grad()
    def step(self) -> None:
        self.reduce_grads()
        self.optimizer.step()
        for part in self.parts:
            part._shard_grad = None
            part._all_gather_params()
        self._reduced.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)
        self._reduced.clear()

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))

    def master_bytes(self) -> int:
        return sum(part.master_bytes() for part in self.parts)

    def reload_master_from_params(self) -> None:
        for part in self.parts:
            part.reload_master_from_params()

    def gathered_masters(self) -> list[torch.Tensor]:
        return [w for part in self.parts for w in part.gathered_masters()]

    def load_masters(self, weights: Sequence[torch.Tensor]) -> None:
        weights = list(weights)
        for part in self.parts:
            part.load_masters(weights[:len(part.params)])
            weights = weights[len(part.params):]

    def gathered_state(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for part in self.parts:
            out.update(part.gathered_state())
        return out

    def load_gathered_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for part in self.parts:
            part.load_gathered_state(state)


def _whole(info: ParamInfo) -> ParamInfo:
    """The ParamInfo of a tensor gathered whole over the tensor group (written by tp rank 0)."""
    return ParamInfo(key=info.key, aliases=info.aliases, global_shape=info.global_shape,
                     shared_with=info.shared_with)


def _all_reduce(x: torch.Tensor, group: Any) -> None:
    from autopar.runtime.collectives import _peer_guard
    with _peer_guard("all-reduce with", group):
        dist.all_reduce(x, group=group)


def _param_holders(all_chunks: list) -> dict[str, set[int]]:
    """Parameter name -> pipeline ranks whose chunks use it."""
    holders: dict[str, set[int]] = {}
    for gm in all_chunks:
        spec = gm.meta["autopar_chunk"]
        for qual in spec.params.values():
            holders.setdefault(qual, set()).add(spec.rank)
    return holders
