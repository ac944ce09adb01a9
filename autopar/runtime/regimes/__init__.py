"""Optimizer regimes, one per ZeRO level (see base.py for the protocol the Runner calls).

    zero=0  Replicated  every replica holds the optimizer; bucketed all-reduce over d
    zero=1  Zero1       optimizer states + fp32 masters sharded over d (per chunk under
                        breadth-first)
    zero=2  Zero3       the same, each chunk gathered once per step and kept until its last
                        backward (FSDP without resharding after forward)
    zero=3  Zero3       weights, gradients and optimizer states sharded per chunk, at most two
                        chunks gathered at once
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from autopar.runtime.params import LocalParams
from autopar.runtime.regimes.base import OptimizerFactory, Regime, default_optimizer
from autopar.runtime.regimes.replicated import Replicated
from autopar.runtime.regimes.zero1 import Zero1
from autopar.runtime.regimes.zero3 import Zero3
from autopar.schedules import Action

__all__ = ["Regime", "Replicated", "Zero1", "Zero3", "make_regime"]


def make_regime(plan: Any, params: LocalParams, groups: Any, actions: Sequence[Action], *,
                optimizer: OptimizerFactory | None = None,
                compute_dtype: torch.dtype = torch.float32,
                bucket_bytes: int | None = None,
                fp8_weights: frozenset = frozenset()) -> Regime:
    """The regime of plan.zero for this rank (plan.zero and the dtype were checked by
    autopar.compile.check_program). compute_dtype: bf16 for mixed precision (fp32 masters).
    fp8_weights: the graph names of the weights only tensorwise FP8 linears read (ZeRO-2/3
    all-gather them in FP8)."""
    make = optimizer or default_optimizer
    low = compute_dtype if compute_dtype != torch.float32 else None
    if plan.zero == 3:
        return Zero3(params, groups, make, actions, keep=2, precision_dtype=low,
                     fp8_weights=fp8_weights)
    if plan.zero == 2:
        return Zero3(params, groups, make, actions, keep=max(1, len(params.first_chunk)),
                     precision_dtype=low, fp8_weights=fp8_weights)
    if plan.zero == 1:
        return Zero1(params, groups, make, actions,
                     breadth_first=plan.schedule == "breadth-first", precision_dtype=low)
    return Replicated(params, groups, make, actions, precision_dtype=low,
                      bucket_bytes=bucket_bytes)
