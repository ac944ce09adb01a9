"""Communication in the cost model: the collectives on a link, and the pipeline's p2p.

- Collectives (`allreduce_s`, `allgather_s`, `reducescatter_s`, `alltoall_s`, `p2p_s`):
  latency + bytes / bandwidth of the link the group lives on (Megatron rank order,
  `group_spans_nodes`): ring all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n. A
  cluster that `autopar calibrate` measured carries each collective's time against size
  (`Cluster.collective_curves`); a call of a measured kind, link and group size is priced from
  its curve (gloo's time is not affine in the size: it switches algorithms, and its all-reduce
  of 64 KiB-1 MiB took ~5x the fitted latency on the 2-core development machine). Nothing is overlapped with
  compute except the data-parallel reduction (see DP_OVERLAP) — Megatron-LM ran TP
  collectives and p2p on the compute stream.
  autopar's runtime does hide the backward reduction of each column-parallel input gradient
  under the weight-gradient GEMMs (passes/overlap.py), and under SP the re-gather of the saved
  shard under the dx GEMMs; the model does not credit either. The published runs it is
  calibrated against predate Megatron's asynchronous TP all-reduce, and with full credit
  (Σ min(c, dW) per block) the model, already a few % optimistic, put 2104.04473's 76B–1T rows
  at +10–12.5%; on a GPU the overlapped NCCL kernels also slow the GEMMs they share SMs and
  memory bandwidth with, by an amount no source here gives. Predicted step times are thus
  an upper bound by at most that backward communication.
- Pipeline p2p: each chunk boundary sends the activation forward and its gradient back, on
  the pipeline link (each tensor rank 1/t, all-gathered in-node: the scatter/gather of
  2104.04473 §4.1), charged per micro-batch in the load; an interleaved order with groups of
  N > p micro-batches per chunk visit hides part of it (`_grouped_p2p_s`). A hop is priced
  from the cluster's measured `hop` curve where it has one (`hop_s`: calibrate's relay, the
  receiver blocked on an irecv it posted, as the runtime's are) — not from the exchange of
  `p2p_s`: on the 2-vCPU development host a 64 KiB hop took 0.06 ms where a blocking exchange
  took 0.4-1.4 ms, and pipeline plans priced from the exchange measured 15-40% faster.

`inserted_collectives_s` prices the collectives the tensor-parallel pass inserts where it keeps
a value whole (cost/shares.py `tp_fallback`); the blocks' own tensor-parallel collectives are
priced with their compute (cost/compute.py `block_times_s`), the context and expert exchanges
in cost/exchanges.py, the data-parallel ones in cost/dp_terms.py.
"""
from __future__ import annotations

from autopar.cost.config import Config
from autopar.cost.hardware import Cluster
from autopar.cost.profile import ModelProfile, TPRegionFallback


def group_spans_nodes(cluster: Cluster, *, stride: int, size: int, gpus: int) -> bool:
    """Whether a rank group {base + j*stride, j < size} leaves a node (Megatron rank order).

    Example: 8-GPU nodes, t=8, d=4: a data group has stride 8, size 4 -> spans 32 ranks -> True;
    t=2, d=4: stride 2, size 4 -> 8 ranks inside one node -> False.
    """
    if size <= 1 or gpus <= cluster.gpus_per_node:
        return False
    span = stride * size
    return not (span <= cluster.gpus_per_node and cluster.gpus_per_node % span == 0)


def link(cluster: Cluster, inter: bool) -> tuple[float, float]:
    """(bandwidth B/s, latency s) of the inter-node or the intra-node link."""
    if inter:
        return cluster.inter_node_bandwidth_Bps, cluster.inter_node_latency_s
    return cluster.intra_node_bandwidth_Bps, cluster.intra_node_latency_s


def measured_s(cluster: Cluster, kind: str, nbytes: float, n: int, inter: bool) -> float | None:
    """A `kind` collective of nbytes over n ranks on the link, from the cluster's measured
    curve of that kind, link and group size; None when it has none (the formulas then)."""
    if not cluster.collective_curves:
        return None
    where = "inter" if inter else "intra"
    for curve in cluster.collective_curves:
        if curve.kind == kind and curve.link == where and curve.ranks == n:
            return curve.time_s(nbytes)
    return None


def allreduce_s(cluster: Cluster, nbytes: float, n: int, inter: bool) -> float:
    """Ring all-reduce of nbytes over n ranks: 2(n-1)/n · bytes / bandwidth + latency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    seen = measured_s(cluster, "all_reduce", nbytes, n, inter)
    if seen is not None:
        return seen
    bw, lat = link(cluster, inter)
    return lat + 2.0 * (n - 1) / n * nbytes / bw


def allgather_s(cluster: Cluster, nbytes: float, n: int, inter: bool,
                kind: str = "all_gather") -> float:
    """Ring all-gather (or reduce-scatter, `kind`) whose full result is nbytes: (n-1)/n ·
    bytes / bw + latency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    seen = measured_s(cluster, kind, nbytes, n, inter)
    if seen is not None:
        return seen
    bw, lat = link(cluster, inter)
    return lat + (n - 1) / n * nbytes / bw


def reducescatter_s(cluster: Cluster, nbytes: float, n: int, inter: bool) -> float:
    """Ring reduce-scatter of nbytes (the whole input): the all-gather's formula, its own
    measured curve."""
    return allgather_s(cluster, nbytes, n, inter, "reduce_scatter")


def alltoall_s(cluster: Cluster, nbytes: float, n: int, inter: bool) -> float:
    """All-to-all in which each of n ranks holds nbytes and keeps 1/n of them: (n-1)/n · bytes /
    bandwidth + latency (every rank sends and receives at once, pairwise exchanges)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    seen = measured_s(cluster, "all_to_all", nbytes, n, inter)
    if seen is not None:
        return seen
    bw, lat = link(cluster, inter)
    return lat + (n - 1) / n * nbytes / bw


def p2p_s(cluster: Cluster, nbytes: float, inter: bool) -> float:
    """One send of nbytes to one peer (its receive ends then): latency + bytes / bandwidth."""
    if nbytes <= 0:
        return 0.0
    seen = measured_s(cluster, "send_recv", nbytes, 2, inter)
    if seen is not None:
        return seen
    bw, lat = link(cluster, inter)
    return lat + nbytes / bw


def hop_s(cluster: Cluster, nbytes: float, inter: bool) -> float:
    """One pipeline hop of nbytes: the cluster's measured `hop` curve (module doc), else a
    send of `p2p_s`."""
    if nbytes <= 0:
        return 0.0
    seen = measured_s(cluster, "hop", nbytes, 2, inter)
    return seen if seen is not None else p2p_s(cluster, nbytes, inter)


def pieces_s(cluster: Cluster, coll, nbytes: float, pieces: int, n: int, inter: bool) -> float:
    """A collective `coll` (allreduce_s, reducescatter_s, ...) of nbytes issued as `pieces`
    equal calls back to back, asynchronously, and waited for once (the runtime's collective
    matmul, autopar.runtime.collectives.row_parallel): one call of the whole, whose wait a
    measured curve holds (a blocked rank's wake-up, `autopar calibrate`), plus the link's
    latency for every further piece. On a link priced by the formulas this is exactly
    pieces × (latency + bytes / pieces / bandwidth)."""
    whole = coll(cluster, nbytes, n, inter)
    if pieces <= 1 or whole <= 0:
        return whole
    return whole + (pieces - 1) * link(cluster, inter)[1]


def inserted_collectives_s(cluster: Cluster, fix: TPRegionFallback, t: int, b: int, e: int,
                           tp_inter: bool) -> tuple[float, float]:
    """(forward, backward) seconds of the collectives the tensor-parallel pass inserts in a
    region, per micro-batch (e: bytes per activation element; a parameter's gradient, not
    `per_sequence`, is reduced once per micro-batch in fp32: the runtime's autograd hook)."""
    fwd = bwd = 0.0
    for c in fix.collectives:
        coll = allgather_s if c.kind == "all-gather" else allreduce_s
        sec = coll(cluster, (b * c.elems * e) if c.per_sequence else 4 * c.elems, t, tp_inter)
        if c.backward:
            bwd += sec
        else:
            fwd += sec
    return fwd, bwd


def pipeline_p2p_s(profile: ModelProfile, cluster: Cluster, cfg: Config, layer_s: float) -> float:
    """Pipeline p2p per micro-batch of one rank, all its chunks' sends and receives: the
    activation (b·s·h) leaves each chunk forward and its gradient comes back; scatter/gather:
    each tensor rank sends 1/t and the receiver all-gathers in-node. layer_s: a layer's load
    per micro-batch (what an interleaved group of N > p hides part of it under)."""
    p, v = cfg.p, cfg.v
    if p <= 1:
        return 0.0
    return chunk_p2p_s(p2p_hop_s(profile, cluster, cfg), p, v, cfg.microbatch_group,
                       layer_s, profile.num_layers, cluster.comm_overlap)


def p2p_hop_s(profile: ModelProfile, cluster: Cluster, cfg: Config) -> float:
    """One hop of `pipeline_p2p_s` (p > 1): the activation sent to the next stage, scattered
    over the t ranks and all-gathered by the receiver unless sequence-parallel. Reads cfg's t,
    c, d, p, b, sp and GPUs only (the search keeps one per those: cost/search.py)."""
    t, p = cfg.t, cfg.p
    tp_inter = group_spans_nodes(cluster, stride=1, size=t, gpus=cfg.gpus)
    pp_inter = group_spans_nodes(cluster, stride=t * cfg.c * cfg.d, size=p, gpus=cfg.gpus)
    act = cfg.micro_batch_size * profile.block.input_bytes
    one = hop_s(cluster, act / t, pp_inter) * cluster.pipeline_p2p_scale
    if not (cfg.sequence_parallel and t > 1):
        one += allgather_s(cluster, act, t, tp_inter)
    return one


def chunk_p2p_s(one_s: float, p: int, v: int, group: int | None, layer_s: float,
                num_layers: int, comm_overlap: float) -> float:
    """`pipeline_p2p_s` from its hop: 2·v hops per micro-batch, less what an interleaved
    group of N > p hides under the compute each extra micro-batch brings (a chunk's load,
    num_layers / (p·v) layers of layer_s, as far as communication overlaps compute:
    comm_overlap). Why this size: the hop and the pipeline's shape (p, v, N) and a chunk's load
    (layer_s, num_layers, comm_overlap) without a Config (the search's quick bound)."""
    if group is not None and group > p:   # hides as comm overlaps
        return _grouped_p2p_s(one_s, p, v, group, layer_s * num_layers / (p * v), comm_overlap)
    return 2 * v * one_s


def _grouped_p2p_s(one_s: float, p: int, v: int, group: int, chunk_s: float,
                   overlap: float) -> float:
    """Exposed p2p per micro-batch of the interleaved order with groups of N > p.

    With N = p (Megatron's order) a chunk's first micro-batch of a group comes back round the
    ring just when the rank needs it: each of the 2·v·m/N chunk visits per step waits for the
    ring's p hops, 2·v·one per micro-batch — what the p2p term charges for every schedule.
    A group of N > p leaves the rank N − p more micro-batches of the chunk (chunk_s each, its
    forward + backward) to compute before it needs the first one back, behind which the ring's
    hops run: max(0, p·one − (N − p)·chunk_s) per visit — as far as communication overlaps
    compute (`overlap`, Cluster.comm_overlap). The rest, 1 − overlap of every hop, costs its
    time as with N = p: on CPU ranks that fill every core (overlap ~0) a hop is work the rank
    does, not a wait it hides (a group of N = 8 at p = 2 priced with its hops hidden measured
    22% slower than priced, 2026-11-27, calibrate's overlap 0.10). A GPU (overlap 1): what
    outlasts the compute.
    """
    hidden = 2 * v * max(0.0, p * one_s - (group - p) * chunk_s) / group
    return (1.0 - overlap) * 2 * v * one_s + overlap * hidden
