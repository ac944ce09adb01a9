"""The optimizer-regime protocol: how one rank's gradients become an optimizer step.

A regime owns everything between the backward passes and the new weights — data-parallel
gradient reduction, the tied-embedding gradient sum, clipping, the optimizer and its state,
and (ZeRO-3) the weight gathers around each chunk's computes — for one ZeRO level:

    regime.zero_grad()                      # before the schedule
    executor.run(...)                       # calls regime.before_action(n, a) before
                                            # actions[n] and regime.after_run() after the last
    regime.finish()                         # gradients complete: reduced over d, tied summed
    regime.clip(max_norm)                   # optional: the single-device global norm
    regime.step()                           # new weights (or shards) in place

and, for full_state_dict() and checkpoints, `fp32_weights()`, `optimizer_state()` and
`load(weights, optimizer_state)` in terms of the local parameters' graph names and the user's
state-dict keys (ParamInfo.key). The implementations: regimes.replicated (zero=0),
regimes.zero1 (zero=1), regimes.zero3 (zero=3). `make_regime` (regimes/__init__.py) picks one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from autopar.runtime.collectives import all_reduce_
from autopar.schedules import Action

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
OptimState = dict[str, dict[str, torch.Tensor]]


def default_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW at lr 3e-4 (what compile() uses when the caller gives no optimizer)."""
    return torch.optim.AdamW(params, lr=3e-4)


class Regime(ABC):
    """One ZeRO level's optimizer step on this rank (see the module docstring)."""

    optimizer: torch.optim.Optimizer

    def before_action(self, n: int, action: Action) -> None:
        """Executor hook before actions[n] (outside the action's recorded interval)."""

    def after_run(self) -> None:
        """Executor hook after the last action, before the step's sends are completed."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget the last step's gradients."""

    @abstractmethod
    def finish(self) -> None:
        """After the schedule: reduce the gradients over the data group (or land their
        reductions) and sum the tied embedding's over the embedding group."""

    @abstractmethod
    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip to the global norm the single-device model would see; return the norm."""

    @abstractmethod
    def step(self) -> None:
        """The optimizer step; the parameters (or shards) hold the new weights after it."""

    @abstractmethod
    def fp32_weights(self) -> "OrderedDict[str, torch.Tensor]":
        """Graph name -> this rank's local weights at full precision (collective where the
        weights or masters are sharded over the data group)."""

    @abstractmethod
    def optimizer_state(self) -> OptimState:
        """{ParamInfo.key: {state name: tensor shaped like the local parameter, or 0-d}}."""

    @abstractmethod
    def load(self, weights: dict[str, torch.Tensor], optimizer_state: OptimState) -> None:
        """Install fp32 weights (by graph name, local shapes) and optimizer state (by key)."""

    def shard_state(self) -> list | None:
        """What this rank holds, as flat ranges of its local parameters with their fp32
        weights and optimizer states (autopar.runtime.ckpt_pieces.Held; views, no
        communication): what a sharded checkpoint writes. None: the regime has no sharded
        form, and checkpoints gather (fp32_weights, optimizer_state)."""
        return None

    def loaded_copies(self) -> list:
        """What a load fills besides `shard_state()`, weights only (Held ranges): tensors the
        regime keeps whole beside its shards (ZeRO-1's local parameters). Default none."""
        return []

    def shards_loaded(self) -> None:
        """A load wrote `shard_state()`'s weights and optimizer state in place
        (autopar.runtime.ckpt_load): refresh what derives from them (the parameters the
        masters are all-gathered or cast into). Collective where that gathers."""
        raise NotImplementedError(f"{type(self).__name__} has no shard_state to load into")

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer-state tensors (Adam's m, v, ...)."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))


def sum_shared_grads(shared: dict[str, Sequence[torch.Tensor]], groups: Any) -> None:
    """Sum the gradients of the weights several pipeline stages hold (`LocalParams.
    shared_by_group`): over the embedding group those of the first and the last stage (tied
    embeddings; a block called at several depths at p = 2), over the pipeline group those
    every stage holds (a block called at every depth, p > 2), over the group of the stages
    that hold one ("stages:0,1,2": a block some stages only call)."""
    for name, params in shared.items():
        sum_tied_grads(params, groups.shared_group(name))


def sum_tied_grads(params: Sequence[torch.Tensor], group: Any) -> None:
    """Sum the gradients of the tied embedding copies held by the first and the last stage
    over the embedding `group` (Megatron's shared embedding all-reduce); fp32 `main_grad`
    where precision keeps one. A copy no micro-batch reached contributes zeros, so both
    stages issue the same collective."""
    if not params:
        return
    grads = [_grad_buffer(p) for p in params]
    flat = all_reduce_(_flatten_dense_tensors(grads), group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def _grad_buffer(p: torch.Tensor) -> torch.Tensor:
    """The tensor p's gradient accumulates in: the fp32 `main_grad` where precision keeps
    one, else .grad (zeros when no micro-batch reached p, so every rank reduces as much)."""
    if hasattr(p, "main_grad"):
        return p.main_grad
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def average_grads(params: Sequence[torch.Tensor], group: Any, size: int) -> None:
    """Average the gradients of `params` over `group` (size ranks) with one flat all-reduce
    (fp32 `main_grad` where precision keeps one, else .grad); a parameter without a gradient
    contributes zeros (every rank issues the same collective)."""
    if not params or size <= 1:
        return
    grads = [_grad_buffer(p) for p in params]
    flat = all_reduce_(_flatten_dense_tensors(grads), group).div_(size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def weight_grad_kind(actions: Sequence[Action]) -> str:
    """The action that accumulates weight gradients: W when the schedule splits backwards
    (zero-bubble lists), else B."""
    return "W" if any(a.kind == "W" for a in actions) else "B"


def final_backwards(actions: Sequence[Action], in_chunk: dict[int, set[str]],
                    params: dict[str, torch.Tensor]) -> dict[tuple[int, int], list]:
    """(chunk, micro-batch) of a weight_grad_kind action -> the parameters whose gradient it
    makes final: those of the chunk whose last such action it is (for a parameter two local
    chunks use, the later of their last ones)."""
    final = weight_grad_kind(actions)
    last: dict[str, tuple[int, int]] = {}
    for a in actions:
        if a.kind == final:
            for q in in_chunk.get(a.chunk, ()):
                last[q] = (a.chunk, a.mb)
    out: dict[tuple[int, int], list] = {}
    for q, at in last.items():
        out.setdefault(at, []).append(params[q])
    return out
