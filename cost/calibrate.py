"""`autopar calibrate`: measure a cluster (this machine, or the nodes torchrun runs on) and
write its cluster file (cost/hardware.py `save_cluster`).

Every rank measures at the same time, as training runs them (ranks that share a CPU or a node
contend as they will in training), in the training precision (fp32 on CPU, bf16 on GPU unless
told); each timing the best of a few batches, and every compute measurement (the grids, the
host's per-op work, the optimizer) taken in two rounds spread over the calibration, the best
of each kept (other load on a machine only ever adds time); compute on a CPU rank of
one thread timed in the process's CPU time (`compute_clock`: a shared machine's other
processes do not slow the rate measured); rank 0 fits and writes:
- GEMM curve [m, n, k, flops_per_s] over a grid of shapes, each a projection's forward and
  backward under autograd (as training runs its GEMMs) → `peak_flops` (the fitted
  asymptote, or a datasheet peak given with peak_flops=) with `gemm_max_efficiency` and
  `gemm_half_dim` of rate = peak · e_max · f(m)f(n)f(k), f(x) = x / (x + half).
- Fused attention (torch's scaled_dot_product_attention, causal, 4 heads of 64) forward and
  backward against sequence length, and at one length against head dim (16-128 on a CPU,
  64-256 on a GPU) → `flash_fwd_efficiency`, `flash_bwd_efficiency`, `flash_half_len`,
  `flash_half_head_dim` (backward FLOPs 2.5 × forward, cost.model's convention).
- Streaming bandwidth (a large copy: bytes read + written per second) → `hbm_bandwidth_Bps`
  (elementwise_efficiency 1: the measured rate is the achieved one); per op of a transformer
  block's non-GEMM op mix on tiny tensors (norms, views, softmax, adds, the activation) its
  forward → `kernel_launch_s` (dispatch + launch) and what its backward adds →
  `autograd_op_s`; torch.optim.AdamW's step over one block's
  parameters → `optimizer_param_s` (seconds per parameter), and over many tiny tensors →
  `optimizer_tensor_s` (seconds per tensor beyond its elements); interleaved-zb's B/W split
  per op and per saved byte, fitted on two GPT blocks at three sizes → `split_backward_op_s`,
  `split_backward_s_per_byte`;
  recompute op's selective checkpoint per counted op of two blocks → `checkpoint_op_s`;
  torch.utils.checkpoint per region beyond its recomputation → `checkpoint_region_s`.
  (These compute measurements and the timing helpers: cost/calibrate_compute.py.)
- Every collective the plans use — all-reduce, all-gather, reduce-scatter, all-to-all (the
  runtime's calls), send/recv (both ranks' isend + irecv at once, as ring attention's steps
  run) and the pipeline's hop (a relay: one rank sends, its peer blocked on a pre-posted
  irecv wakes and sends back; half the round trip) — each call
  issued after a short GEMM and the mean of many taken, not the best (what training pays:
  `measure_collectives`), at several sizes, inside a node and across nodes (ranks
  grouped by node from the launcher's environment: GROUP_RANK, else rank // LOCAL_WORLD_SIZE);
  per link one (latency, bandwidth) fitted by least squares (relative error) to every timing
  but the hop's with cost.model's formulas (all-reduce 2(n-1)/n · B, all-gather /
  reduce-scatter / all-to-all (n-1)/n · B of the whole, send B). A link with no pair of ranks
  on it is not measured and takes the other link's numbers (said in the sources).
- Overlap: how much of an all-reduce hides behind compute run meanwhile → `comm_overlap`.
- Memory: the GPU's total (its free memory at start → reserved_bytes); on CPU the RAM over the
  ranks of a node.
The file's `calibration` record says what was measured, on which hosts, when, and holds the
raw curves and per-collective fits.

Run: `torchrun --nproc-per-node=8 -m autopar.cli calibrate --out my-cluster.json` on each node
(`--nnodes`, a rendezvous), or `autopar calibrate` alone: 2 local CPU ranks, written as this
machine's `local-cpu` (hardware.local_cluster_path()).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from autopar.cost.calibrate_compute import (attention_head_dim, grids, measure_attention,
                                            measure_attention_dims, measure_matmul,
                                            measure_optimizer, measure_streaming, timed_s)
from autopar.cost.compute import flash_shape_fraction
from autopar.cost.hardware import (GB, Cluster, CollectiveCurve, get_cluster,
                                   local_cluster_path, save_cluster)
from autopar.cost.overlap import ROW_PIECES

_FULL_MSG_BYTES = (4, 1 << 12, 1 << 16, 1 << 20, 1 << 23)   # 4 B .. 8 MiB
# calls a collective's timed batch holds (a quarter above 1 MiB): enough that the rare long
# waits training pays are in every batch at their rate (`measure_collectives`)
COLLECTIVE_CALLS = 100
_QUICK_MSG_BYTES = (1 << 10, 1 << 18)
# the collectives a link's (latency, bandwidth) is fitted to (`fit_link`), and all measured:
# the pipeline's hop besides (a relay: no wake-up a collective pays is in it; its own curve)
LINK_FITTED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
COLLECTIVES = LINK_FITTED + ("hop",)


# ---- collectives ----

def _node_layout() -> tuple[list[int], int]:
    """(node of every rank, this rank's node), from the launcher's environment."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    node = int(os.environ.get("GROUP_RANK", dist.get_rank() // max(local, 1)))
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    return [int(n) for n in nodes], node


def link_groups(nodes: list[int]) -> dict[str, list[list[int]]]:
    """The rank groups each link is measured on: "intra" the ranks of each node (two or more),
    "inter" one rank per node, the i-th of each (when there are two nodes or more)."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    members = list(by_node.values())
    intra = [ranks for ranks in members if len(ranks) > 1]
    inter = []
    if len(members) > 1:
        for i in range(min(len(r) for r in members)):
            inter.append([ranks[i] for ranks in members])
    return {"intra": intra, "inter": inter}


def _collective_fns(name: str, nbytes: int, group: Any, ranks: list[int], device: torch.device):
    """(fn, result bytes the cost model prices) of one collective on `nbytes` (the whole)."""
    from autopar.runtime import collectives as C

    n = len(ranks)
    elems = max(n, (nbytes // 4) // n * n)
    buf = torch.ones(elems, device=device)
    part = torch.ones(elems // n, device=device)
    me = ranks.index(dist.get_rank())
    if name == "all_reduce":
        return (lambda: C.all_reduce_(buf, group)), elems * 4
    if name == "all_gather":
        return (lambda: C.all_gather(part, 0, group)), elems * 4
    if name == "reduce_scatter":
        return (lambda: C.reduce_scatter(buf, 0, group)), elems * 4
    if name == "all_to_all":
        out = torch.empty_like(buf)
        return (lambda: dist.all_to_all_single(out, buf, group=group)), elems * 4
    peer = ranks[1 - me] if me < 2 else None
    inbox = torch.empty_like(buf)

    gloo = dist.get_backend(group) == "gloo"

    def exchange():   # ranks 0 and 1 of the group send each other a message, as the ring's
        if me < 2:    # steps run (autopar.runtime.ring_attention): isend and irecv together
            if gloo:
                works = [dist.irecv(inbox, peer, group=group), dist.isend(buf, peer, group=group)]
            else:     # NCCL runs separate p2p calls in order on one stream: batched, as the ring
                works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, inbox, peer, group),
                                                dist.P2POp(dist.isend, buf, peer, group)])
            for w in works:
                w.wait()

    def relay():      # a pipeline's hops: rank 0 sends; rank 1, blocked on the irecv it posted,
        if me == 0:   # wakes and sends back, which rank 0 waits for on its own irecv, posted
            sent = dist.isend(buf, peer, group=group)    # after its send (in-order streams
            back = dist.irecv(inbox, peer, group=group)  # would otherwise hold each other)
            back.wait()
            sent.wait()
        elif me == 1:
            dist.irecv(inbox, peer, group=group).wait()
            dist.isend(buf, peer, group=group).wait()
    return (relay if name == "hop" else exchange), elems * 4


def _factor(name: str, n: int) -> float:
    """Bytes over bandwidth the cost model charges per byte of the whole (cost/model.py)."""
    if name == "all_reduce":
        return 2.0 * (n - 1) / n
    return 1.0 if name == "send_recv" else (n - 1) / n


def measure_collectives(groups: dict[str, list[list[int]]], device: torch.device,
                        quick: bool, tick: Callable[[str], None]) -> dict[str, Any]:
    """{link: {collective: [[bytes, n, seconds], ...]}} measured on this rank's groups (every
    rank creates every group, in the same order; ranks in none wait at the barrier). Each
    timing is the mean call of 3 batches of COLLECTIVE_CALLS, every call issued after a short
    GEMM (`_after_compute_s`), as training issues its collectives between kernels: a rank
    blocked in a collective is woken when the data is there, and on a virtual machine that
    wake-up waits for the next timer tick now and then (on the 2-core development host ~15%
    of gloo all-reduces back to back took 4 or 8 ms where the median took 0.3; after a GEMM
    every call from 16 KB to 256 KB, all-reduce or send/recv, took 0.8-1.2 ms). Training pays
    every call's wait, so the best of a few short batches back to back (what calibrate took
    until 2026-11-26) priced the host's tensor- and context-parallel steps 1.5-2× fast; where
    waking is prompt (NCCL on a GPU) this is the call's own time.

    The batches go in rounds over every (collective, size) of a link, not three back to back:
    how often those waits come drifts over seconds, and three batches within a third of a
    second caught one collective at one rate and the next at another (the send/recv exchange
    at 64 KiB read 0.53 – 1.89 ms in five calibrations of one afternoon, 2026-11-27, while
    the all-reduce beside it stayed within ±12%), which priced ring attention −16% in one
    calibration and +15% in the next; in rounds each timing spans the link's whole
    measurement."""
    sizes = _QUICK_MSG_BYTES if quick else _FULL_MSG_BYTES
    burst = _burst(device)
    calls = COLLECTIVE_CALLS if not quick else 10
    rounds = 2 if quick else 3
    dist.barrier()   # the burst alone, every rank at once (as it runs beside each collective)
    burst_s = timed_s(burst, device, calls, rounds, typical=True)
    out: dict[str, Any] = {}
    for link, lists in groups.items():
        mine = None
        for ranks in lists:
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = (group, ranks)
        taken: dict[tuple[str, int], list[float]] = {}
        for r in range(rounds):
            for name in COLLECTIVES:
                if r == rounds - 1:
                    tick(f"{link}-node {name.replace('_', '-')}")
                for nbytes in sizes:
                    dist.barrier()
                    if mine is None:
                        continue
                    # buffers made per batch, as before: a calibration holds one size's
                    # (its device memory reading comes after)
                    fn, whole = _collective_fns(name, nbytes, *mine, device)
                    taken.setdefault((name, whole), []).append(_after_compute_s(
                        fn, burst, burst_s, device,
                        calls if nbytes <= (1 << 20) else calls // 4, 1))
        rows: dict[str, list] = {name: [] for name in COLLECTIVES}
        for (name, whole), times in taken.items():   # a relay's call is a round trip: 2 hops
            rows[name].append([whole, len(mine[1]),
                               float(np.mean(times)) / (2 if name == "hop" else 1)])
        if lists:
            out[link] = rows
    return out


def measure_overlap(dtype: torch.dtype, device: torch.device, quick: bool) -> float:
    """The fraction of a collective that hides behind compute run meanwhile, every rank at
    once: an all-reduce of 4 MiB over all ranks (async) and a GEMM loop (a projection's
    forward + backward), timed alone and together in rounds; 1 − the median over rounds of
    (together − compute alone) / collective alone, each round's three timings back to back
    (the slowest rank's), clipped to [0, 1]. A GPU's collectives run beside its kernels (~1);
    CPU ranks that fill every core leave none to move the data (~0). Paired per round and the
    median taken: on 2 CPU ranks the compute alone wandered ±30% between batches, more than
    the all-reduce's whole time, and one ratio of three best-of-5 timings read 0.0, 0.10 and
    0.79 in three calibrations minutes apart (2026-11-27)."""
    buf = torch.ones((1 << 20) if not quick else (1 << 16), dtype=torch.float32, device=device)
    x = torch.randn(256, 256, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(256, 256, dtype=dtype, device=device, requires_grad=True)

    loops = 1   # sized below, before the rounds: compute reads it when it runs

    def compute():
        for _ in range(loops):
            x.grad = w.grad = None
            torch.nn.functional.linear(x, w).sum().backward()

    def comm():
        dist.all_reduce(buf)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()
    # the GEMM loop sized to ~1.5x the collective (the slowest rank's), every rank the same:
    # room to hide it all, and compute's own wander small against the collective's time
    sizes = torch.tensor([timed_s(comm, device, 2, 3), timed_s(compute, device, 2, 3)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    loops = max(1, min(64, round(1.5 * sizes[0].item() / max(sizes[1].item(), 1e-9))))
    rounds = []
    for _ in range(5 if quick else 15):
        row = []
        for fn in (compute, comm, both):
            dist.barrier()
            row.append(timed_s(fn, device, 2, 1))
        rounds.append(row)
    # the slowest rank's times (the step waits for it): every rank computes the same fraction
    slowest = torch.tensor(rounds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    exposed = [(together - alone_c) / max(alone_m, 1e-9)
               for alone_c, alone_m, together in slowest.tolist()]
    return float(min(1.0, max(0.0, 1.0 - float(np.median(exposed)))))


def _burst(device: torch.device) -> Callable[[], Any]:
    """A short GEMM (~0.2 ms on a CPU core): what a rank computes between two collectives."""
    x = torch.randn(256, 128, device=device)
    w = torch.randn(256, 128, device=device)
    return lambda: torch.nn.functional.linear(x, w)


def _after_compute_s(fn: Callable[[], Any], burst: Callable[[], Any], burst_s: float,
                     device: torch.device, calls: int, repeats: int) -> float:
    """Seconds of `fn` issued after `burst` (`measure_collectives`): the typical (mean) call of
    burst + fn less `burst_s`, the typical burst alone (timed once, as this), in wall time."""
    both = timed_s(lambda: (burst(), fn()), device, calls, repeats, typical=True)
    return max(both - burst_s, 1e-7)


# the least share of the largest message's time its bytes must take in a fitted link for the
# bandwidth to count as measured (`fit_link`; a quick calibration's 256 KiB calls on the 2-vCPU
# development VM, ~1 ms of waits each, fitted 34 TB/s: a transfer of 1e-8 of their time)
_IDENTIFIED = 0.05


def fit_link(rows: dict[str, list]) -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) minimising the relative error of lat + factor · B / bw over
    every timing of the LINK_FITTED collectives (numpy least squares, weights 1 / measured)."""
    a, y = [], []
    rows = {name: table for name, table in rows.items() if name in LINK_FITTED}
    for name, table in rows.items():
        for nbytes, n, seconds in table:
            a.append([1.0 / seconds, _factor(name, n) * nbytes / seconds])
            y.append(1.0)
    (lat, inv_bw), *_ = np.linalg.lstsq(np.array(a), np.array(y), rcond=None)
    nbytes, n, seconds = max((r for t in rows.values() for r in t), key=lambda r: r[0])
    if inv_bw * nbytes < _IDENTIFIED * seconds:
        # latency-bound timings (even the largest message's time is nearly all latency, or
        # noise: the waits a call pays make small differences of sizes): the bandwidth is
        # not identified by them; the largest message's, all of its time taken as transfer
        inv_bw = seconds / nbytes
    return max(float(lat), 0.0), 1.0 / float(inv_bw)


def collective_curves(link: str, rows: dict[str, list], as_link: str | None = None
                      ) -> list[CollectiveCurve]:
    """Each collective's measured curve on `link` (labelled `as_link` when it stands in for
    an unmeasured one), one per group size: every size's timings of every rank, their
    median (ranks of one call finish together; the median drops one rank's disturbed batch)."""
    out = []
    for name, table in rows.items():
        for n in sorted({int(r[1]) for r in table}):
            sizes = sorted({float(r[0]) for r in table if int(r[1]) == n})
            secs = [float(np.median([r[2] for r in table if int(r[1]) == n and r[0] == b]))
                    for b in sizes]
            out.append(CollectiveCurve(link=as_link or link, kind=name, ranks=n,
                                       bytes=tuple(sizes), seconds=tuple(secs)))
    return out


def fit_gemm(curve: list[list[float]], floor_s: float = 0.0,
             priced_s: float = 0.0) -> tuple[float, float]:
    """(asymptotic FLOP/s P, half_dim) of rate = P · f(m)f(n)f(k) (least squares of the
    relative error: P closed-form for each half_dim on a log grid). `floor_s`: the measured
    step's own dispatch (cost.hardware.Cluster kernel_launch_s, autograd_op_s); a shape whose
    step takes under twice that is timing the dispatch, not the GEMM (on a GPU, every shape
    up to ~1024³), and is left out of the fit while at least 3 shapes remain. `priced_s`: what
    the cost model adds to the step's GEMMs apart from their rate (a launch each,
    cost/compute.py `gemm_time_s`), taken off each step's time before its rate is fitted:
    fitted with it in, a CPU's curve priced those launches twice (the 128-512 shapes 5% slow)
    and put the asymptote ~8% over the 512-1024 shapes' plateau to make up for it."""
    slow = [r for r in curve if 6.0 * r[0] * r[1] * r[2] / r[3] >= 2.0 * floor_s]
    curve = slow if len(slow) >= 3 else curve
    if priced_s > 0:
        flops = [6.0 * m * n * k for m, n, k, _ in curve]
        rest = [(r, f / r[3] - priced_s) for r, f in zip(curve, flops)]
        curve = [r[:3] + [f / t] for (r, t), f in zip(rest, flops) if t > 0] or curve
    best = (max(r[3] for r in curve), 1.0, float("inf"))
    for half in [0.0] + [2.0 ** (i / 4) for i in range(0, 45)]:
        x = np.array([(m / (m + half)) * (n / (n + half)) * (k / (k + half))
                      for m, n, k, _ in curve])
        y = np.array([r[3] for r in curve])
        peak = float(x @ y / (x @ x))
        err = float(np.sum(((peak * x - y) / y) ** 2))
        if err < best[2]:
            best = (peak, half, err)
    return best[0], best[1]


def dispatch_floor_s(record: dict[str, Any]) -> float:
    """What one measured GEMM step (y = x·Wᵀ forward and backward) spends dispatching, by the
    record's own per-op numbers: 3 kernels launched and one autograd node. On an asynchronous
    device (a GPU: the host queues the kernels and runs ahead) a step takes the longer of its
    host work and its device work, and the host's part is more than those ops: each call's
    Python backward() hands the graph to the engine's device thread — 120-190 µs a step on
    the H200 (2026-11-27) against the 101 µs counted, so shapes up to 1024 x 4096 x 2048 still
    timed the host and the fit took e_max 1.0, half dim 2048 (a 1.3B GPT's step priced 2x
    slow). There the grid's smallest shape, whose device work is a few µs, times the floor."""
    counted = 3.0 * record.get("kernel_launch_s", 0.0) + record.get("autograd_op_s", 0.0)
    curve = record.get("matmul_curve") or []
    if record.get("device", "cpu") == "cpu" or not curve:
        return counted
    m, n, k, rate = min(curve, key=lambda r: r[0] * r[1] * r[2])
    return max(counted, 6.0 * m * n * k / rate)


def fit_flash(curve: list, peak: float, dims: list | None = None,
              head_dim: float = 64.0) -> dict[str, float]:
    """e_fwd, e_bwd, L_half and D_half of rate = e · peak · L/(L + L_half) · D/(D + D_half),
    least squares (e ≤ 1) over the length curve (rows [L, fwd, bwd], heads of `head_dim`) and
    the head-dim curve (rows [L, D, fwd, bwd]); without a head-dim curve (a record from
    before it was measured) D_half is 0, not modelled."""
    rows = [(row[0], head_dim, row[1:]) for row in curve] + [
        (row[0], row[1], row[2:]) for row in dims or []]
    grid = [0.0] + [2.0 ** (i / 4) for i in range(0, 53)]          # 0, 1 .. 8192
    best: dict[str, float] = {}
    best_err = float("inf")
    for half in grid:
        for dhalf in (grid[:45] if dims else [0.0]):                # 0, 1 .. 2048
            fit, err = {"flash_half_len": half, "flash_half_head_dim": dhalf}, 0.0
            xs = np.array([flash_shape_fraction(L, D, half, dhalf) for L, D, _ in rows])
            for col, name in ((0, "flash_fwd_efficiency"), (1, "flash_bwd_efficiency")):
                ys = np.array([rates[col] / peak for _, _, rates in rows])
                fit[name] = float(min(1.0, max(xs @ ys / (xs @ xs), 1e-3)))
                err += float(np.sum((fit[name] * xs - ys) ** 2))
            if err < best_err:
                best, best_err = fit, err
    return best


# ---- one calibration run ----

def _device() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), torch.bfloat16
    return torch.device("cpu"), torch.float32


def _progress(total: int) -> Callable[[str], None]:
    """Rank 0's progress bar (tqdm on stderr); other ranks get a no-op."""
    if dist.get_rank() != 0:
        return lambda what: None
    from autopar.progress import tqdm_bar
    bar = tqdm_bar(total=total, desc="calibrate", unit="step", leave=True)

    def tick(what: str) -> None:
        bar.set_postfix_str(f"{what} done")
        bar.update(1)
        if bar.n >= total:
            bar.close()
    return tick


def _memory(device: torch.device, ranks_per_node: int) -> tuple[float, float, str]:
    """(memory_bytes, reserved_bytes, source) of one rank."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return float(total), float(total - free), (
            "memory_bytes: torch.cuda.mem_get_info total; reserved_bytes: what was already in "
            "use when calibrate started (CUDA context, other processes)")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(ram) / ranks_per_node, 0.5 * GB, (
        f"memory_bytes: the RAM ({ram / GB:.1f} GB) over the {ranks_per_node} ranks of a node; "
        f"reserved_bytes 0.5 GB: interpreter and allocator (not fitted)")


def _best_rows(passes: list[list[list[float]]], cols: int) -> list[list[float]]:
    """Row by row, the best (highest) rate of several passes over the same grid: a pass
    that other load slowed is not the hardware's rate."""
    return [list(rows[0][:cols]) + [max(r[j] for r in rows) for j in range(cols, len(rows[0]))]
            for rows in zip(*passes)]


def _least_host_work(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per measurement, the best of rounds spread over the calibration: the least seconds, the
    highest bandwidth. A host's slow spells last seconds to minutes, longer than one
    measurement's batches back to back: measured once, recompute op's per-op work read 121 µs
    in one calibration against 71–77 in three others (2026-11-28), which priced op plans 14%
    slow; rounds apart (a GEMM and an attention pass between them) a spell falls on one."""
    return {k: (max if k.endswith("_Bps") else min)(r[k] for r in rounds) for k in rounds[0]}


def _mean_curves(curves: list[list[list[float]]], cols: int) -> list[list[float]]:
    """Every rank's curve averaged row by row in its measured columns (the rate the ranks
    reached together)."""
    out = []
    for rows in zip(*curves):
        head = list(rows[0][:cols])
        out.append(head + [float(np.mean([r[j] for r in rows])) for j in range(cols, len(rows[0]))])
    return out


def measure_ranks(*, quick: bool = False, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Every rank's measurements (call on every rank of an initialised process group); rank 0
    returns the gathered record, the others {}."""
    device, default_dtype = _device()
    dtype = dtype or default_dtype
    if device.type == "cpu":   # the allocator a CPU rank trains with (autopar.compile's)
        from autopar.runtime.host_memory import keep_freed_memory
        keep_freed_memory()
    nodes, _ = _node_layout()
    groups = link_groups(nodes)
    tick = _progress(3 + len(COLLECTIVES) * sum(1 for v in groups.values() if v))
    dims, lens, head_dims = grids(device, quick)
    dist.barrier()
    # rounds over all of the compute measurements, the best of each kept (`_least_host_work`)
    rounds = 1 if quick else 2
    gemm, attention, heads, host = [], [], [], []
    for r in range(rounds):
        last = r == rounds - 1
        gemm.append(measure_matmul(dims, dtype, device, quick))
        if last:
            tick("GEMM")
        attention.append(measure_attention(lens, dtype, device, quick))
        heads.append(measure_attention_dims(head_dims, dtype, device, quick))
        if last:
            tick("attention")
        work = measure_streaming(dtype, device, quick)
        work["optimizer_param_s"], work["optimizer_tensor_s"] = measure_optimizer(
            dtype, device, quick)
        host.append(work)
        if last:
            tick("streaming")
    mine = {"matmul_curve": _best_rows(gemm, 3), "attention_curve": _best_rows(attention, 1),
            "attention_dims": _best_rows(heads, 2), **_least_host_work(host)}
    collectives = measure_collectives(groups, device, quick, tick)
    mine["comm_overlap"] = measure_overlap(dtype, device, quick) if len(nodes) > 1 else 1.0
    per_node = max(nodes.count(n) for n in set(nodes))
    memory = _memory(device, per_node)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, collectives, socket.gethostname(), memory))
    if dist.get_rank() != 0:
        return {}
    links: dict[str, Any] = {}
    for _, coll, _, _ in gathered:   # each link's rows from every rank that measured it
        for link, rows in coll.items():
            merged = links.setdefault(link, {name: [] for name in COLLECTIVES})
            for name, table in rows.items():
                merged[name].extend(table)
    return {
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "hosts": sorted({g[2] for g in gathered}), "world": len(nodes),
        "nodes": len(set(nodes)), "ranks_per_node": per_node,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(), "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "quick": quick,
        "matmul_curve": _mean_curves([g[0]["matmul_curve"] for g in gathered], 3),
        "attention_curve": _mean_curves([g[0]["attention_curve"] for g in gathered], 1),
        "attention_dims": _mean_curves([g[0]["attention_dims"] for g in gathered], 2),
        "attention_head_dim": attention_head_dim(device),
        "hbm_bandwidth_Bps": float(np.mean([g[0]["hbm_bandwidth_Bps"] for g in gathered])),
        **{key: float(np.median([g[0][key] for g in gathered]))    # the ranks' median
           for key in ("kernel_launch_s", *_MEASURED_CONSTANTS, "comm_overlap")},
        "collectives": links, "memory": gathered[0][3][:2], "memory_source": gathered[0][3][2],
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else (os.cpu_count() or 1),
    }


# the device's measured constants beyond the presets' (0 in a record from before one was
# measured: not counted), each the median over the ranks
_MEASURED_CONSTANTS = ("optimizer_param_s", "optimizer_tensor_s", "autograd_op_s",
                       "split_backward_op_s", "split_backward_s_per_byte", "checkpoint_op_s",
                       "checkpoint_region_s")
# ... and those a record may hold: a record from before 2026-11-28 priced the split beyond its
# ops as a share of the compute (split_backward_frac), which its cluster keeps
_DEVICE_CONSTANTS = (*_MEASURED_CONSTANTS, "split_backward_frac")


def _device_constants(record: dict[str, Any]) -> dict[str, float]:
    """The Cluster fields of `_DEVICE_CONSTANTS` as the record has them (0 where it has none)."""
    return {key: record.get(key, 0.0) for key in _DEVICE_CONSTANTS}


def cluster_from_record(record: dict[str, Any], name: str,
                        peak_flops: float | None = None, base: Cluster | None = None) -> Cluster:
    """The Cluster a measurement record describes, each constant's source naming it. With no
    link measured (one rank: a single GPU) the links are `base`'s, said so in the sources."""
    where = (f"measured by `autopar calibrate` on {', '.join(record['hosts'])} at "
             f"{record['measured_at']} ({record['world']} ranks, {record['nodes']} node(s), "
             f"{record['device']}, {record['backend']}, {record['dtype']})")
    asymptote, half = fit_gemm(record["matmul_curve"], dispatch_floor_s(record),
                               3.0 * record["kernel_launch_s"])   # forward + backward GEMMs
    peak = peak_flops or asymptote
    emax = min(1.0, asymptote / peak)
    flash = fit_flash(record["attention_curve"], peak * emax, record.get("attention_dims"),
                      record.get("attention_head_dim", 64))
    fits = {link: fit_link(rows) for link, rows in record["collectives"].items()}
    sources = [f"all constants below {where}",
               f"peak_flops, gemm_max_efficiency, gemm_half_dim: fitted to the GEMM curve "
               f"({len(record['matmul_curve'])} shapes, forward + backward under autograd; "
               f"those timing their dispatch left out)" + (
                   "; peak_flops the datasheet's, as given" if peak_flops else
                   "; peak_flops the fitted asymptote, e_max 1"),
               "flash efficiencies, flash_half_len, flash_half_head_dim: fitted to the "
               "attention curves (forward, backward against sequence length and head dim)",
               "hbm_bandwidth_Bps: a large copy's bytes read + written per second "
               "(elementwise_efficiency 1: the measured rate is the achieved one)",
               "kernel_launch_s: per op of a block's non-GEMM op mix on tiny tensors, its "
               "forward (dispatch + launch); autograd_op_s: what its backward adds per op; "
               "split_backward_op_s, split_backward_s_per_byte: what interleaved-zb's B/W "
               "split adds to a backward per forward op and per saved byte, fitted on two "
               "GPT blocks at three sizes (widths 32-128, 1-8 sequences of 128; ops and bytes "
               "as the profile counts them); "
               "checkpoint_op_s: what recompute op's selective checkpoint adds per counted "
               "op of two transformer blocks (its forward, twice); checkpoint_region_s: what "
               "torch.utils.checkpoint costs per region beyond its recomputation, on an "
               "attention core (256 tokens, 8 MB streamed between forward and backward)",
               "optimizer_param_s: torch.optim.AdamW's step over one block's parameters "
               "(width 1024), seconds per parameter" if record.get("optimizer_param_s") else
               "optimizer_param_s: not measured (a record from before); Adam's bytes at HBM",
               "optimizer_tensor_s: its step over 32 tensors of 16 elements, per tensor, less "
               "their elements" if "optimizer_tensor_s" in record else
               "optimizer_tensor_s: not measured (a record from before); 0, not counted",
               record["memory_source"],
               "elementwise: eager (autopar's runtime runs its chunks op by op)",
               "comm_overlap: the part of a 4 MiB all-reduce that hid behind a GEMM loop run "
               "meanwhile, every rank at once (tp_comm_overlap the same)",
               f"tp_row_pieces {ROW_PIECES}: autopar's runtime issues a row-parallel GEMM's "
               f"reduction in that many calls (its collective matmul, cost/overlap.py)"]
    curves: list[CollectiveCurve] = []
    if not fits:
        return _with_base_links(record, name, peak, emax, half, flash, sources, base)
    for link, other in (("intra", "inter"), ("inter", "intra")):
        if link in fits:
            curves += collective_curves(link, record["collectives"][link])
            sources.append(f"{link}_node bandwidth, latency: fitted (least squares, relative "
                           f"error) to {', '.join(LINK_FITTED)} timings; collective_curves "
                           f"({link}): each collective's timings against size, as measured, "
                           f"and the pipeline's hop (a relay's half round trip)")
        else:
            fits[link] = fits[other]
            curves += collective_curves(other, record["collectives"].get(other, {}), link)
            sources.append(f"{link}_node bandwidth, latency, curves: not measured (no two "
                           f"ranks on that link); the {other}-node numbers")
    single_cpu_node = record["nodes"] == 1 and record["device"] == "cpu"
    return Cluster(
        name=name, gpus_per_node=record["cores"] if single_cpu_node else record["ranks_per_node"],
        peak_flops=peak, memory_bytes=record["memory"][0],
        hbm_bandwidth_Bps=record["hbm_bandwidth_Bps"],
        intra_node_bandwidth_Bps=fits["intra"][1], intra_node_latency_s=fits["intra"][0],
        inter_node_bandwidth_Bps=fits["inter"][1], inter_node_latency_s=fits["inter"][0],
        gemm_max_efficiency=emax, gemm_half_dim=half,
        kernel_launch_s=record["kernel_launch_s"], elementwise_efficiency=1.0,
        **_device_constants(record), comm_overlap=record.get("comm_overlap", 1.0),
        tp_comm_overlap=record.get("comm_overlap", 1.0),
        reserved_bytes=record["memory"][1], attention="flash", elementwise="eager",
        collective_curves=tuple(curves), tp_row_pieces=ROW_PIECES, **flash,
        sources=tuple(sources))


_ONE_RANK = ("calibrate: {world} rank measures no link (collectives need two ranks); run it "
             "with --ranks 2 or more (under torchrun: --nproc-per-node 2 or more), or pass "
             "--base CLUSTER to keep that cluster's link numbers beside this device's measured "
             "ones")


def _with_base_links(record: dict[str, Any], name: str, peak: float, emax: float, half: float,
                     flash: dict, sources: list[str], base: Cluster | None) -> Cluster:
    """One rank measured the device and no link: the links (bandwidths, latencies, curves,
    overlap) are the base cluster's; the device's numbers are the measured ones."""
    if base is None:
        raise ValueError(_ONE_RANK.format(world=record["world"]))
    sources.append(f"intra_node and inter_node bandwidth, latency, collective curves, "
                   f"comm_overlap, tp_comm_overlap, tp_row_pieces, gpus_per_node: not measured "
                   f"(one rank); {base.name}'s, as given with --base")
    return dataclasses.replace(
        base, name=name, peak_flops=peak, memory_bytes=record["memory"][0],
        hbm_bandwidth_Bps=record["hbm_bandwidth_Bps"], gemm_max_efficiency=emax,
        gemm_half_dim=half, kernel_launch_s=record["kernel_launch_s"],
        elementwise_efficiency=1.0, **_device_constants(record), reserved_bytes=record["memory"][1],
        attention="flash", elementwise="eager", **flash, sources=tuple(sources))


def calibrate_ranks(*, out: str | os.PathLike | None = None, name: str = "local-cpu",
                    quick: bool = False, peak_flops: float | None = None,
                    dtype: torch.dtype | None = None,
                    base: str | None = None) -> tuple[Cluster, Path] | None:
    """Measure (every rank of an initialised process group) and, on rank 0, write the cluster
    file to `out` (default: this machine's local-cpu file); rank 0 returns (Cluster, path)."""
    base_cluster = get_cluster(base) if base is not None else None   # bad name: before measuring
    record = measure_ranks(quick=quick, dtype=dtype)
    result = None
    if dist.get_rank() == 0:
        cluster = cluster_from_record(record, name, peak_flops, base_cluster)
        record["fits"] = {link: dict(zip(("latency_s", "bandwidth_Bps"), fit_link(rows)))
                          for link, rows in record["collectives"].items()}
        result = (cluster, save_cluster(cluster, local_cluster_path(out), record))
    dist.barrier()
    return result


def _spawned(rank: int, world: int, kwargs: dict[str, Any]):
    return calibrate_ranks(**kwargs)


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def calibrate(*, out: str | os.PathLike | None = None, name: str = "local-cpu",
              quick: bool = False, peak_flops: float | None = None, ranks: int | None = None,
              precision: str | None = None, timeout_s: float = 600.0,
              base: str | None = None) -> tuple[Cluster, Path]:
    """Calibrate: under torchrun (WORLD_SIZE set) on its ranks, joining or creating the
    process group; otherwise on `ranks` local processes: one per GPU (NCCL) where there are
    GPUs, else 2 CPU processes (gloo). Returns (Cluster, path) on rank 0 (None elsewhere).
    precision: "fp32" | "bf16" (default: bf16 on GPU, fp32 on CPU), the training precision the
    compute is measured in. base: the cluster whose link numbers a single rank keeps."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"calibrate: precision={precision!r}: must be one of "
                         f"{sorted(PRECISIONS)}, the precision you train in")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ranks is None:
        ranks = gpus or 2
    if gpus and ranks > gpus and "WORLD_SIZE" not in os.environ:
        raise ValueError(f"calibrate: --ranks {ranks}: more ranks than this machine's {gpus} "
                         f"GPU(s) (one rank per GPU); pass --ranks {gpus} or fewer")
    world = int(os.environ.get("WORLD_SIZE", ranks))
    if world == 1 and base is None:
        raise ValueError(_ONE_RANK.format(world=world))
    kwargs = dict(out=out, name=name, quick=quick, peak_flops=peak_flops,
                  dtype=PRECISIONS.get(precision), base=base)
    if "WORLD_SIZE" in os.environ:
        created = not dist.is_initialized()
        if created:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        result = calibrate_ranks(**kwargs)     # ends with a barrier: nothing in flight after
        if created:   # not left to interpreter exit: a rank whose gloo group was torn down
            dist.destroy_process_group()   # there aborted once ("terminate called"), 2026-11-27
        return result
    from autopar.testing import spawn
    return spawn(_spawned, ranks, kwargs, timeout_s=timeout_s,
                 pg_timeout_s=timeout_s / 2, backend="nccl" if gpus else "gloo")[0]
