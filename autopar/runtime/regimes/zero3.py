"""zero=3 and zero=2: weights, gradients and optimizer states sharded over the data group,
per chunk (ZeRO-3 / FSDP), under every schedule but interleaved-zb.

The mechanism is autopar.runtime.zero3_chunks (Zero3Chunks: each chunk's flat buffer, gathered and
released) and autopar.weight_gathers (`plan_gathers`: where on the action list the gathers, releases and gradient
reduce-scatters go, with at most `keep` chunks gathered at once: 2 for zero=3, every local
chunk for zero=2, the FSDP variant that keeps a chunk from its first forward to its last
backward). This regime runs those ops from the executor's hooks (the ones planned before
actions[n] in before_action, the rest in after_run), waits for a chunk's weights before each of
its computes, and steps the shards after the schedule.

Parameters that two chunks use — the tied input/output embedding, on the first and the last
chunk (two pipeline ranks, or one rank's first and last chunk when p = 1) — stay out of the
chunk shards: Zero3Chunks needs each parameter in one flat buffer, and a tied weight must be
whole on both stages for its gradient sum (Megatron's embedding all-reduce). They are kept
replicated: their gradients are averaged over d with one all-reduce after the schedule,
summed over the embedding group, and the same optimizer steps them (full copies, not shards:
vocab × hidden per stage, like ZeRO-1's weights).

bf16 (precision_dtype): the chunks' shards are the fp32 masters, gathered in bf16 and reduced
in fp32 (runtime/zero3_chunks.py's mixed precision); the replicated parameters compute in bf16 with
fp32 masters and main_grad (runtime/precision.py MixedPrecision, as under zero=0), which the
optimizer steps and clipping reads. fp8_weights (tensorwise FP8): the parameters only FP8
linears read are all-gathered in e4m3 with their amax reduced over the data and tensor groups
(runtime/zero3_chunks.py Fp8Gather), half bf16's gather traffic, the same numbers. Checkpoints store the
gathered weights and the unsharded optimizer state, as every other regime does, so they load
under any other plan.

Expert parallelism (torchtitan's expert FSDP over its dp_mod_ep mesh; Megatron-Core's expert
buffers over the expert-data-parallel group): each chunk's expert weights (this rank's E/ep
experts) are a second flat buffer, sharded over the expert-data group — the c·d/ep ranks
holding the same experts — while the dense weights are sharded over the c·d; each has its own
all-gather and reduce-scatter at the same points of the plan, and the experts' summed
gradients are divided by c·d, not c·d/ep (see autopar.runtime.data_parallel). Two Zero3Chunks
(`parts`: dense, experts) share one optimizer; clipping needs nothing more (every element of
either is held by one rank of its group, the world all-reduce adds them once).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.ckpt_pieces import held_range
from autopar.runtime.flat_shard import held_segments
from autopar.runtime.clip import local_sq_sum
from autopar.runtime.collectives import all_reduce_
from autopar.runtime.params import LocalParams
from autopar.runtime.precision import MixedPrecision
from autopar.runtime.regimes.base import (OptimizerFactory, OptimState, Regime, average_grads,
                                          sum_shared_grads)
from autopar.runtime.zero3_chunks import Fp8Gather, Zero3Chunks
from autopar.weight_gathers import plan_gathers
from autopar.schedules import Action


class Zero3(Regime):
    """zero=3 (keep=2) or zero=2 (keep = the rank's chunk count) on this rank (module doc)."""

    def __init__(self, params: LocalParams, groups: Any, make: OptimizerFactory,
                 actions: Sequence[Action], *, keep: int = 2,
                 precision_dtype: torch.dtype | None = None,
                 fp8_weights: frozenset = frozenset()):
        self.params, self.groups = params, groups
        shared = set(params.shared)
        self.replicated = [q for q in params.tensors
                           if q in shared or len(params.used_by.get(q, ())) > 1]
        replicated = [params.tensors[q] for q in self.replicated]
        self.mp = (MixedPrecision(replicated, compute_dtype=precision_dtype)
                   if precision_dtype is not None and replicated else None)
        # the replicated tensors the optimizer steps, by graph name (fp32 masters under bf16)
        self.stepped = OrderedDict(zip(self.replicated, self.mp.master_params)
                                   if self.mp is not None else zip(self.replicated, replicated))
        self.parts = self._parts(params, groups, precision_dtype, fp8_weights)
        self.optimizer = make([m for part in self.parts for _, ch in part.parts()
                               for m in ch.master] + list(self.stepped.values()))
        for part in self.parts:
            part.optimizer = self.optimizer
        # (master piece, ParamInfo of the parameter it is cut from, its flat span), for clipping
        self.pieces = [(m, params.infos[ch.names[s.param]], (s.lo, s.hi))
                       for part in self.parts for _, ch in part.parts()
                       for s, m in zip(ch.segments, ch.master)]
        self.sharded = {c for part in self.parts for c in part.chunks}
        self.ops: dict[int, list[tuple[str, int]]] = {}   # action index -> ops before it
        for n, op, c in plan_gathers(list(actions), keep=keep):
            if c in self.sharded:              # not a chunk whose weights are all replicated
                self.ops.setdefault(n, []).append((op, c))
        self.after = len(actions)              # plan_gathers' index of "after the schedule"
        self._shared = params.shared_by_group()

    def _parts(self, params: LocalParams, groups: Any, precision_dtype: torch.dtype | None,
               fp8_weights: frozenset) -> list[Zero3Chunks]:
        """The dense weights' Zero3Chunks over the data group and, under expert parallelism,
        the experts' over the expert-data group (module doc); without an optimizer yet. The
        dense part gathers fp8_weights in FP8 (tensorwise FP8 under bf16; experts are not FP8
        linears)."""
        fp8 = (Fp8Gather(weights=frozenset(id(params.tensors[q]) for q in fp8_weights
                                           if q not in self.replicated),
                         amax_groups=(groups.tensor,))
               if fp8_weights and precision_dtype == torch.bfloat16 else None)
        kinds = {False: (groups.data, None), True: (groups.expert_data, groups.d)}
        experts = {q for q, info in params.infos.items() if info.expert}
        parts = []
        for expert in ((False, True) if experts else (False,)):
            names = {c: [q for q in qs if q not in self.replicated and (q in experts) == expert]
                     for c, qs in params.first_chunk.items()}
            names = {c: qs for c, qs in names.items() if qs}
            if not names and expert:
                continue
            group, divide_by = kinds[expert]
            parts.append(Zero3Chunks(
                {c: [params.tensors[q] for q in qs] for c, qs in names.items()}, group,
                lambda _masters: None, names=names, param_dtype=precision_dtype,
                divide_by=divide_by, fp8=None if expert else fp8))
        return parts

    def before_action(self, n: int, action: Action) -> None:
        self._run_ops(n)
        if action.kind in ("F", "B") and action.chunk in self.sharded:
            for part in self.parts:
                if action.chunk in part.chunks:
                    part.wait(action.chunk)

    def after_run(self) -> None:
        self._run_ops(self.after)

    def _run_ops(self, n: int) -> None:
        for op, c in self.ops.get(n, ()):
            for part in self.parts:   # dense, then experts: the same order on every rank
                if c in part.chunks:
                    part.run(op, c)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()
        if self.mp is not None:
            self.mp.zero_grad()
        for q in self.replicated:
            self.params.tensors[q].grad = None

    def finish(self) -> None:
        """Land the per-chunk reduce-scatters, average the replicated (tied) gradients over
        d and sum them over the embedding group."""
        for part in self.parts:
            part.finish_reduces()
        average_grads([self.params.tensors[q] for q in self.replicated], self.groups.data,
                      self.groups.d)
        sum_shared_grads(self._shared, self.groups)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping: shard pieces count on every rank (each dp rank holds
        different elements), replicated parameters on dp rank 0 only; one all-reduce over the
        world, then torch's clip_grad_norm_ coefficient."""
        masters = [m for m, _, _ in self.pieces]
        total = local_sq_sum([m.grad for m in masters], [i for _, i, _ in self.pieces],
                             self.groups, real_parts=False, spans=[s for _, _, s in self.pieces])
        reps = list(self.stepped.values())   # their .grad: the fp32 main_grad under bf16
        if self.groups.dp_rank == 0 and reps:
            total = total + local_sq_sum([p.grad for p in reps],
                                         [self.params.infos[q] for q in self.replicated],
                                         self.groups)
        if dist.get_world_size() > 1:
            all_reduce_(total, self.groups.world)
        norm = total.sqrt()
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        for g in [m.grad for m in masters] + [p.grad for p in reps]:
            if g is not None:
                g.detach().mul_(coef.to(g.device, g.dtype))
        return norm

    def step(self) -> None:
        """Step the shards (new weights reach each chunk at its next gather): Zero3Chunks.step
        for the parts together, the optimizer they share stepped once."""
        for part in self.parts:
            part.check_released()
            part.finish_reduces()
        self.optimizer.step()
        for part in self.parts:
            part.stepped()                 # their FP8 amaxes renewed
        for part in self.parts:
            part.zero_grad()
        if self.mp is not None:
            self.mp.to_compute()           # the replicated bf16 copies of the new masters
            self.mp.zero_grad()            # relinks the masters' .grad the optimizer unset

    def fp32_weights(self) -> "OrderedDict[str, torch.Tensor]":
        full = {q: w for part in self.parts for q, w in part.full_parameters().items()}
        return OrderedDict((q, full[q] if q in full else self.stepped[q].detach())
                           for q in self.params.tensors)

    def optimizer_state(self) -> OptimState:
        """The unsharded state by user key: the chunks' gathered over dp (collective), the
        replicated (tied) parameters' as they are."""
        infos = self.params.infos
        out = {infos[q].key: st for part in self.parts
               for q, st in part.gathered_state().items()}
        from autopar.runtime.checkpoint import optimizer_state_by_key   # DCP: lazily
        out.update(optimizer_state_by_key(self.optimizer, self._replicated_by_key()))
        return out

    def shard_state(self) -> list:
        """Every chunk's master segments and their optimizer state, and the replicated (tied)
        parameters whole (views)."""
        out = [h for part in self.parts for _, ch in part.parts()
               for h in held_segments(ch.layout, ch.master, self.optimizer, ch.names)]
        return out + [held_range(q, 0, t.numel(), t, self.optimizer.state.get(t, {}), True)
                      for q, t in self.stepped.items()]

    def load(self, weights: dict[str, torch.Tensor], optimizer_state: OptimState) -> None:
        """Each chunk's shard and its optimizer state from the full (local-shape) values;
        the replicated parameters whole."""
        infos, reps = self.params.infos, set(self.replicated)
        with torch.no_grad():
            for q in self.replicated:
                self.stepped[q].copy_(weights[q])
            if self.mp is not None:
                self.mp.to_compute()
        by_name = ({q: optimizer_state[infos[q].key] for q in self.params.tensors
                    if q not in reps and infos[q].key in optimizer_state}
                   if optimizer_state else {})
        for part in self.parts:
            part.load({q: w for q, w in weights.items() if q not in reps}, by_name)
        from autopar.runtime.checkpoint import load_optimizer_state   # DCP: lazily
        load_optimizer_state(self.optimizer, self._replicated_by_key(), optimizer_state)

    def shards_loaded(self) -> None:
        """The chunks' next gathers read the loaded masters (their FP8 amaxes renewed); the
        replicated parameters' bf16 copies from their loaded masters."""
        for part in self.parts:
            part.stepped()
        if self.mp is not None:
            self.mp.to_compute()

    def _replicated_by_key(self) -> dict[str, torch.Tensor]:
        return {self.params.infos[q].key: t for q, t in self.stepped.items()}
