"""FP8 linear layers: the three GEMMs of a linear (forward, input gradient, weight gradient) as
scaled FP8 matmuls (`torch._scaled_mm`, which runs on CPU too), with dynamic scaling.

Recipes (torchao.float8's, Float8LinearRecipeName; Micikevicius et al. 2209.05433):
  "tensorwise"  one scale per tensor, scale = fp8_max / amax(|x|); input and weight in e4m3,
                the output gradient in e5m2 (its wider range); torchao's default.
  "rowwise"     one scale per row along each GEMM's reduction dimension (torchao's AXISWISE),
                every operand in e4m3, scales rounded down to a power of two.
A GEMM C = A·Bᵀ (A: M×K, B: N×K) casts A and B to FP8, runs `_scaled_mm(A8, B8ᵀ, 1/sA, 1/sB)`
and returns C in the input's dtype (bf16). The backward recasts the saved bf16 input and
weight (rowwise needs other axes than the forward's): dX = dY·W, dW = dYᵀ·X.

Across ranks (a split run equals the unsplit one), each amax is MAX-reduced over every group
that holds parts of its tensor. A tensorwise amax: over the tensor group for every operand (an
operand split over the group gets the whole tensor's amax; a replicated one the same value
everywhere), and over the context group for the operands with tokens (the input and the
output gradient: each context rank holds T/c of the sequence). A rowwise amax runs along the
reduction dimension, so it is reduced only where that dimension is split, i.e. where the GEMM
is a partial sum: the tensor group for `partial_fwd` (the forward of a row-parallel linear, its
input and weight split along K) and `partial_dx` (the input gradient of a column-parallel one,
split along N), the context group for the weight gradient (its reduction runs over the
tokens); elsewhere each rank's rows are its own. Data-parallel replicas and pipeline stages
hold different tensors, not parts of one: no reduction (ZeRO-3 gathers the whole weight first,
or casts its shards with the weight's all-reduced amax: `fp8_shard_cast`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import all_gather_sp, copy_to_tp, group_size

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_EPS = 1e-12      # torchao.float8's EPS: an all-zero tensor gets a finite scale
FP8_WEIGHT = "autopar_fp8_weight"   # a parameter's (W in e4m3, inverse scale) while gathered


@dataclass(frozen=True, kw_only=True)
class Fp8Recipe:
    """How one linear's operands are cast (module docstring)."""
    rowwise: bool
    grad_dtype: torch.dtype
    pow2_scales: bool


RECIPES = {"tensorwise": Fp8Recipe(rowwise=False, grad_dtype=E5M2, pow2_scales=False),
           "rowwise": Fp8Recipe(rowwise=True, grad_dtype=E4M3, pow2_scales=True)}


def _amax(x: torch.Tensor, rowwise: bool, groups: tuple) -> torch.Tensor:
    """max |x| (fp32): of the tensor, or per row (M×1) when rowwise; MAX over each of
    `groups` (None or size-1 groups skipped)."""
    a = (x.abs().amax(dim=1, keepdim=True) if rowwise else x.abs().amax()).float()
    for group in groups:
        if group is not None and group_size(group) > 1:
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def _cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype,
          pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in `dtype` scaled to fill its range, the fp32 inverse scale _scaled_mm takes)."""
    fmax = torch.finfo(dtype).max
    scale = _scale(amax, dtype, pow2)
    x8 = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    return x8, scale.reciprocal()


def _scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """What x is multiplied by before its cast to `dtype`: its range over amax."""
    scale = torch.finfo(dtype).max / amax.clamp(min=AMAX_EPS)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def scaled_gemm(a: torch.Tensor, b: torch.Tensor | tuple, a_dtype: torch.dtype,
                b_dtype: torch.dtype, recipe: Fp8Recipe, a_groups: tuple = (),
                b_groups: tuple = ()) -> torch.Tensor:
    """a·bᵀ (a: M×K, b: N×K, 2-D) as a scaled FP8 matmul in a's dtype (module docstring);
    a_groups / b_groups: the groups each operand's amax is MAX-reduced over. b may come cast
    already: (b in FP8, its inverse scale), as a ZeRO-3 FP8 gather leaves a weight."""
    a8, sa = _cast(a, _amax(a, recipe.rowwise, a_groups), a_dtype, recipe.pow2_scales)
    b8, sb = b if isinstance(b, tuple) else _cast(b, _amax(b, recipe.rowwise, b_groups),
                                                  b_dtype, recipe.pow2_scales)
    if recipe.rowwise:
        sb = sb.t()                    # (1, N): one scale per column of bᵀ
        if a8.device.type == "cpu" and not _cpu_takes_rowwise_scales():
            one = torch.ones((), device=a8.device)
            c = torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            return (c * sa * sb).to(a.dtype)
    return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=a.dtype)


@functools.cache
def _cpu_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes a scale per row (2.13 does; 2.11's takes
    one per operand, and a rowwise GEMM there is the unscaled product scaled after, in fp32:
    the same C = diag(sA)·(A8·B8ᵀ)·diag(sB))."""
    a = torch.zeros(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _groups(r: Fp8Recipe, tp: Any, cp: Any, partial_fwd: bool,
            partial_dx: bool) -> dict[str, tuple[tuple, tuple]]:
    """{GEMM: (its first operand's amax groups, its second's)} (module docstring): "y" = x·Wᵀ,
    "dx" = dY·W, "dw" = dYᵀ·X."""
    if not r.rowwise:
        return {"y": ((tp, cp), (tp,)), "dx": ((tp, cp), (tp,)), "dw": ((tp, cp), (tp, cp))}
    fwd, dx = ((tp,) if partial_fwd else ()), ((tp,) if partial_dx else ())
    return {"y": (fwd, fwd), "dx": (dx, dx), "dw": ((cp,), (cp,))}


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, recipe, group, partial_fwd, partial_dx, context, w8):
        """x @ w.T in FP8 under `recipe`. Why this size: autograd.Function.apply takes the
        operands and every fact the backward needs (the amax groups, the partial sums, the
        context group, a weight already gathered in FP8) positionally."""
        r = RECIPES[recipe]
        cp = context.group if context is not None and context.c > 1 else None
        ctx.r, ctx.groups = r, _groups(r, group, cp, partial_fwd, partial_dx)
        ctx.w8 = w8       # (W in e4m3, its inverse scale): gathered so, w's bytes are unread
        x2 = x.reshape(-1, x.shape[-1])
        y = scaled_gemm(x2, w if w8 is None else w8, E4M3, E4M3, r, *ctx.groups["y"])
        ctx.save_for_backward(x, w)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        r, groups = ctx.r, ctx.groups
        g2 = gy.reshape(-1, gy.shape[-1]).to(x.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:      # dX = dY·W: reduction over N
            wt = (w.t().contiguous() if ctx.w8 is None      # tensorwise: cast(Wᵀ) = cast(W)ᵀ
                  else (ctx.w8[0].t().contiguous(), ctx.w8[1]))
            dx = scaled_gemm(g2, wt, r.grad_dtype, E4M3, r, *groups["dx"]).reshape(x.shape)
        if ctx.needs_input_grad[1]:      # dW = dYᵀ·X: reduction over the tokens
            x2 = x.reshape(-1, x.shape[-1])
            dw = scaled_gemm(g2.t().contiguous(), x2.t().contiguous(), r.grad_dtype, E4M3, r,
                             *groups["dw"]).to(w.dtype)
        return dx, dw, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, recipe: str,
               group: Any = None, partial_fwd: bool = False,
               partial_dx: bool = False, context: Any = None) -> torch.Tensor:
    """x·Wᵀ + b (aten.linear) with its three GEMMs in FP8 under `recipe` (RECIPES); group:
    the tensor group (None at t = 1); partial_fwd / partial_dx: the forward / input-gradient
    GEMM is a partial sum over the group (row- / column-parallel); context: this rank's
    ContextShard (None without context parallelism: its group holds the other tokens). A
    weight a ZeRO-3 FP8 gather cast (its FP8_WEIGHT attribute, tensorwise only) is used as
    cast."""
    w8 = getattr(w, FP8_WEIGHT, None) if recipe == "tensorwise" else None
    y = _Fp8Linear.apply(x, w, recipe, group, partial_fwd, partial_dx, context, w8)
    return y if b is None else y + b


def fp8_column_parallel(x: torch.Tensor, group: Any, layouts: tuple[str, ...], weights: tuple,
                        biases: tuple, sp_dim: int | None, recipe: str,
                        context: Any = None) -> tuple:
    """collectives.column_parallel with FP8 projections: f (or SP's all-gather), then
    fp8_linear per weight, each input gradient a partial sum over the group."""
    full = copy_to_tp(x, group) if sp_dim is None else all_gather_sp(x, group, sp_dim)
    return tuple(fp8_linear(full, w, b, recipe, group, False, True, context)
                 for w, b in zip(weights, biases))


def fp8_shard_cast(shard: torch.Tensor, segments: Sequence[Any], num_params: int,
                   groups: Sequence[Any], amax: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ZeRO-3 shard (S,) of bf16 weights cast to e4m3 for an FP8 all-gather (torchao's
    FSDP2 float8 all-gather, tensorwise): each weight's amax is the MAX of its segments'
    (flat_shard.Segment: param, lo, hi, shard_lo) over `groups` (the data group its shards lie
    in, the tensor group its splits lie in), so the bytes each rank casts are those
    fp8_linear casts from the whole weight. amax: the (num_params,) amaxes of an earlier call
    (the weights are unchanged), reused. Returns (the e4m3 shard, the amaxes, the inverse
    scales); padding stays 0."""
    if amax is None:
        amax = torch.zeros(num_params, dtype=torch.float32, device=shard.device)
        for s in segments:
            piece = shard[s.shard_lo:s.shard_lo + s.hi - s.lo]
            amax[s.param] = torch.maximum(amax[s.param], _amax(piece, False, ()))
        for group in groups:
            if group is not None and group_size(group) > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    out = torch.zeros(shard.shape, dtype=E4M3, device=shard.device)
    for s in segments:
        lo, hi = s.shard_lo, s.shard_lo + s.hi - s.lo
        out[lo:hi] = _cast(shard[lo:hi], amax[s.param], E4M3, False)[0]
    return out, amax, _scale(amax, E4M3, False).reciprocal()
