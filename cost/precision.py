"""Precision priced beyond the GEMM rate: the FP8 weights sharded-weight plans gather in 8 bits.

Under FP8 (tensorwise: what the planner's "fp8" prices) with sharded weights (zero 2 / 3), the
runtime (autopar/runtime/zero3_chunks.py Fp8Gather; torchao's FSDP2 float8 all-gather, torchtitan's
`--float8.enable_fsdp_float8_all_gather`, on in its published Float8 runs) casts each shard of a
weight that only FP8 GEMMs read to e4m3 and all-gathers 1 byte per element where bf16 moves 2;
the gathered copy the chunk computes from is that 1-byte tensor. So a block's gather traffic and
its gathered working set are (2 − f)/2 of bf16's, f the fraction of the block's parameters on a
tensor rank that are FP8 GEMM weights: the weight GEMMs cost/model.py prices at the FP8 rate
(cost/compute.py local_gemm_time_s: passes/fp8.py's rule, local n and k >= 16). The amax all-reduce of a
gather (one fp32 per weight) is latency only: not priced. The embedding and head stay 16-bit.
"""
from __future__ import annotations

from autopar.cost.profile import ModelProfile

BF16_BYTES = 2      # a gathered 16-bit weight element
FP8_BYTES = 1       # a gathered e4m3 weight element


def fp8_weight_elems(profile: ModelProfile, t: int) -> float:
    """Elements of a block's FP8 GEMM weights on one tensor rank (the split ones 1/t)."""
    total = 0.0
    for g in profile.block.gemms:
        if not g.has_weight_grad or g.batch_scales:
            continue
        n, k = g.n / (t if g.tp_split == "n" else 1), g.k / (t if g.tp_split == "k" else 1)
        if min(n, k) >= 16:
            total += g.batch * n * k / (t if g.tp_split == "batch" else 1)
    return total


def gathered_bytes_ratio(profile: ModelProfile, t: int, block_elems: float,
                         sharded: bool) -> float:
    """A block's gathered bytes (traffic and working set) over bf16's: (2 − f)/2 with f its
    FP8 weights' share of block_elems (its parameters on a tensor rank) when `sharded` weights
    are gathered under tensorwise FP8; 1 otherwise (rowwise FP8 gathers in bf16:
    `ModelProfile.fp8_gathers`)."""
    if (not sharded or profile.gemm_precision != "fp8" or not profile.fp8_gathers
            or block_elems <= 0):
        return 1.0
    f = min(1.0, fp8_weight_elems(profile, t) / block_elems)
    return (BF16_BYTES - f * (BF16_BYTES - FP8_BYTES)) / BF16_BYTES


def weight_elem_bytes(profile: ModelProfile) -> int:
    """Bytes of a weight as the run holds it: 4 in an fp32 run (the profile's activations in
    4 bytes: `ModelProfile.with_training_bytes`), else 2 (16-bit with fp32 masters)."""
    return 4 if profile.activation_bytes_per_elem >= 4 else 2
