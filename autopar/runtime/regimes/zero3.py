"""zero=3: weights, gradients and optimizer states sharded over the data group, per chunk.

The mechanism is autopar.runtime.zero3 (Zero3Chunks: each chunk's flat buffer, gathered for
a pass and released after it; `plan_gathers`: where on the action list the gathers, releases
and gradient reduce-scatters go). This regime runs those ops from the executor's hooks (the
ones planned before actions[n] in before_action, the rest in after_run), waits for a chunk's
weights before each of its computes, and steps the shards after the schedule.

Parameters that two chunks use — the tied input/output embedding, on the first and the last
chunk (two pipeline ranks, or one rank's first and last chunk when p = 1) — stay out of the
chunk shards: Zero3Chunks needs each parameter in one flat buffer, and a tied weight must be
whole on both stages for its gradient sum (Megatron's embedding all-reduce). They are kept
replicated: their gradients are averaged over d with one all-reduce after the schedule,
summed over the embedding group, and the same optimizer steps them (full copies, not shards:
vocab × hidden per stage, like ZeRO-1's weights). fp32 only for now.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.clip import local_sq_sum
from autopar.runtime.collectives import all_reduce_
from autopar.runtime.params import LocalParams
from autopar.runtime.regimes.base import (OptimizerFactory, OptimState, Regime, average_grads,
                                          sum_tied_grads)
from autopar.runtime.zero3 import Zero3Chunks, plan_gathers
from autopar.schedules import Action


class Zero3(Regime):
    """zero=3 on this rank (module doc)."""

    def __init__(self, params: LocalParams, groups: Any, make: OptimizerFactory,
                 actions: Sequence[Action]):
        self.params, self.groups = params, groups
        shared = set(params.shared)
        self.replicated = [q for q in params.tensors
                           if q in shared or len(params.used_by.get(q, ())) > 1]
        names = {c: [q for q in qs if q not in self.replicated]
                 for c, qs in params.first_chunk.items()}
        names = {c: qs for c, qs in names.items() if qs}
        replicated = [params.tensors[q] for q in self.replicated]
        self.chunks = Zero3Chunks(
            {c: [params.tensors[q] for q in qs] for c, qs in names.items()}, groups.data,
            lambda masters: make(list(masters) + replicated), names=names)
        self.optimizer = self.chunks.optimizer
        # (master piece, ParamInfo of the parameter it is cut from), for clipping
        self.pieces = [(m, params.infos[names[c][s.param]])
                       for c, ch in self.chunks.chunks.items()
                       for s, m in zip(ch.segments, ch.master)]
        self.ops: dict[int, list[tuple[str, int]]] = {}   # action index -> ops before it
        for n, op, c in plan_gathers(list(actions)):
            if c in self.chunks.chunks:        # not a chunk whose weights are all replicated
                self.ops.setdefault(n, []).append((op, c))
        self.after = len(actions)              # plan_gathers' index of "after the schedule"
        self._shared = [params.tensors[q] for q in params.shared]

    def before_action(self, n: int, action: Action) -> None:
        self._run_ops(n)
        if action.kind in ("F", "B") and action.chunk in self.chunks.chunks:
            self.chunks.wait(action.chunk)

    def after_run(self) -> None:
        self._run_ops(self.after)

    def _run_ops(self, n: int) -> None:
        for op, c in self.ops.get(n, ()):
            self.chunks.run(op, c)

    def zero_grad(self) -> None:
        self.chunks.zero_grad()
        for q in self.replicated:
            self.params.tensors[q].grad = None

    def finish(self) -> None:
        """Land the per-chunk reduce-scatters, average the replicated (tied) gradients over
        d and sum them over the embedding group."""
        self.chunks.finish_reduces()
        average_grads([self.params.tensors[q] for q in self.replicated], self.groups.data,
                      self.groups.d)
        sum_tied_grads(self._shared, self.groups.embedding)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping: shard pieces count on every rank (each dp rank holds
        different elements), replicated parameters on dp rank 0 only; one all-reduce over the
        world, then torch's clip_grad_norm_ coefficient."""
        masters = [m for m, _ in self.pieces]
        total = local_sq_sum([m.grad for m in masters], [i for _, i in self.pieces],
                             self.groups, real_parts=False)
        reps = [self.params.tensors[q] for q in self.replicated]
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
        """Step the shards (new weights reach each chunk at its next gather)."""
        self.chunks.step()
        self.chunks.zero_grad()

    def fp32_weights(self) -> "OrderedDict[str, torch.Tensor]":
        full = self.chunks.full_parameters()
        return OrderedDict((q, full[q] if q in full else p.detach())
                           for q, p in self.params.tensors.items())

    def check_checkpointable(self, what: str) -> None:
        raise ValueError(f"{what}: checkpoints under zero=3 are not supported yet (the "
                         f"optimizer state is sharded per chunk); train with zero=1 to "
                         f"checkpoint, or use full_state_dict() for the weights")

    def optimizer_state(self) -> OptimState:
        self.check_checkpointable("optimizer_state")
        return {}

    def load(self, weights: dict[str, torch.Tensor], optimizer_state: OptimState) -> None:
        self.check_checkpointable("load")
