"""zero=0: every data-parallel replica holds the whole optimizer (Megatron-LM's default).

Math: each replica's gradient g_r is its share's mean-loss gradient; the global one is
(1/d) Σ_r g_r, one bucketed all-reduce (autopar.runtime.data_parallel.GradSync) launched
during the last backward of each chunk, so most of it overlaps the rest of the backward.
Under bf16 (autopar.runtime.precision.MixedPrecision) the parameters compute in bf16 and the
optimizer steps fp32 masters with the fp32 `main_grad` accumulation.

Expert parallelism: the experts' gradients go to a second GradSync over the expert-data
group (c·d/ep ranks), divided by c·d (see autopar.runtime.data_parallel); the rest as above.

Per step: zero_grad → schedule (before each chunk's last backward, GradSync arms that chunk's
parameters: its buckets launch as their gradients become final) → finish (wait for the
buckets, sum the tied embedding over the embedding group) → clip (global norm over the
model-parallel group) → step.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch

from autopar.runtime.ckpt_pieces import held_range
from autopar.runtime.clip import clip_grad_norm_
from autopar.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradSync
from autopar.runtime.params import LocalParams
from autopar.runtime.precision import MixedPrecision
from autopar.runtime.regimes.base import (OptimizerFactory, OptimState, Regime,
                                          final_backwards, sum_shared_grads,
                                          weight_grad_kind)
from autopar.schedules import Action


class Replicated(Regime):
    """zero=0 on this rank: the user's optimizer over every local parameter (module doc)."""

    def __init__(self, params: LocalParams, groups: Any, make: OptimizerFactory,
                 actions: Sequence[Action], *, precision_dtype: torch.dtype | None = None,
                 bucket_bytes: int | None = None):
        self.params, self.groups = params, groups
        tensors = list(params.tensors.values())
        self.mp = (MixedPrecision(tensors, compute_dtype=precision_dtype)
                   if precision_dtype is not None else None)
        # the tensors the optimizer steps, by graph name (the fp32 masters under bf16)
        self.stepped = OrderedDict(zip(params.tensors, self.mp.master_params)) \
            if self.mp is not None else OrderedDict(params.tensors)
        self.optimizer = make(list(self.stepped.values()))
        self.syncs: list[GradSync] = []
        self.arm_at: dict[tuple[int, int], list[list]] = {}
        self.final_kind = weight_grad_kind(actions)
        if groups.d > 1:   # after MixedPrecision: its hook folds .grad into main_grad first
            for expert in (False, True):
                names = {q for q, info in params.infos.items() if info.expert == expert}
                if not names:
                    continue
                chunks = [[params.tensors[q] for q in qs if q in names]
                          for _, qs in sorted(params.first_chunk.items())]
                self.syncs.append(GradSync(
                    [p for q, p in params.tensors.items() if q in names],
                    groups.expert_data if expert else groups.data,
                    chunks=[c for c in chunks if c], divide_by=groups.d if expert else None,
                    bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES))
            # per (chunk, micro-batch): each sync's own parameters, split once here (not
            # filtered by id before every final backward of every step)
            self.arm_at = {key: [[p for p in ps if id(p) in sync.ids] for sync in self.syncs]
                           for key, ps in final_backwards(actions, params.in_chunks(),
                                                          params.tensors).items()}
        if self.mp is not None:
            self.mp.point_masters()   # main_grad is a bucket slot now (clip reads them)
        self._shared = params.shared_by_group()

    def before_action(self, n: int, action: Action) -> None:
        params = self.arm_at.get((action.chunk, action.mb)) \
            if action.kind == self.final_kind else None
        if params:
            for sync, own in zip(self.syncs, params):   # each arms only its own parameters
                if own:
                    sync.begin_final_microbatch(own)

    def zero_grad(self) -> None:
        if self.mp is not None:
            self.mp.zero_grad()
        else:
            for p in self.params.tensors.values():
                p.grad = None

    def finish(self) -> None:
        for sync in self.syncs:
            sync.finish()
        sum_shared_grads(self._shared, self.groups)

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(list(self.stepped.values()), self.params.ordered_infos(),
                               max_norm, self.groups)

    def step(self) -> None:
        if self.mp is not None:
            self.mp.step(self.optimizer)
        else:
            self.optimizer.step()

    def fp32_weights(self) -> "OrderedDict[str, torch.Tensor]":
        return OrderedDict((q, p.detach()) for q, p in self.stepped.items())

    def optimizer_state(self) -> OptimState:
        # imported here: autopar.runtime.checkpoint loads torch.distributed.checkpoint
        # (~1 s a process), which a run that never saves or resumes does not need
        from autopar.runtime.checkpoint import optimizer_state_by_key
        return optimizer_state_by_key(self.optimizer, self._by_key())

    def shard_state(self) -> list:
        return [held_range(q, 0, p.numel(), p, self.optimizer.state.get(p, {}), True)
                for q, p in self.stepped.items()]

    def load(self, weights: dict[str, torch.Tensor], optimizer_state: OptimState) -> None:
        with torch.no_grad():
            for q, w in weights.items():
                self.stepped[q].copy_(w)
                self.params.tensors[q].copy_(w)
        if self.mp is not None:
            self.mp.to_compute()
        from autopar.runtime.checkpoint import load_optimizer_state   # DCP: lazily
        load_optimizer_state(self.optimizer, self._by_key(), optimizer_state)

    def shards_loaded(self) -> None:
        if self.mp is not None:            # the bf16 parameters from the loaded masters
            self.mp.to_compute()

    def _by_key(self) -> dict[str, torch.Tensor]:
        return {self.params.infos[q].key: p for q, p in self.stepped.items()}
