"""Global gradient-norm clipping: the norm the single-device model would compute.

Math: ‖g‖² = Σ over the *distinct* elements of the single-device model's gradients. Each
rank sums the squares of the local gradients it is responsible for counting, then one
all-reduce (sum) adds the ranks' partial sums:

- tensor-split parameters (ParamInfo.split_dim set, or replicated_over_tp=False): every tensor
  rank holds a different slice, all count (padding rows excluded via ParamInfo.real_part);
- tensor-replicated parameters: the same values on all t ranks, only tp_rank 0 counts; so
  do the whole rows of a partly split parameter (ParamInfo.tp_whole: multi-query k/v);
- tied / shared embedding copies (ParamInfo.shared_with set): only the first pipeline stage
  that holds one (ParamInfo.first_holder);
- data-parallel replicas hold identical averaged gradients: they are not summed over dp
  (the all-reduce spans the model-parallel group, t·p ranks), unless `dp_sharded=True`
  (ZeRO: each dp rank holds a different part of the flat gradient), then it spans the world;
- experts under expert parallelism (ParamInfo.expert): each rank of an expert group holds
  different experts, the ranks of an expert-data group the same ones, so their squares are
  first summed over the expert group (each expert once), then added to the rest.

Then, exactly like torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped
to 1, and every gradient is multiplied by it (also when it is 1, as torch does).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import group_size
from autopar.runtime.params import ParamInfo


def counts_here(info: ParamInfo, groups: Any) -> bool:
    """Whether this rank adds `info`'s local gradient to the global sum of squares."""
    if groups is None:
        return True
    if not info.tensor_split and groups.tp_rank != 0:
        return False
    if info.shared_with is not None and groups.pp_rank != info.first_holder:
        return False
    return True


def local_sq_sum(grads: Sequence[torch.Tensor | None], param_infos: Sequence[ParamInfo],
                 groups: Any, *, real_parts: bool = True,
                 spans: Sequence[tuple[int, int]] | None = None,
                 experts: bool | None = None) -> torch.Tensor:
    """This rank's share of ‖g‖² in fp32 (a 0-d tensor). spans[i]: grads[i] is the flat
    [lo, hi) piece of its parameter (ZeRO segments); None: whole tensors. experts: only the
    expert parameters' (True), only the others' (False), or all (None)."""
    total = torch.zeros((), dtype=torch.float32)
    for i, (g, info) in enumerate(zip(grads, param_infos)):
        if g is None or not counts_here(info, groups) or experts not in (None, info.expert):
            continue
        if real_parts and info.split_dim is not None:
            g = info.real_part(g)
        sq = g.detach().float().pow(2).reshape(-1)
        if info.tp_whole and groups is not None and groups.tp_rank != 0:
            sq = _without(sq, info.tp_whole, spans[i][0] if spans is not None else 0)
        total += sq.sum().to(total.device)
    return total


def _without(flat: torch.Tensor, ranges: Sequence[tuple[int, int]], lo: int) -> torch.Tensor:
    """`flat` (the parameter's elements from `lo` on) with the elements in `ranges` dropped."""
    return flat[_kept_index(tuple(map(tuple, ranges)), lo, flat.numel(), flat.device)]


_KEPT: dict[tuple, torch.Tensor] = {}


def _kept_index(ranges: tuple[tuple[int, int], ...], lo: int, numel: int,
                device: torch.device) -> torch.Tensor:
    """The indices of [lo, lo + numel) outside `ranges`, shifted to start at 0: built once per
    (ranges, lo, numel, device) — the same every step — and reused (a boolean mask per step
    cost a fill and a scan of the whole parameter)."""
    key = (ranges, lo, numel, str(device))
    idx = _KEPT.get(key)
    if idx is None:
        keep = torch.ones(numel, dtype=torch.bool, device=device)
        for a, b in ranges:
            a, b = max(a - lo, 0), min(b - lo, numel)
            if a < b:
                keep[a:b] = False
        idx = _KEPT[key] = keep.nonzero().reshape(-1)
    return idx


def _norm_group(groups: Any, dp_sharded: bool) -> Any:
    if groups is None:
        return None
    return groups.world if dp_sharded else groups.model_parallel


def clip_grad_norm_(params: Sequence[torch.Tensor], param_infos: Sequence[ParamInfo],
                    max_norm: float, groups: Any, *, dp_sharded: bool = False,
                    real_parts: bool = True,
                    spans: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """Clip the gradients of `params` to the global L2 norm `max_norm`; return the norm.

    params[i] is the local tensor described by param_infos[i] (its .grad is read; for ZeRO
    pass the shard segments with their owner's ParamInfo, dp_sharded=True, real_parts=False
    since a segment is a flat piece, not rows, and `spans`: each segment's flat [lo, hi) in its
    parameter). groups: a ProcessGroups (None = one process).
    Collective over groups.model_parallel (or groups.world when dp_sharded): all ranks call.
    """
    params = list(params)
    infos = list(param_infos)
    if len(params) != len(infos):
        raise ValueError(f"clip_grad_norm_: {len(params)} params but {len(infos)} ParamInfos; "
                         f"pass one ParamInfo per local parameter, in the same order")
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r}: must be > 0")
    grads = [p.grad for p in params]
    expert_group = getattr(groups, "expert", None)
    if group_size(expert_group) > 1 and not dp_sharded:   # each expert once: over its group
        total_sq = local_sq_sum(grads, infos, groups, real_parts=real_parts, spans=spans,
                                 experts=False)
        expert_sq = local_sq_sum(grads, infos, groups, real_parts=real_parts, spans=spans,
                                 experts=True)
        dist.all_reduce(expert_sq, group=expert_group)
        total_sq += expert_sq
    else:
        total_sq = local_sq_sum(grads, infos, groups, real_parts=real_parts, spans=spans)
    group = _norm_group(groups, dp_sharded)
    if group_size(group) > 1:
        dist.all_reduce(total_sq, group=group)
    total_norm = total_sq.sqrt()
    clip_coef = float(max_norm) / (total_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    for g in grads:
        if g is not None:
            g.detach().mul_(clip_coef_clamped.to(g.device, g.dtype))
    return total_norm
