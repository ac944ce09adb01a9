"""Where each local parameter tensor sits in the user's single-device model.

`ParamInfo` is the one description the runtime passes to gradient sync, ZeRO, clipping,
`full_state_dict()` and checkpoints: which user state-dict key(s) a local tensor stands for,
the full (unpadded) shape, and which slice of it this rank holds.

Worked example: GPT-2's wte (vocab 50257, hidden 768) under t = 2 with the vocabulary padded
to 50432 (a multiple of 128·t): tensor rank 0 holds padded rows [0, 25216) = real rows
[0, 25216); rank 1 holds padded rows [25216, 50432) = real rows [25216, 50257) followed by
175 padding rows. So rank 1's ParamInfo is split_dim=0, start=25216, stop=50257, and its local
tensor has 25216 rows of which the first stop - start = 25041 are real.

An expert parameter under expert parallelism (passes/expert_parallel.py) is split the same
way, along dim 0 (the experts), but over the expert group instead of the tensor group:
`split_over="expert"`. Mixtral's w1 of 8 experts at ep = 2: expert rank 1 holds experts
[4, 8), split_dim=0, start=4, stop=8; the ranks of one expert-data group hold the same
experts. With t > 1 each expert's FFN is also split over the tensor ranks (passes/sharding/):
replicated_over_tp=False, the tensor split in LocalParams.splits, and checkpoints gather it
over the tensor group first (as a fused q/k/v), keeping the experts' slice.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from autopar.runtime.dist import shared_stages
from autopar.runtime.shard import ParamSplit


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    key: str                       # the user's state-dict key
    aliases: tuple[str, ...] = ()  # other user keys of the same tensor (tied weights)
    global_shape: tuple[int, ...]  # full shape in the single-device model (unpadded)
    split_dim: int | None = None   # tensor-parallel split dimension; None = replicated over t
    start: int = 0                 # this rank's real slice [start, stop) along split_dim
    stop: int = 0
    replicated_over_tp: bool = True   # same values on every tensor rank (count once in norms)
    shared_with: str | None = None    # also held by other pipeline stages, its gradients
    #                                   summed over the "embedding" (first and last stage),
    #                                   the "pipeline" group (every stage) or "stages:1,2"
    #                                   (those stages: ProcessGroups.shared_group)
    # [lo, hi) ranges of the local tensor's flattened elements that every tensor rank holds
    # alike inside a split parameter (the whole k/v rows of a mixed q/k/v projection)
    tp_whole: tuple[tuple[int, int], ...] = ()
    split_over: str = "tensor"        # the group split_dim is split over: "tensor" | "expert"

    @property
    def first_holder(self) -> int:
        """The first pipeline stage holding this tensor (0 unless a shared block is held by
        some later stages only, "stages:1,2" -> 1): the copy clipping counts."""
        return 0 if self.shared_with is None else shared_stages(self.shared_with, 1)[0]

    @property
    def expert(self) -> bool:
        """Experts split over the expert group (the slice differs between its ranks)."""
        return self.split_over == "expert"

    @property
    def tensor_split(self) -> bool:
        """Different values on the tensor ranks (each counts in norms and writes its piece)."""
        return (self.split_dim is not None and not self.expert) or not self.replicated_over_tp

    def real_part(self, local: torch.Tensor) -> torch.Tensor:
        """The rows of `local` that are real (drops vocabulary padding)."""
        if self.split_dim is None:
            return local
        return local.narrow(self.split_dim, 0, self.stop - self.start)

    @property
    def blocked(self) -> bool:
        """A slice of every block of a fused parameter (q, k, v): split over the tensor ranks
        but not as one contiguous range, so norms count it on every rank and checkpoints
        gather it and store it whole."""
        return self.split_dim is None and not self.replicated_over_tp

    def whole(self) -> "ParamInfo":
        """The description of the tensor gathered whole over the tensor group."""
        if self.expert:   # the experts' slice stays; whole over the tensor group
            return dataclasses.replace(self, replicated_over_tp=True)
        return ParamInfo(key=self.key, aliases=self.aliases, global_shape=self.global_shape,
                         shared_with=self.shared_with)

    def global_index(self) -> tuple[slice, ...]:
        """Index of this rank's real slice in the full tensor."""
        idx = [slice(None)] * len(self.global_shape)
        if self.split_dim is not None:
            idx[self.split_dim] = slice(self.start, self.stop)
        return tuple(idx)


def describe_param(*, key: str, aliases: tuple[str, ...], local_shape: tuple[int, ...],
                   global_shape: tuple[int, ...] | None, split: tuple[ParamSplit, int] | None,
                   tp_rank: int, t: int, shared: bool | str,
                   experts: tuple[int, int, int] | None = None) -> ParamInfo:
    """The ParamInfo of a local tensor of `local_shape` on tensor rank `tp_rank` of t.

    split: (ParamSplit, full size along its dim) when the tensor-parallel pass split it, else
    None. global_shape: the single-device shape when known (else derived from the local one).
    Worked example (the module docstring's wte): local (25216, 768), split (ParamSplit(0,
    (50257,), padded=50432), 50257), tp_rank 1 of 2 -> split_dim 0, [25216, 50257).
    experts: (E, start, stop) of an expert parameter spread over the expert group (dim 0);
    when it is also tensor-split (`split`), replicated_over_tp=False and the tensor split is
    LocalParams.splits'. shared: the ParamInfo.shared_with group (True: "embedding").
    Why this size: the facts a ParamInfo records, each given by the pass that knows it.
    """
    shared_with = shared if isinstance(shared, str) else "embedding" if shared else None
    if experts is not None:
        e, start, stop = experts
        if global_shape is None:
            raise ValueError(f"describe_param({key!r}): experts={experts} without global_shape; "
                             f"an expert slice needs the single-device shape: pass global_shape "
                             f"(compile takes it from the captured graph)")
        return ParamInfo(key=key, aliases=aliases, global_shape=global_shape,
                         split_dim=0, start=start, stop=stop, shared_with=shared_with,
                         split_over="expert", replicated_over_tp=split is None)
    if split is None:
        return ParamInfo(key=key, aliases=aliases, global_shape=global_shape or local_shape,
                         shared_with=shared_with)
    ps, full = split
    if global_shape is None:   # the local shape with the split dim at full size
        global_shape = tuple(full if i == ps.dim else n for i, n in enumerate(local_shape))
    if ps.padded:
        n = ps.padded // t
        start, stop = min(tp_rank * n, full), min((tp_rank + 1) * n, full)
    elif len(ps.blocks) == 1:
        start, stop = tp_rank * (full // t), (tp_rank + 1) * (full // t)
    else:  # a slice of every block: not one range (ParamInfo.blocked)
        return ParamInfo(key=key, aliases=aliases, global_shape=global_shape,
                         replicated_over_tp=False, shared_with=shared_with,
                         tp_whole=_flat_ranges(local_shape, ps.dim, ps.whole_ranges(t)))
    return ParamInfo(key=key, aliases=aliases, global_shape=global_shape, split_dim=ps.dim,
                     start=start, stop=stop, replicated_over_tp=False, shared_with=shared_with)


def _flat_ranges(shape: tuple[int, ...], dim: int, rows: list[tuple[int, int]]
                 ) -> tuple[tuple[int, int], ...]:
    """The [lo, hi) ranges of a tensor of `shape`'s flattened elements that hold the rows
    `rows` ((start, length) along `dim`). E.g. (48, 32), dim 0, rows [(16, 8)] ->
    ((512, 768),); (4, 6), dim 1, rows [(2, 1)] -> ((2, 3), (8, 9), (14, 15), (20, 21))."""
    inner = 1
    for n in shape[dim + 1:]:
        inner *= n
    outer = 1
    for n in shape[:dim]:
        outer *= n
    step = shape[dim] * inner
    return tuple((o * step + s * inner, o * step + (s + n) * inner)
                 for o in range(outer) for s, n in rows)


@dataclass(frozen=True, kw_only=True)
class LocalParams:
    """This rank's parameters, each once, and what the runtime needs to know of them. Built
    by autopar.compile from the chunk graphs; read by the optimizer regimes, clipping,
    full_state_dict() and checkpoints.

    tensors: graph name -> parameter, in chunk order (the order of the optimizer's params).
    infos: graph name -> its ParamInfo.
    first_chunk: local chunk -> the names it registers first (each name in one chunk).
    used_by: graph name -> the local chunks whose code reads it (a tied weight: two when the
      first and last chunk share this rank).
    splits: graph name -> (ParamSplit, full size along its dim) of the tensor-split ones.
    """
    tensors: "OrderedDict[str, torch.nn.Parameter]"
    infos: dict[str, ParamInfo]
    first_chunk: dict[int, tuple[str, ...]]
    used_by: dict[str, frozenset[int]]
    splits: dict[str, tuple[ParamSplit, int]]

    @property
    def shared(self) -> list[str]:
        """Names also held by another pipeline stage (tied input/output embeddings, a block
        called at several depths), sorted: every stage sums them in one flat buffer, so all
        must list them in one order (chunk order differs: the first stage registers the
        embedding before a shared block, the last after it)."""
        return sorted(q for q in self.tensors if self.infos[q].shared_with is not None)

    def shared_by_group(self) -> dict[str, list[torch.nn.Parameter]]:
        """The shared tensors by the group their gradients are summed over ("embedding": the
        first and last stage; "pipeline": every stage; "stages:1,2": those stages), each
        list in `shared` order."""
        out: dict[str, list[torch.nn.Parameter]] = {}
        for q in self.shared:
            out.setdefault(self.infos[q].shared_with, []).append(self.tensors[q])
        return out

    def ordered_infos(self) -> list[ParamInfo]:
        return [self.infos[q] for q in self.tensors]

    def in_chunks(self) -> dict[int, set[str]]:
        """Local chunk -> every name its code reads (used_by, inverted)."""
        out: dict[int, set[str]] = {}
        for q, chunks in self.used_by.items():
            for c in chunks:
                out.setdefault(c, set()).add(q)
        return out


@dataclass(frozen=True, kw_only=True)
class StateDictSpec:
    """How the single-device state dict is assembled from the ranks' tensors.

    graph_names: user key -> the graph name of the tensor holding it (tied weights: several
      keys, one name). keys: the user's model's state-dict keys, in its order. fallback:
      copies of the values of the keys no chunk holds (a buffer the captured program never
      reads, a mask a pass replaced, a pooler no loss reaches). The runner keeps these, not the
      user's model (`of_model`).
    """
    graph_names: Mapping[str, str]
    keys: tuple[str, ...]
    fallback: Mapping[str, torch.Tensor]

    @classmethod
    def of_model(cls, model: torch.nn.Module, graph_names: Mapping[str, str],
                 held: set[str]) -> "StateDictSpec":
        """The spec of `model` whose chunks hold the graph names `held` (all chunks')."""
        sd = model.state_dict()
        return cls(graph_names=dict(graph_names), keys=tuple(sd),
                   fallback={k: v.detach().clone() for k, v in sd.items()
                             if graph_names.get(k, k) not in held})

    def assemble(self, merged: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
        """The state dict in the model's key order from {graph name: full tensor}."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key in self.keys:
            name = self.graph_names.get(key, key)
            if name in merged:
                out[key] = merged[name]
            elif key in self.fallback:
                out[key] = self.fallback[key].clone()
            else:
                raise RuntimeError(f"full_state_dict: no rank sent {key!r} (graph attribute "
                                   f"{name!r}), which a chunk holds")
        return out
