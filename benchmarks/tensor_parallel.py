"""Benchmark: autopar tensor parallelism (t=2, 2 CPU gloo ranks) vs PyTorch DTensor TP vs 1 process.

    python benchmarks/tensor_parallel.py [--sizes 512,1024] [--layers 2] [--seq 256] [--rounds 3]

The model is the examples' Llama-style decoder (separate q/k/v, SwiGLU). The DTensor version is
written by hand the usual way (torchtitan): ColwiseParallel on q/k/v/gate/up, RowwiseParallel on
o/down, the attention modules' head counts divided by t; embedding and LM head replicated.
autopar splits the same model automatically (plus vocab-parallel embedding / head / loss) and,
as compile() does, fuses each column-parallel entry with its projections so that the backward
all-reduce runs under the weight gradients (passes/overlap.py).
Fairness: every process — each of the 2 ranks and the one-process baseline — runs with
torch.set_num_threads(1) (2 cores: one per rank), the same model, data, optimizer (AdamW) and
step (forward + loss + backward + step); 2 warm-up steps, then the median of --steps steps.
All five variants (one process, autopar t=2 without and with sequence parallelism, DTensor,
autopar t=2 without passes/overlap.py: no collective matmul, no backward overlap)
are measured in this one run, each in fresh processes, never concurrently, --rounds times in
rotating order; each variant's time is the median of its rounds (this host's speed drifts by
tens of percent over minutes, so one run of each was a coin toss). Two sizes: hidden 512, and
hidden 1024 (16 heads, FFN 4096, seq 256, batch 4), which is compute-bound: per layer and
step the matmuls are ~100 GFLOP while the tensor-parallel all-reduces move 4 × 4 MB.
`--sizes 2048` adds a more compute-bound point (4× the matmul work per all-reduced byte of
hidden 512, ~12 minutes more): there the speed-up nears 2 and autopar's edge over DTensor
shrinks to what the vocab-parallel head saves (both run the same local matmuls).
Printed: per size, the median step times, every round's, and the ratios.
Targets (issue 3): autopar ≤ 0.9 × DTensor, and ≥ 1.7 × speed-up over one process when the
model is compute-bound; issue 28: ≤ 0.85 × DTensor, and with overlap faster than without.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from autopar.examples.gpt import lm_cross_entropy
from autopar.examples.llama import LlamaStyle, LlamaStyleConfig


def _config(a: argparse.Namespace) -> LlamaStyleConfig:
    return LlamaStyleConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers,
                            n_head=a.heads, n_kv_head=a.heads, n_embd=a.hidden,
                            ffn_hidden=4 * a.hidden)


def _data(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
    return ids, torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)


WARMUP = 2
# From hidden 1024 the matmuls are ~87% of one process's step (profiled: 2.89 s of ~3.3 s) and
# the all-reduced bytes per matmul FLOP halve with every doubling of hidden.
COMPUTE_BOUND_HIDDEN = 1024


def _time_steps(step, params, steps: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    opt = torch.optim.AdamW(params, lr=1e-4)
    times, loss = [], 0.0
    for i in range(steps + WARMUP):
        t0 = time.perf_counter()
        opt.zero_grad()
        out = step()
        out.backward()
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        loss = float(out.detach())
    return statistics.median(times), loss


def _single(rank: int, world: int, a: argparse.Namespace) -> tuple[float, float]:
    torch.manual_seed(0)
    model = LlamaStyle(_config(a))
    ids, tgt = _data(a)
    return _time_steps(lambda: lm_cross_entropy(model(ids), tgt), list(model.parameters()),
                       a.steps)


def _autopar(rank: int, world: int, a: argparse.Namespace) -> tuple[float, float]:
    import torch.distributed as dist
    from autopar.passes.capture import capture
    from autopar.passes.overlap import overlap_tp_backward
    from autopar.passes.tensor_parallel import apply_tensor_parallel
    torch.manual_seed(0)
    model = LlamaStyle(_config(a))
    ids, tgt = _data(a)
    gm = capture(model, (ids,), lm_cross_entropy, tgt).gm
    gm = apply_tensor_parallel(gm, world, rank, dist.group.WORLD,
                               sequence_parallel=bool(getattr(a, "sp", False)))
    if getattr(a, "overlap", True):   # as compile() does (every schedule but interleaved-zb)
        gm = overlap_tp_backward(gm)
    return _time_steps(lambda: gm(ids, tgt), list(gm.parameters()), a.steps)


def _dtensor(rank: int, world: int, a: argparse.Namespace) -> tuple[float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    model = LlamaStyle(_config(a))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})
        layer.attn.n_head //= world        # local heads: the hand-written part of DTensor TP
        layer.attn.n_kv_head //= world
    ids, tgt = _data(a)
    return _time_steps(lambda: lm_cross_entropy(model(ids), tgt), list(model.parameters()),
                       a.steps)


VARIANTS = ("one process", "autopar t=2", "autopar t=2 + SP", "DTensor t=2",
            "autopar t=2 no overlap")


def _run_variant(name: str, a: argparse.Namespace) -> tuple[float, float]:
    from autopar.testing import spawn
    if name == "one process":
        return spawn(_single, 1, a, timeout_s=600)[0]
    fn, args = (_dtensor, a) if name.startswith("DTensor") else (
        _autopar, argparse.Namespace(**{**vars(a), "sp": name.endswith("SP"),
                                        "overlap": not name.endswith("no overlap")}))
    res = spawn(fn, 2, args, timeout_s=600)
    return max(r[0] for r in res), res[0][1]


def _measure(a: argparse.Namespace) -> dict[str, tuple[float, list[float], float]]:
    """Per variant: the median over rounds of its step time, every round's, and its loss. The
    order rotates every round so that no variant always runs first (the host's speed drifts
    by tens of percent over minutes)."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    loss: dict[str, float] = {}
    for r in range(a.rounds):
        k = r % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            step_s, loss[v] = _run_variant(v, a)
            times[v].append(step_s)
    return {v: (statistics.median(ts), ts, loss[v]) for v, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="512,1024",
                   help="hidden sizes, comma-separated (heads = hidden / 64, FFN 4 x hidden); "
                        "2048 is the most compute-bound point (~12 min)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(f"threads per process: 1 (torch.set_num_threads(1)); per run {WARMUP} warm-up steps, "
          f"median of {a.steps}; per variant the median of {a.rounds} runs in fresh processes, "
          f"variants in rotating order")
    for hidden in (int(h) for h in a.sizes.split(",")):
        args = argparse.Namespace(**{**vars(a), "hidden": hidden, "heads": hidden // 64})
        res = _measure(args)
        t_single, t_auto, t_sp, t_dt, t_plain = (res[v][0] for v in VARIANTS)
        print(f"\nLlama-style h={hidden} heads={args.heads} layers={a.layers} seq={a.seq} "
              f"batch={a.batch} vocab={a.vocab}")
        print(f"{'':20}{'step s':>9}{'loss':>9}   runs")
        for v in VARIANTS:
            print(f"{v:20}{res[v][0]:>9.4f}{res[v][2]:>9.4f}   "
                  + " ".join(f"{x:.3f}" for x in res[v][1]))
        vs_dt, speedup = t_auto / t_dt, t_single / t_auto
        print(f"autopar / DTensor step time: {vs_dt:.2f}  (target <= 0.90: "
              f"{'met' if vs_dt <= 0.9 else 'MISSED'})")
        verdict = ("met" if speedup >= 1.7 else "MISSED") if hidden >= COMPUTE_BOUND_HIDDEN \
            else f"n/a: compute-bound from hidden {COMPUTE_BOUND_HIDDEN}"
        print(f"speed-up over one process:   {speedup:.2f}  (target >= 1.70 at a compute-bound "
              f"size: {verdict}); with sequence parallelism {t_single / t_sp:.2f}")
        print(f"with TP overlap / without (passes/overlap.py: collective matmuls, backward "
              f"all-reduce under dW): {t_auto / t_plain:.2f}  (target < 1)")
    print("\nwhy the ratios move with size: at small sizes DTensor's per-op dispatch and its "
          "replicated embedding / LM head cost it time that autopar does not spend; at "
          "compute-bound sizes both run the same local matmuls and all-reduces, and autopar's "
          "edge is the vocab-parallel head and the backward all-reduce hidden under the weight "
          "gradients (passes/overlap.py). The speed-up's ideal is 2.0; what is lost is "
          "communication over loopback gloo, the replicated work (norms, rotary, optimizer on "
          "replicated parameters) and how fast two single-threaded GEMMs run at once on the "
          "host's 2 cores (measured 1.2-2.1x here)")


if __name__ == "__main__":
    main()
