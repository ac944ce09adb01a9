"""Predicted memory against an H100's allocator (benchmarks/gpu.py's memory part, 2026-11-26,
torch 2.11 + CUDA 13; the measurements in benchmarks/results/gpu-2026-11-26-h100-run1.json).

A 12-layer GPT of width 2048 at sequence 2048 (vocabulary 50,304, tied embeddings), bf16 with
fp32 masters and AdamW, one GPU, eager chunks; per row the peak `torch.cuda.max_memory_allocated`
of a step after the optimizer state exists, less what was allocated before it (the state).
Priced as the chunks ran (elementwise eager), each row's activations (what the in-flight
micro-batches keep plus the backward's working set) and state are the allocator's within 1%.
Before the fixes this test holds, the activations were priced at half: the loss's backward
working set on the last stage (cost/memory.py `backward_work`), the meter's attention bytes at
hidden = sequence (passes/activation_meter.py), the fused accounting for eager chunks."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import autopar
from autopar.api import plan_profile, precision_profiles
from autopar.cost.hardware import get_cluster
from autopar.cost.solver import solve
from autopar.examples.gpt import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _measured() -> list[dict]:
    rows = json.loads((RESULTS / "gpu-2026-11-26-h100-run1.json").read_text())["parts"]["memory"]
    assert len(rows) == 6 and all("measured_peak_bytes" in r for r in rows)
    return rows


def test_h100_memory_rows_are_priced_within_one_percent():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304, block_size=2048, n_layer=12, n_head=16,
                              n_embd=2048, dropout=0.0, bias=True, tie_embeddings=True))
    example = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    eager = dataclasses.replace(get_cluster("dgx-h100-80gb"), elementwise="eager")
    _, profile = plan_profile(model, (example,), autopar.cross_entropy, None, eager,
                              gpu_counts=(1,))
    profile = precision_profiles(profile, eager, "bf16")["bf16"]
    for row in _measured():
        recompute = row["variant"].split()[0].removeprefix("recompute=")
        mb = int(row["variant"].split("mb=")[1])
        plan = solve(profile, eager, gpus=1, global_batch_size=4, t=1, p=1, d=1, c=1, zero=0,
                     recompute=recompute, micro_batch_size=mb)
        mem = plan.predicted.memory
        act = mem.activations_bytes + mem.recompute_bytes
        state = mem.weights_bytes + mem.gradients_bytes + mem.optimizer_bytes
        assert act == pytest.approx(row["measured_activation_bytes"], rel=0.01), row["case"]
        assert state == pytest.approx(row["measured_static_bytes"], rel=0.01), row["case"]
