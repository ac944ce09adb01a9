"""zero=1: optimizer states and fp32 master weights sharded over the data group.

The mechanism is autopar.runtime.zero.ZeroOptimizer (one flat buffer, dp rank r steps its
1/d; reduce-scatter of the gradients, all-gather of the new weights). This regime wires it
into a step:

- depth-first schedules (gpipe, 1f1b, interleaved): one ZeroOptimizer over all local
  parameters, reduce-scattered after the schedule;
- breadth-first: one ZeroOptimizer shard per chunk (`ChunkedZero`), each reduce-scattered at
  the schedule's REDUCE R{c}, right after the chunk's last backward, so it overlaps the
  backward of the chunks below it — the per-chunk reduction of layered gradient accumulation
  (2106.02679 §4). Chunks holding a tied weight are reduced after the schedule instead: their
  full gradient must first be summed over the embedding group.

Expert parallelism: the experts' flat shard is a part of its own, sharded and reduce-scattered
over the expert-data group (c·d/ep ranks, the ones holding the same experts) and divided by
c·d (see autopar.runtime.data_parallel); under breadth-first each chunk has up to two parts.
One optimizer steps every part's masters.

Under bf16 MixedPrecision keeps only the fp32 `main_grad` (no masters): the masters live in
the shards.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch

from autopar.runtime.ckpt_pieces import held_range
from autopar.runtime.flat_shard import held_segments
from autopar.runtime.clip import clip_grad_norm_
from autopar.runtime.params import LocalParams
from autopar.runtime.precision import MixedPrecision
from autopar.runtime.regimes.base import OptimizerFactory, OptimState, Regime, sum_shared_grads
from autopar.runtime.zero import ZeroOptimizer
from autopar.schedules import Action


class ChunkedZero:
    """ZeRO-1 in parts: one ZeroOptimizer flat shard per part (a chunk under breadth-first, the
    dense and the expert parameters under expert parallelism), all stepped by one optimizer
    (module doc). Same interface as ZeroOptimizer (what the regime calls); parameters are
    concatenated in part order. A part is (params, infos, tied, group, divide_by)."""

    def __init__(self, chunks: list[tuple[list, list, bool, Any, int | None]],
                 make: OptimizerFactory):
        self.parts = [ZeroOptimizer(ps, infos, lambda _masters: None, group, divide_by=div)
                      for ps, infos, _tied, group, div in chunks]
        self._deferred = {i for i, (_ps, _infos, tied, *_) in enumerate(chunks) if tied}
        self.optimizer = make([m for part in self.parts for m in part.master])
        for part in self.parts:
            part.optimizer = self.optimizer
        self._reduced: set[int] = set()

    def bind_main_grads(self) -> None:
        for part in self.parts:
            part.bind_main_grads()

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
        self.reduce_grads()
        masters = [m for part in self.parts for m in part.master]
        infos = [part.param_infos[s.param] for part in self.parts for s in part.segments]
        spans = [(s.lo, s.hi) for part in self.parts for s in part.segments]
        return clip_grad_norm_(masters, infos, max_norm, groups, dp_sharded=True,
                               real_parts=False, spans=spans)

    @torch.no_grad()
    def step(self) -> None:
        self.reduce_grads()
        self.optimizer.step()
        for part in self.parts:
            part.publish()
        self._reduced.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)
        self._reduced.clear()

    def gathered_masters(self) -> list[torch.Tensor]:
        return [w for part in self.parts for w in part.gathered_masters()]

    def load_masters(self, weights: Sequence[torch.Tensor]) -> None:
        weights = list(weights)
        for part in self.parts:
            part.load_masters(weights[:len(part.params)])
            weights = weights[len(part.params):]

    def gathered_state(self) -> OptimState:
        out: OptimState = {}
        for part in self.parts:
            out.update(part.gathered_state())
        return out

    def load_gathered_state(self, state: OptimState) -> None:
        for part in self.parts:
            part.load_gathered_state(state)


class Zero1(Regime):
    """zero=1 on this rank (module doc)."""

    def __init__(self, params: LocalParams, groups: Any, make: OptimizerFactory,
                 actions: Sequence[Action], *, breadth_first: bool,
                 precision_dtype: torch.dtype | None = None):
        self.params, self.groups = params, groups
        tensors = list(params.tensors.values())
        shared = set(params.shared)
        self.zero: ZeroOptimizer | ChunkedZero
        self._chunk_index: dict[int, list[int]] = {}   # chunk -> its parts (breadth-first)
        experts = {q for q, info in params.infos.items() if info.expert}
        if breadth_first or experts:
            groups_of = {False: (groups.data, None), True: (groups.expert_data, groups.d)}
            blocks = ([qs for _, qs in sorted(params.first_chunk.items()) if qs]
                      if breadth_first else [list(params.tensors)])
            chunks = [c for c, qs in sorted(params.first_chunk.items()) if qs]
            parts, self.order = [], []
            for i, qs in enumerate(blocks):
                for expert in (False, True):
                    mine = [q for q in qs if (q in experts) == expert]
                    if not mine:
                        continue
                    if breadth_first:
                        self._chunk_index.setdefault(chunks[i], []).append(len(parts))
                    parts.append(([params.tensors[q] for q in mine],
                                  [params.infos[q] for q in mine],
                                  any(q in shared for q in qs), *groups_of[expert]))
                    self.order += mine
            self.zero = ChunkedZero(parts, make)
        else:
            self.order = list(params.tensors)
            self.zero = ZeroOptimizer(tensors, params.ordered_infos(), make, groups.data)
        # after the shards took their fp32 masters from the fp32 weights
        self.mp = (MixedPrecision(tensors, compute_dtype=precision_dtype, master_weights=False)
                   if precision_dtype is not None else None)
        self.zero.bind_main_grads()   # main_grad accumulates in the flat buffers
        self.optimizer = self.zero.optimizer
        self._shared = params.shared_by_group()

    def before_action(self, n: int, action: Action) -> None:
        if action.kind == "REDUCE" and action.chunk in self._chunk_index:
            for i in self._chunk_index[action.chunk]:
                self.zero.reduce_chunk(i)

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def finish(self) -> None:
        sum_shared_grads(self._shared, self.groups)
        self.zero.reduce_grads()

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.zero.clip_grad_norm_(max_norm, self.groups)

    def step(self) -> None:
        self.zero.step()
        self.zero.zero_grad()

    def fp32_weights(self) -> "OrderedDict[str, torch.Tensor]":
        if self.mp is not None:     # the fp32 values are the masters, sharded over d
            masters = dict(zip(self.order, self.zero.gathered_masters()))
            return OrderedDict((q, masters[q]) for q in self.params.tensors)
        return OrderedDict((q, p.detach()) for q, p in self.params.tensors.items())

    def optimizer_state(self) -> OptimState:
        return self.zero.gathered_state()

    def shard_state(self) -> list:
        """My master segments and their optimizer state (views; parts in `order`)."""
        parts = self.zero.parts if isinstance(self.zero, ChunkedZero) else [self.zero]
        out, names = [], iter(self.order)
        for part in parts:
            mine = [next(names) for _ in part.params]
            out += held_segments(part.layout, part.master, self.optimizer, mine)
        return out

    def loaded_copies(self) -> list:
        """The local parameters, whole: a load reads them too (each rank's own weights) rather
        than all-gathering the loaded masters, which would hold d× the weight shard at once."""
        return [held_range(q, 0, p.numel(), p, {}, True) for q, p in self.params.tensors.items()]

    def shards_loaded(self) -> None:
        """Nothing derives from the masters: the parameters were read too (loaded_copies)."""

    def load(self, weights: dict[str, torch.Tensor], optimizer_state: OptimState) -> None:
        with torch.no_grad():
            for q, w in weights.items():
                self.params.tensors[q].copy_(w)
        self.zero.load_masters([weights[q] for q in self.order])
        if optimizer_state:
            self.zero.load_gathered_state(optimizer_state)
