"""Tensor-parallel communication hidden behind the GEMMs it is pipelined with.

When the runtime overlaps TP communication (Cluster.tp_overlap; autopar's runtime does,
passes/overlap.py: row_parallel, column_parallel; Megatron-Core's --tp-comm-overlap, PyTorch's
async TP), a collective costs only the part of it that its GEMM cannot cover:

  - forward, collective matmul: a row-parallel GEMM in `pieces` row pieces, each piece's
    reduction launched when its rows are done (SP's all-gather the mirror image). Two stages
    of `pieces` steps each: the first piece's GEMM and the last piece's communication never
    overlap anything, the rest runs at the slower stage's pace, so the exposed communication is
        comm/pieces + (pieces-1)/pieces · max(0, comm - gemm)
    (exact for equal pieces; 0 exposed needs infinitely many);
  - backward: the input gradient's reduction of the column-parallel projections runs while
    their weight gradients dW = dyᵀ·x are computed (Megatron-LM's asynchronous TP all-reduce,
    2205.05198 §4.2.2): exposed max(0, comm - dW GEMMs).

Hidden is not free: while a collective runs beside a GEMM it takes SMs and memory bandwidth
from it (NCCL's kernels, the copy engines; on CPU ranks the cores), so the part that hides
still costs (1 - overlap) of its time, `overlap` being the cluster's `tp_comm_overlap` (fitted
to torchtitan's async-TP runs on H100 in the presets, measured by `autopar calibrate`).

Pure functions of seconds.
"""
from __future__ import annotations

# the row pieces of the runtime's collective matmul (autopar.runtime.collectives.ROW_CHUNKS;
# tests/unit/test_cost_model.py checks they agree: the cost model never imports the runtime)
ROW_PIECES = 4


def pipelined_exposed_s(comm_s: float, gemm_s: float, pieces: int) -> float:
    """Seconds of `comm_s` left exposed when it is pipelined with `gemm_s` of GEMM in
    `pieces` equal pieces (pieces = 1: not pipelined, all of it exposed)."""
    if comm_s < 0 or gemm_s < 0 or pieces < 1:
        raise ValueError(f"pipelined_exposed_s(comm_s={comm_s}, gemm_s={gemm_s}, pieces="
                         f"{pieces}): times must be >= 0 and pieces >= 1")
    return comm_s / pieces + (pieces - 1) / pieces * max(0.0, comm_s - gemm_s)


def hidden_behind_s(comm_s: float, gemm_s: float) -> float:
    """Seconds of `comm_s` left exposed when it runs concurrently with `gemm_s` of GEMM."""
    return max(0.0, comm_s - gemm_s)


def block_tp_exposed_s(fwd_comm_s: float, bwd_comm_s: float, row_gemm_s: float,
                       col_gemm_s: float, pieces: int, forward_passes: int = 1,
                       overlap: float = 1.0) -> float:
    """Exposed TP communication of one block per micro-batch: `fwd_comm_s` (one forward's
    collectives, run `forward_passes` times: 2 with full recompute) pipelined with the
    row-parallel GEMMs `row_gemm_s`; `bwd_comm_s` under the column-parallel projections'
    weight gradients, which take their forward time `col_gemm_s`; of what hides, the part
    1 - `overlap` still costs its time (module doc)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"block_tp_exposed_s(overlap={overlap}): the fraction of a hidden "
                         f"collective that costs nothing must be in [0, 1]")
    exposed = (forward_passes * pipelined_exposed_s(fwd_comm_s, row_gemm_s, pieces)
               + hidden_behind_s(bwd_comm_s, col_gemm_s))
    hidden = forward_passes * fwd_comm_s + bwd_comm_s - exposed
    return exposed + (1.0 - overlap) * hidden
