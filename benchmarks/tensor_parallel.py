"""Benchmark: autopar tensor parallelism (t=2, 2 CPU gloo ranks) vs PyTorch DTensor TP vs 1 process.

    python benchmarks/tensor_parallel.py [--hidden 1024] [--layers 2] [--seq 256] [--steps 5]

The model is the examples' Llama-style decoder (separate q/k/v, SwiGLU). The DTensor version is
written by hand the usual way (torchtitan): ColwiseParallel on q/k/v/gate/up, RowwiseParallel on
o/down, the attention modules' head counts divided by t; embedding and LM head replicated.
autopar splits the same model automatically (plus vocab-parallel embedding / head / loss).
Fairness: every process — each of the 2 ranks and the one-process baseline — runs with
torch.set_num_threads(1) (2 cores: one per rank), the same model, data, optimizer (AdamW) and
step (forward + loss + backward + step); 2 warm-up steps, then the median of --steps steps; all
four (one process, autopar t=2 without and with sequence parallelism, DTensor) measured in this
one run, one after the other, each in fresh processes (never concurrently; an earlier version
timed them round-robin inside one process group, which made every variant slower and noisier:
the processes' allocators and caches churned between four models). The default size
(hidden 1024, 16 heads, FFN 4096, seq 256, batch 4) is compute-bound: per layer and step the
matmuls are ~100 GFLOP while the tensor-parallel all-reduces move 4 × 4 MB.
Printed: median step time and the ratios.
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
    from autopar.passes.tensor_parallel import apply_tensor_parallel
    torch.manual_seed(0)
    model = LlamaStyle(_config(a))
    ids, tgt = _data(a)
    gm = capture(model, (ids,), lm_cross_entropy, tgt).gm
    gm = apply_tensor_parallel(gm, world, rank, dist.group.WORLD,
                               sequence_parallel=bool(getattr(a, "sp", False)))
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


def main() -> None:
    from autopar.testing import spawn
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    single = spawn(_single, 1, a, timeout_s=600)[0]
    auto = spawn(_autopar, 2, a, timeout_s=600)
    auto_sp = spawn(_autopar, 2, argparse.Namespace(**{**vars(a), "sp": True}), timeout_s=600)
    dt = spawn(_dtensor, 2, a, timeout_s=600)
    t_single, t_auto, t_dt = single[0], max(r[0] for r in auto), max(r[0] for r in dt)
    print(f"model: Llama-style h={a.hidden} heads={a.heads} layers={a.layers} seq={a.seq} "
          f"batch={a.batch} vocab={a.vocab}")
    print(f"{'':24}{'step s':>10}{'loss':>10}")
    print(f"{'one process':24}{t_single:>10.4f}{single[1]:>10.4f}")
    print(f"{'autopar t=2':24}{t_auto:>10.4f}{auto[0][1]:>10.4f}")
    t_sp = max(r[0] for r in auto_sp)
    print(f"{'autopar t=2 + SP':24}{t_sp:>10.4f}{auto_sp[0][1]:>10.4f}")
    print(f"{'DTensor t=2':24}{t_dt:>10.4f}{dt[0][1]:>10.4f}")
    vs_dt, speedup = t_auto / t_dt, t_single / t_auto
    print(f"threads per process: 1 (torch.set_num_threads(1)); {WARMUP} warm-up steps, median "
          f"of {a.steps}")
    print(f"autopar / DTensor step time: {vs_dt:.2f}  (target <= 0.90: "
          f"{'met' if vs_dt <= 0.9 else 'MISSED'})")
    print(f"speed-up over one process:   {speedup:.2f}  (target >= 1.70: "
          f"{'met' if speedup >= 1.7 else 'MISSED'}); with sequence parallelism "
          f"{t_single / t_sp:.2f}")
    if vs_dt > 0.9:
        print("  why: both run the same local matmuls and the same 2 all-reduces per layer; "
              "autopar's gain is only DTensor's per-op Python dispatch and its replicated "
              "embedding / LM head, which shrink relative to the matmuls as the model grows")
    if speedup < 1.7:
        print(f"  why: the ideal is 2.0; the loss is communication (gloo over loopback) and the "
              f"replicated work (norms, rotary, optimizer on replicated parameters) — and the 2 "
              f"cores are shared with anything else running on this machine")


if __name__ == "__main__":
    main()
