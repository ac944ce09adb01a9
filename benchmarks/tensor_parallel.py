"""Benchmark: autopar tensor parallelism (t=2, 2 CPU gloo ranks) vs PyTorch DTensor TP vs 1 process.

    python benchmarks/tensor_parallel.py [--hidden 1024] [--layers 2] [--seq 256] [--steps 5]

The model is the examples' Llama-style decoder (separate q/k/v, SwiGLU). The DTensor version is
written by hand the usual way (torchtitan): ColwiseParallel on q/k/v/gate/up, RowwiseParallel on
o/down, the attention modules' head counts divided by t; embedding and LM head replicated.
autopar splits the same model automatically (plus vocab-parallel embedding / head / loss).
Fairness: every process — each of the 2 ranks and the one-process baseline — runs with
torch.set_num_threads(1) (2 cores: one per rank), the same model, data, optimizer (AdamW) and
step (forward + loss + backward + step); all variants live in ONE 2-rank process group and are
timed round-robin (one step of each per round; 2 warm-up rounds, then the median of --steps
rounds), so a load change on the shared machine hits them alike; the one-process step runs on
rank 0 while rank 1 sleeps in a barrier. A row with sequence parallelism is printed too. The default size
(hidden 1024, 16 heads, FFN 4096, seq 256, batch 4) is compute-bound: per layer and step the
matmuls are ~100 GFLOP while the tensor-parallel all-reduces move 4 × 4 MB.
Printed: median step time, its spread, and the ratios (of medians, and per round).
Targets (issue 3): autopar ≤ 0.9 × DTensor, and ≥ 1.7 × speed-up over one process when the
model is compute-bound.
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


class _Stepper:
    """One training step (zero_grad, forward + loss, backward, AdamW step) of one variant."""

    def __init__(self, loss, params):
        self.loss, self.opt, self.last = loss, torch.optim.AdamW(params, lr=1e-4), 0.0

    def __call__(self) -> None:
        self.opt.zero_grad()
        out = self.loss()
        out.backward()
        self.opt.step()
        self.last = float(out.detach())


def _single(a: argparse.Namespace) -> _Stepper:
    torch.manual_seed(0)
    model = LlamaStyle(_config(a))
    ids, tgt = _data(a)
    return _Stepper(lambda: lm_cross_entropy(model(ids), tgt), list(model.parameters()))


def _autopar(rank: int, world: int, a: argparse.Namespace, sp: bool) -> _Stepper:
    import torch.distributed as dist
    from autopar.passes.capture import capture
    from autopar.passes.tensor_parallel import apply_tensor_parallel
    torch.manual_seed(0)
    model = LlamaStyle(_config(a))
    ids, tgt = _data(a)
    gm = capture(model, (ids,), lm_cross_entropy, tgt).gm
    gm = apply_tensor_parallel(gm, world, rank, dist.group.WORLD, sequence_parallel=sp)
    return _Stepper(lambda: gm(ids, tgt), list(gm.parameters()))


def _dtensor(rank: int, world: int, a: argparse.Namespace) -> _Stepper:
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
    return _Stepper(lambda: lm_cross_entropy(model(ids), tgt), list(model.parameters()))


def _bench(rank: int, world: int, a: argparse.Namespace) -> dict | None:
    """Round-robin over the variants in ONE process group, so a load change on the shared
    machine hits them alike: each round runs one step of each. The one-process step runs on
    rank 0 while rank 1 waits in a barrier (a blocking socket read: no CPU), so it has the
    machine to itself as a lone process would. A step's time is the slowest rank's."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    steps = {"one process": _single(a) if rank == 0 else None,
             "autopar t=2": _autopar(rank, world, a, sp=False),
             "autopar t=2 + SP": _autopar(rank, world, a, sp=True),
             "DTensor t=2": _dtensor(rank, world, a)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(WARMUP + a.steps):
        for name, fn in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            if fn is not None:
                fn()
            took = time.perf_counter() - t0 if fn is not None else 0.0
            slowest = [0.0] * world
            dist.all_gather_object(slowest, took)
            if i >= WARMUP:
                times[name].append(max(slowest))
    if rank:
        return None
    return {"times": times, "loss": {k: fn.last for k, fn in steps.items()}}


def main() -> None:
    from autopar.testing import spawn
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=7)
    a = p.parse_args()
    res = spawn(_bench, 2, a, timeout_s=1200)[0]
    times, loss = res["times"], res["loss"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: Llama-style h={a.hidden} heads={a.heads} layers={a.layers} seq={a.seq} "
          f"batch={a.batch} vocab={a.vocab}")
    print(f"{'':20}{'step s':>9}{'min..max':>16}{'loss':>9}")
    for k, v in times.items():
        print(f"{k:20}{med[k]:>9.4f}{f'{min(v):.3f}..{max(v):.3f}':>16}{loss[k]:>9.4f}")
    print(f"threads per process: 1 (torch.set_num_threads(1)); {WARMUP} warm-up rounds, median "
          f"of {a.steps} rounds, the variants timed round-robin in each round")

    def ratios(num: str, den: str) -> tuple[float, list[float]]:
        per_round = sorted(x / y for x, y in zip(times[num], times[den]))
        return med[num] / med[den], per_round

    vs_dt, r1 = ratios("autopar t=2", "DTensor t=2")
    speed, r2 = ratios("one process", "autopar t=2")
    speed_sp = med["one process"] / med["autopar t=2 + SP"]
    print(f"autopar / DTensor step time: {vs_dt:.2f} (per round {r1[0]:.2f}..{r1[-1]:.2f}, "
          f"median {statistics.median(r1):.2f})  (target <= 0.90: "
          f"{'met' if vs_dt <= 0.9 else 'MISSED'})")
    print(f"speed-up over one process:   {speed:.2f} (per round {r2[0]:.2f}..{r2[-1]:.2f}, "
          f"median {statistics.median(r2):.2f})  (target >= 1.70: "
          f"{'met' if speed >= 1.7 else 'MISSED'}); with sequence parallelism {speed_sp:.2f}")
    if vs_dt > 0.9:
        print("  why: both run the same local matmuls and the same 2 all-reduces per layer; "
              "autopar's gain is only DTensor's per-op Python dispatch and its replicated "
              "embedding / LM head, which shrink relative to the matmuls as the model grows")
    if speed < 1.7:
        print("  why: the ideal is 2.0; the loss is communication (gloo over loopback: each "
              "all-reduce is also a point where the faster rank waits for the slower one) and "
              "the replicated work (norms, residual adds, rotary, optimizer on replicated "
              "parameters) — and the 2 cores are shared with anything else on this machine")


if __name__ == "__main__":
    main()
