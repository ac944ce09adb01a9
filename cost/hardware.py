"""Cluster specifications: peak compute, memory, HBM and link bandwidths, with sources.

A `Cluster` is the hardware half of the cost model (the model half is `ModelProfile`). Every
constant carries a source in `Cluster.sources`: a datasheet, a paper, or "fitted" with the
calibration set it was fitted to (`tests/unit/test_calibration.py`, published-results.md).

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
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.cost.calibrate import load_local_calibration

GB = 1e9


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
    sources: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "peak_flops", "memory_bytes", "hbm_bandwidth_Bps",
                     "intra_node_bandwidth_Bps", "inter_node_bandwidth_Bps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r}: must be positive")
        if not 0 < self.gemm_max_efficiency <= 1:
            raise ValueError(f"Cluster.gemm_max_efficiency={self.gemm_max_efficiency}: must be "
                             f"in (0, 1], a fraction of peak_flops")

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes


# The A100 calibration (2104.04473 Table 1, 2205.05198 Table 5) fits e_max and the link
# efficiencies; the same mechanism constants are reused for H100 / V100 except where a datasheet
# differs. NCCL ring all-reduce reaches ~0.75-0.8 of the NVLink rate in nccl-tests "busbw"
# (DGX A100: ~230 GB/s of 300 GB/s), and ~0.9 of the IB line rate.
_NCCL_NVLINK_EFF = 0.77
_NCCL_IB_EFF = 0.9
_GEMM_EMAX = 0.80      # fitted; cuBLAS large bf16 GEMMs reach 80-90% of A100 peak
_GEMM_HALF_DIM = 48.0  # fitted; a 128-wide dimension runs at ~73%, 2048-wide at ~98%
# CUDA context (~0.5 GB) + cuBLAS workspace + NCCL channel buffers + caching-allocator
# fragmentation; Megatron runs leave ~2-3 GB unused on 80 GB parts.
_RESERVE_80GB = 3.0 * GB

_COMMON_SOURCES = (
    "gemm_max_efficiency, gemm_half_dim: fitted to 2104.04473 Table 1 and 2205.05198 Table 5 "
    "(tests/unit/test_calibration.py); e_max within cuBLAS's reported 80-90% of peak on large "
    "GEMMs",
    "link efficiencies: nccl-tests busbw on DGX A100 (~230 GB/s all-reduce of 300 GB/s NVLink), "
    "~90% of InfiniBand line rate",
    "elementwise_efficiency 0.8: STREAM-like kernels reach ~80% of datasheet HBM bandwidth",
    "kernel_launch_s 5 us: CUDA kernel launch + framework dispatch overhead",
)

_PRESETS: dict[str, Cluster] = {
    "dgx-a100-80gb": Cluster(
        name="dgx-a100-80gb", gpus_per_node=8,
        peak_flops=312e12, memory_bytes=80 * GB, hbm_bandwidth_Bps=2.039e12,
        intra_node_bandwidth_Bps=300 * GB * _NCCL_NVLINK_EFF, intra_node_latency_s=10e-6,
        inter_node_bandwidth_Bps=25 * GB * _NCCL_IB_EFF, inter_node_latency_s=20e-6,
        gemm_max_efficiency=_GEMM_EMAX, gemm_half_dim=_GEMM_HALF_DIM,
        reserved_bytes=_RESERVE_80GB,
        sources=("A100 80GB SXM datasheet: 312 TFLOP/s dense bf16/fp16, 80 GB, 2,039 GB/s HBM2e",
                 "A100 datasheet: NVLink 3 600 GB/s bidirectional = 300 GB/s per direction",
                 "DGX A100 user guide: 8x ConnectX-6 HDR 200 Gb/s = 25 GB/s per GPU",
                 "latencies: NCCL ~10 us intra-node, ~20 us IB per collective step")
        + _COMMON_SOURCES),
    "dgx-h100-80gb": Cluster(
        name="dgx-h100-80gb", gpus_per_node=8,
        peak_flops=989e12, memory_bytes=80 * GB, hbm_bandwidth_Bps=3.35e12,
        intra_node_bandwidth_Bps=450 * GB * _NCCL_NVLINK_EFF, intra_node_latency_s=8e-6,
        inter_node_bandwidth_Bps=50 * GB * _NCCL_IB_EFF, inter_node_latency_s=15e-6,
        gemm_max_efficiency=0.75, gemm_half_dim=64.0,
        reserved_bytes=_RESERVE_80GB,
        sources=("H100 SXM5 datasheet: 989 TFLOP/s dense bf16, 80 GB, 3.35 TB/s HBM3",
                 "H100 datasheet: NVLink 4 900 GB/s bidirectional = 450 GB/s per direction",
                 "DGX H100 user guide: 8x ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU",
                 "H100 e_max 0.75, half-dim 64: larger tiles (wgmma) need bigger dims; "
                 "not calibrated against a published run")
        + _COMMON_SOURCES),
    "dgx2h-v100-32gb": Cluster(
        name="dgx2h-v100-32gb", gpus_per_node=16,
        peak_flops=125e12, memory_bytes=32 * GB, hbm_bandwidth_Bps=900 * GB,
        intra_node_bandwidth_Bps=150 * GB * _NCCL_NVLINK_EFF, intra_node_latency_s=10e-6,
        inter_node_bandwidth_Bps=100 * GB / 16 * _NCCL_IB_EFF, inter_node_latency_s=20e-6,
        gemm_max_efficiency=0.45, gemm_half_dim=_GEMM_HALF_DIM,
        reserved_bytes=1.5 * GB,
        sources=("V100 SXM3 32GB datasheet: 125 TFLOP/s tensor core, 32 GB, 900 GB/s HBM2",
                 "DGX-2H: NVSwitch 300 GB/s bidirectional = 150 GB/s per direction per GPU",
                 "1909.08053 §5: 8x 100 Gb/s InfiniBand per 16-GPU node = 6.25 GB/s per GPU",
                 "V100 e_max 0.45: fitted to 1909.08053's single-GPU 39 TFLOP/s (2019 stack: "
                 "fp16 tensor cores, unfused softmax/GeLU); its 8-way 8.3B run (77% scaling, "
                 "~30 TFLOP/s per GPU) is then predicted at 31 TFLOP/s")
        + _COMMON_SOURCES),
}

# Conservative defaults for this machine when `autopar calibrate` has not run: a 2-core laptop
# class CPU (~50 GFLOP/s fp32 per core with AVX2 FMA at 60% efficiency), DDR4 ~20 GB/s,
# gloo over loopback TCP ~1 GB/s with ~50 us latency.
_LOCAL_DEFAULTS = dict(matmul_flops_per_s=5e10, memory_bytes=8 * GB, hbm_bandwidth_Bps=20 * GB,
                       p2p_bandwidth_Bps=1 * GB, p2p_latency_s=50e-6,
                       allreduce_bandwidth_Bps=1 * GB, allreduce_latency_s=100e-6, cores=2)


def _local_cpu() -> Cluster:
    cal = load_local_calibration()
    vals = dict(_LOCAL_DEFAULTS)
    sources = ["local-cpu defaults: conservative 2-core CPU (AVX2 FMA ~50 GFLOP/s total), "
               "DDR4 ~20 GB/s, gloo loopback TCP ~1 GB/s / 50 us"]
    half_dim = 16.0
    peak = vals["matmul_flops_per_s"]
    emax = 1.0
    if cal:
        vals.update({k: cal[k] for k in vals if k in cal and cal[k]})
        sources = ["local-cpu: measured by `autopar calibrate` (cost/calibrate.py)"]
        curve = cal.get("matmul_curve") or []
        peak = max([float(vals["matmul_flops_per_s"])] + [float(r[3]) for r in curve])
        half_dim = _fit_half_dim(curve, peak) if curve else half_dim
    return Cluster(
        name="local-cpu", gpus_per_node=max(int(vals["cores"]), 1),
        peak_flops=peak, memory_bytes=float(vals["memory_bytes"]),
        hbm_bandwidth_Bps=float(vals["hbm_bandwidth_Bps"]),
        intra_node_bandwidth_Bps=float(vals["allreduce_bandwidth_Bps"]),
        intra_node_latency_s=float(vals["allreduce_latency_s"]),
        inter_node_bandwidth_Bps=float(vals["p2p_bandwidth_Bps"]),
        inter_node_latency_s=float(vals["p2p_latency_s"]),
        gemm_max_efficiency=emax, gemm_half_dim=half_dim, kernel_launch_s=2e-6,
        elementwise_efficiency=1.0, reserved_bytes=0.5 * GB, sources=tuple(sources))


def _fit_half_dim(curve: list, peak: float) -> float:
    """Least-squares fit of x_half in eff = f(m)f(n)f(k) to measured (m, n, k, flops) rows."""
    best, best_err = 16.0, float("inf")
    for x_half in [2.0 ** (i / 4) for i in range(0, 45)]:  # 1 .. 2048
        err = 0.0
        for m, n, k, fl in curve:
            pred = (m / (m + x_half)) * (n / (n + x_half)) * (k / (k + x_half))
            err += (pred - fl / peak) ** 2
        if err < best_err:
            best, best_err = x_half, err
    return best


CLUSTER_NAMES = tuple(_PRESETS) + ("local-cpu",)


def get_cluster(name_or_cluster: "str | Cluster") -> Cluster:
    """A preset by name (see CLUSTER_NAMES), or the given Cluster unchanged."""
    if isinstance(name_or_cluster, Cluster):
        return name_or_cluster
    if name_or_cluster == "local-cpu":
        return _local_cpu()
    if name_or_cluster in _PRESETS:
        return _PRESETS[name_or_cluster]
    raise ValueError(f"cluster={name_or_cluster!r}: unknown cluster; known names are "
                     f"{list(CLUSTER_NAMES)}, or pass an autopar Cluster(...)")


def with_overrides(cluster: Cluster, **changes) -> Cluster:
    """A copy of `cluster` with some constants replaced (what-if studies, tests)."""
    return replace(cluster, **changes)
