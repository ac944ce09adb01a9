"""Compiled chunks: each loaded chunk's forward and backward compiled by torch.compile.

How (torchtitan's per-block `module.compile()`, here per pipeline chunk): `nn.Module.compile`
compiles the chunk module in place (its parameters keep their names, so the optimizer regime,
gradient hooks and checkpoints see the same tensors); TorchDynamo captures the generated
forward, AOTAutograd derives its backward and Inductor fuses both (C++/OpenMP kernels on CPU,
Triton on GPU). The collectives of autopar.runtime.collectives are autograd.Functions over
c10d process groups with asynchronous work handles: Dynamo cannot put them in a graph, so they
are the graph breaks — each compiled region runs between two collectives, the collective
runs eagerly with its conjugate backward, and the overlap they do (column_parallel's backward
all-reduce under the weight-gradient GEMMs, the collective matmul of passes/overlap.py) is kept.
`compile_chunks` wraps them with `torch.compiler.disable` in the chunk's own namespace, so the
break is explicit and Dynamo does not try (and fail, and retry) to trace into the process group.

Compile work is cached across steps: a chunk sees the same shapes every micro-batch (the
schedule's micro-batches have one size), so Dynamo compiles each region once and later calls
hit its guard cache (`compile_counts` reads torch._dynamo's counters; tests assert that a
second step compiles nothing new). Expert parallelism is the exception: the tokens each rank
sends its experts change every step (the all-to-all's sizes, read by `.item()`: a graph
break), so the regions after the dispatch see new shapes; chunks compile with automatic
dynamic shapes (`dynamic=None`: a region that meets a second shape is compiled once more with
that dim symbolic), which recompiles them once on the second step and never after, where
`dynamic=False` recompiled every step until Dynamo's cache limit sent them back to eager.

Split backward (B now, W later) works on the compiled graph unchanged: a compiled region's
backward is one autograd node, on the input path, so B runs it whole and W has only the
regions off that path left (autopar.runtime.split_backward's fallback keeps the numbers those
of a plain backward).
"""
from __future__ import annotations

import types
from typing import Any, Iterable

import torch

from autopar.runtime import collectives as C

# the plain functions generated chunk code calls (FX call_function targets) that talk to peers
_COLLECTIVE_NAMES = tuple(n for n in C.__all__ if callable(getattr(C, n))
                          and n not in ("group_size", "group_rank", "PeerError"))


def _break_at_collectives(module: types.ModuleType) -> None:
    """Rebind, in a generated chunk module's globals, every collective it imported to a
    Dynamo-disabled wrapper (a graph break; the function itself runs as in eager)."""
    for name, value in list(vars(module).items()):
        if callable(value) and getattr(value, "__module__", None) == C.__name__ \
                and getattr(value, "__name__", None) in _COLLECTIVE_NAMES:
            setattr(module, name, torch.compiler.disable(value, recursive=True))


def compile_chunks(chunks: Iterable[Any], *, backend: str = "inductor",
                   mode: str | None = None) -> None:
    """Compile each LoadedChunk's net in place (forward and backward); `backend`/`mode` are
    torch.compile's. Nothing is compiled until the first forward. Inductor draws random
    numbers with eager's generators (fallback_random): dropout masks, the tensor-parallel
    DropoutStreams and recomputed regions see the numbers an eager run does."""
    import torch._inductor.config as inductor_config
    inductor_config.fallback_random = True
    for ch in chunks:
        _break_at_collectives(ch.module)   # its submodules' classes share these globals
        ch.net.compile(backend=backend, mode=mode, dynamic=None)


def compile_counts() -> dict[str, int]:
    """torch._dynamo's counters: frames compiled ("frames") and graph breaks ("breaks")."""
    from torch._dynamo.utils import counters
    return {"frames": int(counters["stats"]["unique_graphs"]),
            "breaks": int(sum(counters["graph_break"].values()))}
