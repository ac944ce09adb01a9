"""Cluster specifications: peak compute, memory, HBM and link bandwidths, with sources.

A `Cluster` is the hardware half of the cost model (the model half is `ModelProfile`). Every
constant carries a source in `Cluster.sources`: a datasheet, a paper, or "fitted" with the
calibration set it was fitted to (`tests/passes/test_calibration.py`, published-results.md).

Bandwidths are per GPU and per direction (what one GPU can push while it also receives), in
bytes per second. Intra-node: NVLink/NVSwitch. Inter-node: the GPU's share of the node's
InfiniBand NICs (Megatron clusters have one NIC per GPU, so a ring that leaves the node runs at
one NIC's rate per GPU).

The matmul-efficiency model (used by `cost.model.gemm_time_s`):
    time = max(flops / (peak · e_max · f(m)·f(n)·f(k)),  bytes / hbm_bandwidth) + launch
    f(x) = x / (x + gemm_half_dim)
e_max is the fraction of the datasheet peak that cuBLAS sustains on large 16-bit GEMMs;
gemm_half_dim is the GEMM dimension at which that dimension alone halves efficiency (tile
quantisation and too few waves/too little reuse on small dimensions). The roofline term makes
skinny GEMMs memory bound.

The attention kernel is part of the hardware model (`attention`): "flash" (every GPU stack since
2022: FlashAttention-2/3, cuDNN, PyTorch SDPA on CUDA) runs each scaled-dot-product-attention
call as one fused kernel, saves O(s) per head (q, k, v, output, logsumexp) and never writes the
s×s scores; "materialized" (the unfused kernels of 2104.04473 / 2205.05198) saves the scores,
softmax and dropout mask and streams them through HBM. Under "flash" (`cost.model`):
    forward  = fwd_flops · active / (peak · flash_fwd_efficiency · g(L, D))
    backward = 2.5 · fwd_flops · active / (peak · flash_bwd_efficiency · g(L, D))
    g(L, D)  = L/(L + flash_half_len) · D/(D + flash_half_head_dim)
fwd_flops = 4·heads·q_len·kv_len·head_dim, `active` the tiles a causal or block mask leaves
(FlashAttention's skip), 2.5 the backward's five GEMMs (the scores recomputed) against the
forward's two, L the key length (short sequences leave the per-block softmax and epilogue
work exposed), D the head dim (a tile of keys loaded does D multiply-adds per score: small
heads leave the softmax and the loads exposed; FlashAttention-2 and -3, 2307.08691 Fig. 4-7 and
2407.08608 Fig. 5, run head dim 64 slower than 128 and 128 than 256). The presets'
flash_half_head_dim is 0 (not modelled: their efficiencies were fitted to runs of head dim
128-160); `autopar calibrate` fits it to SDPA timed at several head dims.
"""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from autopar.cost.profile import ATTENTION_KINDS, ELEMENTWISE_KINDS

GB = 1e9
GIB = 1024 ** 3
# send_recv: two ranks exchange messages at once (both isend + irecv, then wait: ring
# attention's step); hop: one rank's message to a peer blocked on a pre-posted irecv (a
# pipeline's hop, `autopar calibrate` times it as a relay), priced apart where measured
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv",
                    "hop")
LINKS = ("intra", "inter")


@dataclass(frozen=True, kw_only=True)
class CollectiveCurve:
    """One collective's measured time against message size on one link and group size
    (`autopar calibrate`): `seconds[i]` for a message of `bytes[i]` (the whole, as cost/comm.py
    counts it), sizes ascending. cost/comm.py prices a call of that kind, link and group size
    from the curve (linear between points, the smallest point's time below it, the last
    segment's slope above it) instead of latency + bytes / bandwidth: a stack whose time is
    not affine in the size (gloo switches algorithms by size) is priced as measured."""
    link: str
    kind: str
    ranks: int
    bytes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.link not in LINKS or self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"CollectiveCurve link={self.link!r}, kind={self.kind!r}: link must "
                             f"be one of {LINKS} and kind one of {COLLECTIVE_KINDS}")
        if (self.ranks < 2 or not self.bytes or len(self.bytes) != len(self.seconds)
                or list(self.bytes) != sorted(set(self.bytes))
                or min(self.seconds) <= 0 or min(self.bytes) <= 0):
            raise ValueError(f"CollectiveCurve {self.link} {self.kind}: ranks={self.ranks}, "
                             f"bytes={list(self.bytes)}, seconds={list(self.seconds)}: needs "
                             f"ranks >= 2 and as many positive seconds as strictly ascending "
                             f"positive sizes; write it with `autopar calibrate`")

    def time_s(self, nbytes: float) -> float:
        """Seconds for a message of nbytes (see the class doc)."""
        xs, ys = self.bytes, self.seconds
        if nbytes <= xs[0] or len(xs) == 1:
            return ys[0] if nbytes <= xs[0] else ys[0] * nbytes / xs[0]
        i = next((j for j in range(1, len(xs)) if nbytes <= xs[j]), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[i - 1] + slope * (nbytes - xs[i - 1]), min(ys))


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """One homogeneous GPU cluster: `gpus_per_node` GPUs per node, all numbers per GPU."""
    name: str
    gpus_per_node: int
    peak_flops: float                 # dense 16-bit FLOP/s per GPU (datasheet)
    memory_bytes: float               # HBM capacity per GPU
    hbm_bandwidth_Bps: float          # HBM bandwidth per GPU
    intra_node_bandwidth_Bps: float   # per GPU, one direction, achievable by collectives
    intra_node_latency_s: float
    inter_node_bandwidth_Bps: float   # per GPU, one direction, achievable by collectives
    inter_node_latency_s: float
    gemm_max_efficiency: float        # e_max: achieved / peak on large GEMMs
    gemm_half_dim: float              # f(x) = x / (x + gemm_half_dim)
    kernel_launch_s: float = 5e-6     # per GEMM / fused-kernel group launch overhead
    elementwise_efficiency: float = 0.8  # achieved / datasheet HBM bandwidth on streaming ops
    reserved_bytes: float = 0.0       # CUDA context, cuBLAS/NCCL workspaces, fragmentation
    # the attention kernel ("flash" | "materialized") and, for "flash", its achieved / peak
    # FLOP rate on long sequences forward and backward, and the key length that halves it
    attention: str = "flash"
    flash_fwd_efficiency: float = 0.74
    flash_bwd_efficiency: float = 0.64
    flash_half_len: float = 224.0
    # and the head dim that halves it (D/(D + flash_half_head_dim), the module doc); 0: not
    # modelled (the presets), fitted by `autopar calibrate`
    flash_half_head_dim: float = 0.0
    # how elementwise ops run: "fused" (chains as single kernels keeping no intermediates:
    # Megatron-LM's fused kernels, torch.compile; what the calibrated runs used) or "eager"
    # (op by op, every saved tensor kept: PyTorch without a compiler, autopar's runtime today)
    elementwise: str = "fused"
    # whether the stack pipelines tensor-parallel collectives with their GEMMs (collective
    # matmul forward, the input-gradient reduction under dW backward: autopar's runtime,
    # passes/overlap.py; Megatron-Core --tp-comm-overlap); priced by cost/overlap.py. False in
    # the presets: the runs they are calibrated on exposed TP communication
    tp_overlap: bool = False
    # where tp_overlap: the fraction of a TP collective pipelined with its GEMM that costs
    # nothing; the rest still costs its time (the collective's kernels take SMs and HBM
    # bandwidth from the GEMM; cost/overlap.py). Fitted to torchtitan's Llama 3 70B on 256
    # H100 (FSDP 32 x TP 8, bf16, 2025-06: async TP 652.4 vs vanilla 597.3 tokens/s/GPU; 0.53
    # before its attention was priced at FlashAttention-2's rates, FLASH2_H100,
    # pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md; not fitted:
    # its 8B on 64 H100, tests/passes/test_tp_overlap_calibration.py); measured by
    # `autopar calibrate` (as comm_overlap) on a calibrated cluster
    tp_comm_overlap: float = 0.49
    # the calls a row-parallel GEMM's forward reduction is issued as: autopar's runtime's
    # collective matmul (runtime.collectives.ROW_CHUNKS, cost/overlap.py ROW_PIECES) on a
    # cluster `autopar calibrate` measured; 1 in the presets (the Megatron-LM runs they are
    # calibrated on reduced each output once)
    tp_row_pieces: int = 1
    # FP8 GEMMs (precision "fp8", passes/fp8.py): dense FP8 FLOP/s per GPU (datasheet; 0: the
    # GPU has no FP8 tensor cores) and their achieved / peak on large GEMMs (0: as the 16-bit
    # gemm_max_efficiency)
    fp8_flops: float = 0.0
    fp8_gemm_max_efficiency: float = 0.0
    # measured collective times against size (`autopar calibrate`); empty: every collective
    # latency + bytes / bandwidth of its link (the presets)
    collective_curves: tuple[CollectiveCurve, ...] = ()
    # the optimizer step's seconds per parameter a rank owns, as torch.optim.AdamW runs it
    # (measured by `autopar calibrate`); 0: its bytes (cost/compute.py ADAM_BYTES_PER_PARAM)
    # at HBM bandwidth (the presets: fused multi-tensor kernels, memory bound)
    optimizer_param_s: float = 0.0
    # what the optimizer step costs per parameter tensor it steps, beyond its elements (AdamW
    # on a CPU runs each tensor's update as its own ops: ~17 µs a tensor on the development
    # host), measured by `autopar calibrate`; priced per `RegionProfile.param_tensors` a rank
    # steps (1/d of them under ZeRO: a segment per piece of its shard); 0: not counted
    optimizer_tensor_s: float = 0.0
    # an eager runtime's backward per forward op it dispatched (autograd's node, its kernels'
    # dispatch), measured by `autopar calibrate`; with kernel_launch_s forward, priced per op
    # of a region (`RegionProfile.eager_ops`) where elementwise is "eager"
    autograd_op_s: float = 0.0
    # what interleaved-zb's B/W split (autopar.runtime.split_backward) adds to a backward per
    # forward op of the chunk (its reverse graph, parameter groups, an engine call per weight),
    # measured by `autopar calibrate`; priced like dispatch, only where elementwise is "eager"
    # (cost/compute.py `split_backward_s`); 0: not measured
    split_backward_op_s: float = 0.0
    # what that split adds beyond its per-op work, as a fraction of the region's forward +
    # backward (on a CPU its backward runs with the graph retained: fresh memory for its
    # gradients, colder caches; ~0.1 measured here), written by `autopar calibrate` until
    # 2026-11-28 (now split_backward_s_per_byte); priced where elementwise is "eager", like
    # split_backward_op_s; 0: not measured
    split_backward_frac: float = 0.0
    # what that split adds beyond its per-op work per byte of the region's saved activations
    # (recompute "none", `microbatch_activations`): its B runs with the graph retained, so the
    # gradients it makes take memory a whole backward would have reused from what each node
    # frees (colder caches). Fitted with split_backward_op_s by `autopar calibrate` on GPT
    # blocks of three sizes (which writes both, and split_backward_frac 0: the share of the
    # compute older files priced, which mis-scaled across widths); priced where elementwise is
    # "eager", like split_backward_op_s; 0: not measured
    split_backward_s_per_byte: float = 0.0
    # what PyTorch's selective checkpoint (recompute "op") adds per forward op of a region it
    # checkpoints: its dispatch mode sees each op in the forward and again in the
    # recomputation (a policy call, the kept outputs stored), measured by `autopar calibrate`;
    # priced like dispatch, only where elementwise is "eager"; 0: not measured
    checkpoint_op_s: float = 0.0
    # what torch.utils.checkpoint (non-reentrant, the RNG state kept) costs per checkpointed
    # region a micro-batch beyond rerunning the region's forward: saving the inputs behind its
    # hooks, the RNG snapshot, the recomputation's graph set up in backward, its inputs read
    # back cold; measured by `autopar calibrate` on an attention core (the region selective
    # checkpoints); priced per region recompute full, selective or op checkpoints, only where
    # elementwise is "eager"; 0: not measured
    checkpoint_region_s: float = 0.0
    # the fraction of a collective that hides behind compute run meanwhile (measured by
    # `autopar calibrate`); scales what the data-parallel terms credit as hidden. 1 in the
    # presets (GPU collectives run beside the kernels); ~0 for CPU ranks on every core
    comm_overlap: float = 1.0
    # a pipeline message's time over what it is priced as (comm.hop_s: the measured hop
    # curve, else the send/recv curve or the link), fitted by `autopar tune` where the
    # pipeline's messages cost apart from the collectives (against calibrate's blocking
    # exchange, before the hop was measured: 0.1 - 0.4 on 2 local CPU ranks; against the hop
    # 0.7 - 3.3); 1: as measured (the presets, a fresh calibration); near 0 where the
    # runtime's pre-posted messages hide behind compute (tune_fit.P2P_FLOOR)
    pipeline_p2p_scale: float = 1.0
    # a tensor-parallel collective's time over what its curve or link prices (the blocks'
    # reductions and gathers, the embedding's and head's, those the TP pass inserts, FP8's amax
    # reductions; not a pipeline hop's gather), and the context-parallel K/V exchange's
    # (cost/exchanges.py `context_comm_s`, every method), each fitted by `autopar tune` where
    # the measured plans' shares of it tell it apart from the other collectives
    # (tune_fit.fit_scales; on 2 local CPU ranks, 2026-11-27/28, t = 2 was priced from 16%
    # fast to 34% slow and c = 2 11–27% fast, run to run); 1: as measured (the presets, a fresh
    # calibration); 0 prices it free (tune's analysis of a plan's parts, `part_seconds`)
    tp_comm_scale: float = 1.0
    cp_comm_scale: float = 1.0
    sources: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0 <= self.comm_overlap <= 1:
            raise ValueError(f"Cluster.comm_overlap={self.comm_overlap!r}: must be in [0, 1], "
                             f"the fraction of a collective that hides behind compute")
        if not 0 <= self.tp_comm_overlap <= 1:
            raise ValueError(f"Cluster.tp_comm_overlap={self.tp_comm_overlap!r}: must be in "
                             f"[0, 1], the fraction of an overlapped TP collective that "
                             f"costs nothing")
        if not self.pipeline_p2p_scale > 0:
            raise ValueError(f"Cluster.pipeline_p2p_scale={self.pipeline_p2p_scale!r}: must be "
                             f"positive, a pipeline message's time over its send/recv's (1: "
                             f"as measured)")
        for name in ("tp_comm_scale", "cp_comm_scale"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r}: must be >= 0, a "
                                 f"collective's time over its measured curve's (1: as "
                                 f"measured)")
        if self.tp_row_pieces < 1:
            raise ValueError(f"Cluster.tp_row_pieces={self.tp_row_pieces!r}: must be >= 1, "
                             f"the calls a row-parallel reduction is issued as (1: one)")
        for name in ("gpus_per_node", "peak_flops", "memory_bytes", "hbm_bandwidth_Bps",
                     "intra_node_bandwidth_Bps", "inter_node_bandwidth_Bps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r}: must be positive")
        for name in ("intra_node_latency_s", "inter_node_latency_s", "kernel_launch_s",
                     "optimizer_param_s", "optimizer_tensor_s", "autograd_op_s",
                     "split_backward_op_s", "split_backward_frac", "checkpoint_op_s",
                     "checkpoint_region_s", "split_backward_s_per_byte"):
            if getattr(self, name) < 0:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r}: must be >= 0, "
                                 f"seconds (0: not counted); measure it with `autopar "
                                 f"calibrate` or leave it out")
        if not 0 < self.gemm_max_efficiency <= 1:
            raise ValueError(f"Cluster.gemm_max_efficiency={self.gemm_max_efficiency}: must be "
                             f"in (0, 1], a fraction of peak_flops")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"Cluster.attention={self.attention!r}: must be one of {ATTENTION_KINDS}: "
                f"'flash' for fused attention kernels that never write the s×s scores "
                f"(FlashAttention-2/3, cuDNN, PyTorch SDPA on CUDA), 'materialized' for "
                f"attention that saves them (the unfused kernels of 2021-22); e.g. "
                f"dataclasses.replace(cluster, attention='materialized')")
        if self.elementwise not in ELEMENTWISE_KINDS:
            raise ValueError(
                f"Cluster.elementwise={self.elementwise!r}: must be one of {ELEMENTWISE_KINDS}: "
                f"'fused' for stacks that fuse elementwise chains into single kernels "
                f"(Megatron-LM, torch.compile), 'eager' for op-by-op PyTorch; e.g. "
                f"dataclasses.replace(cluster, elementwise='eager')")
        if self.fp8_flops < 0 or not 0 <= self.fp8_gemm_max_efficiency <= 1:
            raise ValueError(f"Cluster.fp8_flops={self.fp8_flops!r}, fp8_gemm_max_efficiency="
                             f"{self.fp8_gemm_max_efficiency!r}: must be >= 0 and in [0, 1] "
                             f"(0: no FP8 rate / the 16-bit efficiency)")
        for name in ("flash_half_len", "flash_half_head_dim"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r}: must be >= 0, the "
                                 f"key length / head dim that halves the fused attention "
                                 f"kernel's rate (0: not modelled)")
        for name in ("flash_fwd_efficiency", "flash_bwd_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r}: must be in (0, 1], "
                                 f"the fused attention kernel's fraction of peak_flops")

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes


# What is calibrated and what is a datasheet guess (README "The cost model against published
# measurements"): e_max is fitted per GPU generation through the product path (captured models
# planned at the published configuration, tests/passes/test_calibration.py and
# tests/passes/test_llama3_calibration.py); the link efficiencies are nccl-tests fractions, reused for
# every GPU; the fused-attention efficiencies come from the FlashAttention-2/3 papers; the rest
# is datasheet. NCCL ring all-reduce reaches ~0.75-0.8 of the NVLink rate in nccl-tests
# "busbw" (DGX A100: ~230 GB/s of 300 GB/s), and ~0.9 of the IB / RoCE line rate.
_NCCL_NVLINK_EFF = 0.77
_NCCL_IB_EFF = 0.9
# e_max, fitted: the least worst error over 2104.04473 Table 1 and 2205.05198 Table 5 planned
# from captured GPT / GPT-2 (all rows within 3.2%, mean +0.2%). Below what cuBLAS reaches on an
# isolated large GEMM (85-90% of A100 peak): it also carries what the model does not price
# (kernel gaps, stream synchronisation, the clocks a busy node sustains).
_GEMM_EMAX_A100 = 0.72
# e_max fitted to Llama 3 405B (2407.21783 Table 4: 8,192 H100, 430 TFLOP/s = 12.5 s per step)
# planned from the captured transformers model. cuBLAS reaches ~60-75% of the 989 TFLOP/s
# dense peak on large bf16 GEMMs (the peak assumes the 1,830 MHz boost clock, which a 700 W
# part under load does not hold).
_GEMM_EMAX_H100 = 0.60
# FP8 GEMMs on H100 (dense FP8 peak 1,979 TFLOP/s, twice bf16's): their e_max relative to the
# bf16 e_max, fitted to torchtitan's Llama 3.1 8B on 8 H100 (docs/performance.md Table 1,
# 2410.06511: FSDP + compile 6,667 tokens/s/GPU, + Float8 8,532) through the captured model:
# with the bf16 e_max refitted to that run's 500 W parts (0.47; its attention at SDPA's
# FlashAttention-2 rates, FLASH2_H100, and its per-op SAC as recompute "op"), FP8 GEMMs reach
# 0.99 of the bf16 fraction of their own peak (tests/passes/test_fp8_calibration.py). Both
# fitted to Table 1 only (0.39 and 0.89 while its attention was priced at FlashAttention-3's
# rates and its SAC as Megatron's selective recompute). Not fitted, the same constants: Table 3
# (8B on 128 GPUs: FP8 -4.1%, bf16 -2.7%, asserted; the per-GPU work is Table 1's, so it checks
# multi-host FSDP, not this ratio) and Tables 4-5 (70B at TP 8, 405B at TP 8 x PP 8: predicted
# 5-22% slow, printed by benchmarks/calibration.py: at t = 8 the casts and 16-bit TP gathers
# autopar's runtime does are priced, torchao's Float8 TP casts the shard before an FP8 gather).
_FP8_RELATIVE_EMAX = 0.99
_FP8_EMAX_H100 = _GEMM_EMAX_H100 * _FP8_RELATIVE_EMAX
_GEMM_HALF_DIM = 48.0  # fitted with e_max; a 128-wide dimension runs at ~73%, 2048-wide at ~98%
# CUDA context (~0.5 GB) + cuBLAS workspace + NCCL channel buffers + caching-allocator
# fragmentation; Megatron runs leave ~2-3 GB unused on 80 GB parts. Not fitted.
_RESERVE_80GB = 3.0 * GB
# Fused attention, fraction of peak on long sequences (the key-length factor L/(L + 224) taken
# out): FlashAttention-2 on A100 (2307.08691 §4.1: forward up to 73%, backward up to 63% of
# 312 TFLOP/s, head dim 128, 16K tokens); FlashAttention-3 on H100 (2407.08608 Fig. 5-6: 616
# TFLOP/s forward causal, 581 backward, head dim 128, 16K tokens; cuDNN within 10%).
_FLASH_A100 = dict(flash_fwd_efficiency=0.74, flash_bwd_efficiency=0.64)
_FLASH_H100 = dict(flash_fwd_efficiency=0.63, flash_bwd_efficiency=0.60)
# FlashAttention-2 on H100 (2407.08608 Fig. 5-6, the same charts: 335 TFLOP/s forward causal,
# 322 backward, head dim 128, 16K tokens, the key-length factor taken out): what PyTorch's
# scaled_dot_product_attention ran on Hopper in torch 2.6-2.8 (FLASH_ATTENTION first,
# FlashAttention-2: pytorch/torchtitan#1042; torchtitan picked cuDNN on B200 only, #1196), so
# the torchtitan rows of those versions take it (`with_overrides(cluster, **FLASH2_H100)`).
# The H100 presets keep FlashAttention-3's rates: the stacks they are fitted to, and torch
# 2.11's SDPA on an H100, which dispatched cuDNN's fused attention (benchmarks/results/
# gpu-2026-11-27-h100-profile-*.txt).
FLASH2_H100 = dict(flash_fwd_efficiency=0.343, flash_bwd_efficiency=0.330)

_COMMON_SOURCES = (
    "link efficiencies: nccl-tests busbw on DGX A100 (~230 GB/s all-reduce of 300 GB/s NVLink), "
    "~90% of InfiniBand line rate; reused for every GPU (not fitted)",
    "flash_half_len 224: fitted to FlashAttention-3's forward speed against sequence length "
    "(pytorch/benchmark#2391, H100, head dim 128: 430 TFLOP/s at 512 tokens, 565 at 2K, 614 "
    "at 8K, 620 at 16K; L/(L+224) within 2%)",
    "elementwise_efficiency 0.8: STREAM-like kernels reach ~80% of datasheet HBM bandwidth",
    "kernel_launch_s 5 us: CUDA kernel launch + framework dispatch overhead",
)
_A100_SOURCES = (
    "gemm_max_efficiency 0.72, gemm_half_dim 48: fitted to 2104.04473 Table 1 and 2205.05198 "
    "Table 5 through captured models (tests/passes/test_calibration.py)",
    "flash efficiencies: FlashAttention-2 on A100 80GB (2307.08691 §4.1)",
)
_H100_SOURCES = (
    "gemm_max_efficiency 0.60: fitted to Llama 3 405B on 8,192 H100 (2407.21783 Table 4; "
    "tests/passes/test_llama3_calibration.py); gemm_half_dim 64: guess (wgmma's larger tiles), "
    "not fitted",
    "flash efficiencies: FlashAttention-3 on H100 SXM5 (2407.08608 Fig. 5-6)",
    "reserved_bytes 3 GB: as on A100 80GB (not fitted)",
)

_DGX_H100 = Cluster(
    name="dgx-h100-80gb", gpus_per_node=8,
    peak_flops=989e12, memory_bytes=80 * GB, hbm_bandwidth_Bps=3.35e12,
    intra_node_bandwidth_Bps=450 * GB * _NCCL_NVLINK_EFF, intra_node_latency_s=8e-6,
    inter_node_bandwidth_Bps=50 * GB * _NCCL_IB_EFF, inter_node_latency_s=15e-6,
    gemm_max_efficiency=_GEMM_EMAX_H100, gemm_half_dim=64.0,
    reserved_bytes=_RESERVE_80GB, attention="flash", **_FLASH_H100,
    fp8_flops=1979e12, fp8_gemm_max_efficiency=_FP8_EMAX_H100,
    sources=("H100 SXM5 datasheet: 989 TFLOP/s dense bf16, 80 GB, 3.35 TB/s HBM3",
             "H100 SXM5 datasheet: 1,979 TFLOP/s dense FP8 (3,958 with sparsity); FP8 e_max "
             "0.89 × the bf16 e_max, the ratio fitted to torchtitan's Llama 3.1 8B bf16 and "
             "Float8 runs on 8 H100 (docs/performance.md Table 1, 2410.06511)",
             "H100 datasheet: NVLink 4 900 GB/s bidirectional = 450 GB/s per direction",
             "DGX H100 user guide: 8x ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU "
             "(Llama 3's RoCE fabric: 400 Gb/s per GPU too)",
             "latencies: guesses (NCCL ~8 us intra-node, ~15 us per inter-node step)",
             "checked on an H100 80GB HBM3 (benchmarks/gpu.py, 2026-11-26, not fitted): a "
             "64 MiB copy moved 2.70 TB/s read + written, 0.81 of the datasheet's 3.35 "
             "(elementwise_efficiency 0.8 prices 2.68); the memory torch.cuda.mem_get_info "
             "reports is 79.2 GiB (85.0 GB); a 1.3B GPT's bf16 step ran 601 ms against 600 "
             "predicted")
    + _H100_SOURCES + _COMMON_SOURCES)

_PRESETS: dict[str, Cluster] = {
    "dgx-a100-80gb": Cluster(
        name="dgx-a100-80gb", gpus_per_node=8,
        peak_flops=312e12, memory_bytes=80 * GB, hbm_bandwidth_Bps=2.039e12,
        intra_node_bandwidth_Bps=300 * GB * _NCCL_NVLINK_EFF, intra_node_latency_s=10e-6,
        inter_node_bandwidth_Bps=25 * GB * _NCCL_IB_EFF, inter_node_latency_s=20e-6,
        gemm_max_efficiency=_GEMM_EMAX_A100, gemm_half_dim=_GEMM_HALF_DIM,
        reserved_bytes=_RESERVE_80GB, attention="flash", **_FLASH_A100,
        sources=("A100 80GB SXM datasheet: 312 TFLOP/s dense bf16/fp16, 80 GB, 2,039 GB/s HBM2e",
                 "A100 datasheet: NVLink 3 600 GB/s bidirectional = 300 GB/s per direction",
                 "DGX A100 user guide: 8x ConnectX-6 HDR 200 Gb/s = 25 GB/s per GPU",
                 "latencies: NCCL ~10 us intra-node, ~20 us IB per collective step")
        + _A100_SOURCES + _COMMON_SOURCES),
    "dgx-h100-80gb": _DGX_H100,
    # The H100's compute die with 141 GB of HBM3e: compute, links and the fitted efficiencies
    # are the H100's (not calibrated against an H200 run); memory and its bandwidth from the
    # datasheet.
    "dgx-h200-141gb": replace(
        _DGX_H100, name="dgx-h200-141gb", memory_bytes=141 * GB, hbm_bandwidth_Bps=4.8e12,
        sources=("H200 SXM datasheet: 989 TFLOP/s dense bf16 (the H100's), 1,979 dense FP8, "
                 "141 GB HBM3e, 4.8 TB/s",
                 "H200 datasheet: NVLink 4 900 GB/s bidirectional = 450 GB/s per direction",
                 "DGX H200 user guide: 8x ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU",
                 "compute, link and attention efficiencies, latencies, reserve: the H100's "
                 "(same die and links; not calibrated against an H200 run)")
        + _H100_SOURCES + _COMMON_SOURCES),
    "dgx2h-v100-32gb": Cluster(
        name="dgx2h-v100-32gb", gpus_per_node=16,
        peak_flops=125e12, memory_bytes=32 * GB, hbm_bandwidth_Bps=900 * GB,
        intra_node_bandwidth_Bps=150 * GB * _NCCL_NVLINK_EFF, intra_node_latency_s=10e-6,
        inter_node_bandwidth_Bps=100 * GB / 16 * _NCCL_IB_EFF, inter_node_latency_s=20e-6,
        gemm_max_efficiency=0.41, gemm_half_dim=_GEMM_HALF_DIM,
        reserved_bytes=1.5 * GB, attention="flash", **_FLASH_A100,
        sources=("V100 SXM3 32GB datasheet: 125 TFLOP/s tensor core, 32 GB, 900 GB/s HBM2",
                 "DGX-2H: NVSwitch 300 GB/s bidirectional = 150 GB/s per direction per GPU",
                 "1909.08053 §5: 8x 100 Gb/s InfiniBand per 16-GPU node = 6.25 GB/s per GPU",
                 "V100 e_max 0.41: fitted to 1909.08053's single-GPU 39 TFLOP/s through a "
                 "captured GPT (2019 stack: fp16 tensor cores, unfused softmax/GeLU; priced "
                 "with attention='materialized')",
                 "flash efficiencies: FlashAttention-2's A100 fractions (no V100 "
                 "measurement: FlashAttention-2 does not run on V100), a guess")
        + _COMMON_SOURCES),
}

# Datasheet presets of the 2024-25 GPU generations: nothing in them was fitted to a run; the
# compute and attention efficiencies are the H100's (the nearest fitted part), the link
# efficiencies the nccl-tests fractions of _COMMON_SOURCES. Calibrate a cluster of these
# (`autopar calibrate`) or refine one (`autopar tune`) before trusting their predictions.
_NOT_FITTED = ("gemm_max_efficiency, gemm_half_dim, flash efficiencies: the H100's (fitted "
               "on H100, not on this part): not fitted",
               "reserved_bytes 3 GB: as on the 80 GB parts (not fitted)")
_HGX_B200 = replace(
    _DGX_H100, name="hgx-b200-180gb", peak_flops=2.25e15, memory_bytes=180 * GB,
    hbm_bandwidth_Bps=8e12, intra_node_bandwidth_Bps=900 * GB * _NCCL_NVLINK_EFF,
    sources=("HGX B200 datasheet: 36 PFLOP/s bf16 with sparsity per 8 GPUs = 2.25 PFLOP/s "
             "dense per GPU; 1,440 GB HBM3e = 180 GB per GPU; 64 TB/s = 8 TB/s per GPU",
             "NVLink 5: 1.8 TB/s bidirectional per GPU = 900 GB/s per direction",
             "DGX B200 user guide: 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU",
             "latencies: the H100's guesses (not measured)") + _NOT_FITTED + _COMMON_SOURCES)
_DATASHEET_PRESETS = {
    "hgx-b200-180gb": _HGX_B200,
    # One NVLink domain of 72 GPUs (18 compute trays of 4) behind NVLink switches: to the
    # planner a "node" is the NVLink domain, so gpus_per_node is 72.
    "gb200-nvl72": replace(
        _HGX_B200, name="gb200-nvl72", gpus_per_node=72, peak_flops=2.5e15,
        memory_bytes=186 * GB,
        sources=("GB200 NVL72 datasheet: 360 PFLOP/s bf16 with sparsity per 72 GPUs = 2.5 "
                 "PFLOP/s dense per GPU; 13.4 TB HBM3e = 186 GB per GPU; 576 TB/s = 8 TB/s "
                 "per GPU",
                 "GB200 NVL72 datasheet: 130 TB/s NVLink over 72 GPUs = 1.8 TB/s bidirectional "
                 "= 900 GB/s per direction; gpus_per_node 72 = the NVLink domain",
                 "inter-rack: one ConnectX-7 400 Gb/s per GPU = 50 GB/s (the reference design's "
                 "NICs; not verified against a deployed system)",
                 "latencies: the H100's guesses (not measured)") + _NOT_FITTED + _COMMON_SOURCES),
    "mi300x-192gb": replace(
        _DGX_H100, name="mi300x-192gb", peak_flops=1307.4e12, memory_bytes=192 * GB,
        hbm_bandwidth_Bps=5.3e12, intra_node_bandwidth_Bps=448 * GB * _NCCL_NVLINK_EFF,
        intra_node_latency_s=10e-6,
        sources=("AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s dense bf16, 192 GB HBM3, "
                 "5.3 TB/s",
                 "MI300X platform: 8 GPUs, Infinity Fabric 896 GB/s bidirectional per GPU (7 "
                 "links) = 448 GB/s per direction; a ring uses fewer links, so optimistic",
                 "inter-node: 8x 400 Gb/s NICs per node = 50 GB/s per GPU (typical MI300X "
                 "platform; not verified)",
                 "intra-node latency 10 us: guess (RCCL), not measured",
                 "link efficiencies: NCCL's on NVLink/IB reused for RCCL (not fitted)")
        + _NOT_FITTED + _COMMON_SOURCES),
    # An H100 node on a commodity fabric: one 100 Gb/s Ethernet (RoCE) port per GPU.
    "h100-eth100g": replace(
        _DGX_H100, name="h100-eth100g", inter_node_bandwidth_Bps=12.5 * GB * _NCCL_IB_EFF,
        inter_node_latency_s=25e-6,
        sources=("H100 SXM5 datasheet: 989 TFLOP/s dense bf16, 80 GB, 3.35 TB/s HBM3",
                 "H100 datasheet: NVLink 4 900 GB/s bidirectional = 450 GB/s per direction",
                 "fabric: one 100 Gb/s Ethernet (RoCE v2) port per GPU = 12.5 GB/s",
                 "inter-node latency 25 us: guess for RoCE through a switch (not measured)")
        + _H100_SOURCES + _COMMON_SOURCES),
}
_PRESETS.update(_DATASHEET_PRESETS)

# Conservative defaults for this machine when `autopar calibrate` has not run: a 2-core laptop
# class CPU (~50 GFLOP/s fp32 per core with AVX2 FMA at 60% efficiency), DDR4 ~20 GB/s,
# gloo over loopback TCP ~1 GB/s with ~50 us latency; torch 2.13's CPU flash kernel on the
# 2-core development machine, one thread, causal, 4 heads of 64, fp32, against its matmul peak
# (85 GFLOP/s): forward 36% / backward 34% of peak at 256 tokens, 50% / 45% at 1,024; fitted to
# e · L / (L + L_half).
_LOCAL_DEFAULT = Cluster(
    name="local-cpu", gpus_per_node=2, peak_flops=5e10, memory_bytes=8 * GB,
    hbm_bandwidth_Bps=20 * GB, intra_node_bandwidth_Bps=1 * GB, intra_node_latency_s=100e-6,
    inter_node_bandwidth_Bps=1 * GB, inter_node_latency_s=50e-6,
    gemm_max_efficiency=1.0, gemm_half_dim=16.0, kernel_launch_s=2e-6,
    elementwise_efficiency=1.0, reserved_bytes=0.5 * GB,
    # what autopar's runtime runs on a CPU: torch's fused attention kernel (it saves q, k, v,
    # its output and the logsumexp; the math path only with attention dropout), and every
    # other op eagerly
    attention="flash", elementwise="eager",
    flash_fwd_efficiency=0.58, flash_bwd_efficiency=0.52, flash_half_len=150.0,
    split_backward_op_s=22e-6, split_backward_s_per_byte=9e-11, checkpoint_op_s=50e-6,
    checkpoint_region_s=650e-6,
    sources=("local-cpu defaults (`autopar calibrate` not run): conservative 2-core CPU (AVX2 "
             "FMA ~50 GFLOP/s total), DDR4 ~20 GB/s, gloo loopback TCP ~1 GB/s / 50-100 us",
             "attention: torch's CPU kernel (flash, fused): efficiencies measured once on the "
             "2-core development machine (fitted to 256 and 1,024 tokens)",
             "elementwise: eager (autopar's runtime runs its chunks op by op)",
             "split_backward_op_s 22 us, split_backward_s_per_byte 0.09 ns: interleaved-zb's "
             "B/W split per forward op and per saved byte, fitted on two GPT blocks at three "
             "sizes on an AMD EPYC core, 2026-11-28 (22-24 us and 0.07-0.12 ns in two "
             "fits; it added 1.74 / 1.73 / 2.44 ms to the two blocks' backward at widths "
             "64 / 128 / 256, 4 sequences of 128)",
             "checkpoint_op_s 50 us: recompute op's selective checkpoint per forward op the "
             "profile counts, measured on an AVX-512 EPYC core, 2026-11-27 (52-63 us on "
             "calibrate's two GPT blocks)",
             "checkpoint_region_s 650 us: torch.utils.checkpoint per region beyond its "
             "recomputation, measured on an AVX-512 EPYC core, 2026-11-28 (430-840 us on "
             "calibrate's attention core of 256 tokens, 8 MB streamed between forward and "
             "backward; 180-290 us on a region of one op on a tiny tensor)"))


def local_cluster_path(path: str | os.PathLike | None = None) -> Path:
    """Where `autopar calibrate` keeps this machine's cluster file: `path`, else
    $AUTOPAR_CACHE, else ~/.cache/autopar/local-cpu.json."""
    if path is not None:
        return Path(path)
    env = os.environ.get("AUTOPAR_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "autopar" / "local-cpu.json"


def _local_cpu() -> Cluster:
    """This machine: the cluster file `autopar calibrate` wrote, else the defaults (a file
    that does not read as a cluster file, e.g. one from before cluster files, is ignored)."""
    target = local_cluster_path()
    if target.is_file():
        try:
            return replace(load_cluster(target), name="local-cpu")
        except ValueError:
            pass
    return _LOCAL_DEFAULT


# ---- cluster files: a JSON object of Cluster fields (+ "calibration": what was measured) ----

CALIBRATION_KEY = "calibration"


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """Every field of `cluster` as JSON values (sources as a list), in declaration order."""
    out: dict[str, Any] = {}
    for f in fields(Cluster):
        value = getattr(cluster, f.name)
        if f.name == "collective_curves":
            value = [{"link": c.link, "kind": c.kind, "ranks": c.ranks, "bytes": list(c.bytes),
                      "seconds": list(c.seconds)} for c in value]
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _curves_value(value: Any, where: str) -> tuple[CollectiveCurve, ...]:
    """The collective_curves field of a cluster file; one line naming the rule and the fix."""
    keys = {"link", "kind", "ranks", "bytes", "seconds"}
    if not isinstance(value, list) or not all(isinstance(c, dict) and set(c) == keys
                                              for c in value):
        raise ValueError(f"{where}: field 'collective_curves': must be a list of objects with "
                         f"keys {sorted(keys)}; fix it in the file or rerun `autopar calibrate`")
    try:
        return tuple(CollectiveCurve(link=c["link"], kind=c["kind"], ranks=int(c["ranks"]),
                                     bytes=tuple(float(x) for x in c["bytes"]),
                                     seconds=tuple(float(x) for x in c["seconds"]))
                     for c in value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: field 'collective_curves': {err}") from None


def _field_value(f: Any, value: Any, where: str) -> Any:
    """`value` checked against field `f`'s declared type; one line naming field, rule, fix."""
    kind = str(f.type).replace(" ", "")
    bad = None
    if f.name == "collective_curves":
        return _curves_value(value, where)
    if kind.startswith("tuple"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            bad = "a list of strings"
        value = tuple(value) if bad is None else value
    elif kind in ("float", "int", "float|None", "int|None") and not (
            value is None and "None" in kind):
        want_int = kind.startswith("int")
        ok = isinstance(value, int) if want_int else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            bad = "an integer" if want_int else "a number"
        elif value < 0 or value != value or value in (float("inf"), float("-inf")):
            bad = "a finite number >= 0"
        value = value if bad or want_int else float(value)
    elif kind == "str" and not isinstance(value, str):
        bad = "a string"
    if bad:
        raise ValueError(f"{where}: field {f.name!r} = {value!r}: must be {bad}; fix it in the "
                         f"file (`autopar clusters` shows the presets' values)")
    return value


def cluster_from_dict(data: Any, where: str = "cluster file") -> Cluster:
    """The Cluster a dict of its fields describes (what `cluster_to_dict` writes); fields with
    a default may be left out; the `calibration` record is ignored. Bad data: one line naming
    the field, the rule and the fix."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a cluster file holds one JSON object of Cluster fields, not "
                         f"{type(data).__name__}; write one with `autopar calibrate` or "
                         f"autopar.save_cluster(cluster, path)")
    known = {f.name: f for f in fields(Cluster)}
    for key in data:
        if key not in known and key != CALIBRATION_KEY:
            raise ValueError(f"{where}: field {key!r} is not a Cluster field; remove or rename "
                             f"it (the fields: {', '.join(known)})")
    values = {}
    for name, f in known.items():
        if name in data:
            values[name] = _field_value(f, data[name], where)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ValueError(f"{where}: field {name!r} is missing; every Cluster field without "
                             f"a default is required: add \"{name}\": <value> (`autopar "
                             f"clusters` shows the presets' values)")
    try:
        return Cluster(**values)
    except ValueError as err:
        raise ValueError(f"{where}: {err}; fix the value in the file") from None


def read_cluster_file(path: str | os.PathLike) -> tuple[Cluster, dict[str, Any]]:
    """(the Cluster, its calibration record or {}) of a cluster file; one line if bad."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"cluster file {where}: cannot be read ({err.strerror}); pass an "
                         f"existing file, e.g. one written by `autopar calibrate`") from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"cluster file {where}: not JSON ({err}); a cluster file is a JSON "
                         f"object of Cluster fields: write one with `autopar calibrate` or "
                         f"autopar.save_cluster") from None
    record = data.get(CALIBRATION_KEY) if isinstance(data, dict) else None
    return cluster_from_dict(data, f"cluster file {where}"), dict(record or {})


def load_cluster(path: str | os.PathLike) -> Cluster:
    """The Cluster a cluster file describes (read_cluster_file without the record)."""
    return read_cluster_file(path)[0]


def save_cluster(cluster: Cluster, path: str | os.PathLike,
                 calibration: dict[str, Any] | None = None) -> Path:
    """Write `cluster` (every field, its sources) and an optional calibration record as a
    cluster file, atomically; the path written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = cluster_to_dict(cluster)
    if calibration:
        data[CALIBRATION_KEY] = calibration
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, target)  # a reader never sees half a file
    return target


CLUSTER_NAMES = tuple(_PRESETS) + ("local-cpu",)


def get_cluster(name_or_cluster: "str | os.PathLike | Cluster") -> Cluster:
    """A preset by name (see CLUSTER_NAMES), a cluster file (a path ending in .json), or the
    given Cluster unchanged."""
    if isinstance(name_or_cluster, Cluster):
        return name_or_cluster
    if isinstance(name_or_cluster, os.PathLike) or str(name_or_cluster).endswith(".json"):
        return load_cluster(name_or_cluster)
    if name_or_cluster == "local-cpu":
        return _local_cpu()
    if name_or_cluster in _PRESETS:
        return _PRESETS[name_or_cluster]
    raise ValueError(f"cluster={name_or_cluster!r}: unknown cluster; known names are "
                     f"{list(CLUSTER_NAMES)}, a cluster file (FILE.json, `autopar calibrate` "
                     f"writes one), or an autopar Cluster(...)")


def with_overrides(cluster: Cluster, **changes) -> Cluster:
    """A copy of `cluster` with some constants replaced (what-if studies, tests)."""
    return replace(cluster, **changes)
