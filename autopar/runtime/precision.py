"""bf16 mixed precision: bf16 compute, fp32 master weights, fp32 gradient accumulation.

Math (Micikevicius et al. 1710.03740; Megatron's `main_grad`): the model's parameters hold
w16 = bf16(w32) for the forward/backward; each micro-batch's bf16 gradient is added into an
fp32 buffer `main_grad` (so m micro-batches do not lose low bits in bf16 sums); the optimizer
steps the fp32 masters w32 with main_grad, and w16 = bf16(w32) again. bf16 has fp32's
exponent range, so no loss scaling is needed. Works on CPU (bf16 matmul is supported).

    mp = MixedPrecision(params)                        # casts params to bf16, keeps fp32 masters
    opt = torch.optim.AdamW(mp.master_params, ...)     # the optimizer sees fp32 masters
    sync = GradSync(params, pg.data)                   # after mp: reduces p.main_grad (fp32)
    for each micro-batch: loss(model(x)).backward()    # the hook folds .grad into main_grad
    sync.finish(); clip_grad_norm_(mp.master_params, infos, ...)
    mp.step(opt)                                       # step, copy masters -> bf16, zero grads

With ZeRO-1 the masters live in the shard: MixedPrecision(params, master_weights=False) only
keeps main_grad, and ZeroOptimizer reads p.main_grad and owns the fp32 master shard.

A gradient's home: `grad_of` (main_grad where precision keeps one, else .grad), and the two
moves a flat gradient buffer makes to become that home (GradSync's buckets, ZeroOptimizer's
flat buffer): `home_main_grad` (main_grad becomes its slot) and `adopt_grad` (a fresh .grad
moves into its slot, then accumulates there).
"""
from __future__ import annotations

from typing import Sequence

import torch


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The tensor p's gradient accumulates in: its fp32 main_grad where precision keeps one,
    else .grad."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def home_main_grad(p: torch.Tensor, home: torch.Tensor) -> None:
    """p's main_grad becomes `home`, its slot in a flat gradient buffer, keeping its value."""
    home.copy_(p.main_grad)
    p.main_grad = home


def adopt_grad(p: torch.Tensor, home: torch.Tensor) -> None:
    """After autograd accumulated p's .grad (a post-accumulate-grad hook): a fresh .grad of
    home's dtype moves into `home`, its slot in a flat gradient buffer, where the next
    accumulations go in place; one with a main_grad is precision's to fold (into a slot)."""
    if hasattr(p, "main_grad") or p.grad is None or p.grad.dtype != home.dtype:
        return
    if p.grad.data_ptr() != home.data_ptr():
        with torch.no_grad():
            home.copy_(p.grad)
        p.grad = home


class MixedPrecision:
    """fp32 masters and fp32 `main_grad` accumulation for parameters computed in bf16."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *,
                 compute_dtype: torch.dtype = torch.bfloat16, master_weights: bool = True,
                 accumulate_in_hook: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.compute_dtype = compute_dtype
        self.master_params: list[torch.nn.Parameter] = []
        with torch.no_grad():
            for p in self.params:
                if master_weights:
                    self.master_params.append(torch.nn.Parameter(p.detach().float().clone()))
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        for m, p in zip(self.master_params, self.params):
            m.grad = p.main_grad          # the optimizer reads the fp32 accumulation directly
        self.to_compute()
        if accumulate_in_hook:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._fold)

    def to_compute(self) -> None:
        """Parameters := compute_dtype(masters) (or just cast them when there are no masters)."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                src = self.master_params[i] if self.master_params else p.data
                p.data = src.detach().to(self.compute_dtype)

    @staticmethod
    def _fold(p: torch.Tensor) -> None:
        with torch.no_grad():
            p.main_grad.add_(p.grad.float())
        p.grad = None

    def accumulate(self) -> None:
        """Fold any bf16 .grad left on the parameters into main_grad (needed only when
        accumulate_in_hook=False: then call it after every micro-batch's backward)."""
        for p in self.params:
            if p.grad is not None:
                self._fold(p)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step on the fp32 masters, refresh the bf16 parameters, zero main_grad."""
        self.accumulate()
        self.point_masters()
        optimizer.step()
        self.to_compute()
        self.zero_grad()

    def point_masters(self) -> None:
        """Each master's .grad := its parameter's main_grad, wherever that lives now (a
        GradSync bucket slot once the sync is made: autopar.runtime.data_parallel)."""
        for m, p in zip(self.master_params, self.params):
            m.grad = p.main_grad

    def zero_grad(self) -> None:
        self.point_masters()
        for p in self.params:
            p.main_grad.zero_()
            p.grad = None
