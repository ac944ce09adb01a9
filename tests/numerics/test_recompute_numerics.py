"""Activation recomputation (passes/recompute.py) through the runtime on gloo ranks: 2 pipeline
ranks and t=2 with sequence parallelism equal the single-device model, and tensor-parallel
attention dropout is replayed by the recomputation exactly. The single-process tests are
tests/passes/test_recompute.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.api import ParallelProgram
from autopar.build import build_program
from autopar.passes import meta as K
from autopar.testing import spawn

import models
from programs import (check_against_reference, check_training, loss_fn, make_data, make_plan,
                      with_zero)


@pytest.mark.distributed
def test_two_ranks_full_recompute_equals_single_device():
    plan = dataclasses.replace(make_plan(p=2, m=2, layers=2), recompute="full")
    check_against_reference("gpt", plan)


@pytest.mark.distributed
@pytest.mark.parametrize("name,mode", [("gpt", "full"), ("llama_style", "selective"),
                                       ("llama_style", "op")])
def test_tensor_parallel_sequence_parallel_recompute_equals_single_device(name, mode):
    """t=2 with sequence parallelism: the checkpointed regions hold the fused column-parallel
    calls (passes/overlap.py) and tensor-parallel dropout, whose checkpoint call goes through
    checkpoint_tp_rng (a function object as a keyword value could not be written into the
    generated source: full recompute + SP on GPT failed to compile)."""
    plan = dataclasses.replace(make_plan(t=2, p=1, m=2, layers=2), recompute=mode,
                               sequence_parallel=True)
    check_against_reference(name, plan)


@pytest.mark.distributed
@pytest.mark.parametrize("name,plan", [
    ("gpt", dataclasses.replace(make_plan(p=2, v=2, m=2, layers=4,
                                          schedule="interleaved-1f1b"), recompute="op")),
    ("llama_style", dataclasses.replace(make_plan(d=2, m=2, layers=2), recompute="op",
                                        zero=3)),
    ("gpt", dataclasses.replace(make_plan(t=2, layers=2), recompute="op")),
], ids=["p2-interleaved", "d2-zero3", "t2-row-all-reduce"])
def test_op_recompute_across_stages_and_sharded_weights_equals_single_device(name, plan):
    """op (torchtitan's per-op selective checkpointing) on a pipeline's chunks, under ZeRO-3,
    whose weights are gathered into buffers the checkpointed blocks read, and at t = 2
    without sequence parallelism, where each row-parallel GEMM piece is all-reduced in place:
    a kept piece's all-reduce is kept too (op_policy), else the recomputation reduced the
    kept, already reduced piece again (ln_2's weight update was 3% off after 3 AdamW steps,
    9% under SGD)."""
    check_against_reference(name, plan)


@pytest.mark.distributed
def test_op_recompute_under_bf16_zero3_equals_the_bf16_single_device():
    """op with bf16 compute: the ZeRO-3 weights gathered in bf16 views, the kept GEMM outputs
    in bf16, the fp32 masters stepped (the bf16 single device's tolerances)."""
    plan = dataclasses.replace(with_zero(make_plan(d=2, layers=2), 3), recompute="op")
    check_training("gpt", plan, precision="bf16")


def _op_decisions_rank(rank: int, world: int, plan) -> list[tuple[int, str]]:
    """One step of `plan` (op recompute), recording the policy's decision for every 2-D GEMM
    call in a block's forward: (its weight's storage, the decision)."""
    import autopar.passes.recompute as R
    from programs import make_program, train_steps
    decisions, policy_of = [], R.op_policy

    def recording(seen, *last):
        inner = policy_of(seen, *last)

        def policy(ctx, func, *args, **kwargs):
            out = inner(ctx, func, *args, **kwargs)
            if func in R._LINEAR_GEMMS and not getattr(ctx, "is_recompute", False):
                decisions.append((R._place(args[R._WEIGHT_ARG[func]]), out.name))
            return out
        return policy
    R.op_policy = recording
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), timeout_s=120)
    train_steps(runner, plan, make_data(plan, vocab)[:1])   # this replica's rows
    return decisions


@pytest.mark.distributed
@pytest.mark.parametrize("plan", [
    dataclasses.replace(make_plan(t=2, layers=2), recompute="op"),
    dataclasses.replace(make_plan(d=2, layers=2), recompute="op", zero=3),
], ids=["t2-row-pieces", "d2-zero3-flat-buffer"])
def test_op_recompute_decides_per_gemm_not_per_row_piece(plan):
    """At t = 2 a row-parallel GEMM runs as row pieces (the collective matmul), each an mm
    call: op counts the GEMM once (its pieces share its weight), so a block's GEMMs are kept
    and rerun alternately as cost/shares.py op_checkpoint prices them (GPT: c_attn kept,
    attention c_proj rerun, c_fc kept, MLP c_proj last). Under ZeRO-3 the weights are views
    of one gathered buffer: told apart by their offsets, not by their storage alone."""
    for decisions in spawn(_op_decisions_rank, 2, plan, timeout_s=240):
        runs = []                                  # consecutive calls on one weight
        for weight, decision in decisions:
            if runs and runs[-1][0] == weight:
                runs[-1][1].append(decision)
            else:
                runs.append((weight, [decision]))
        assert (max(len(d) for _, d in runs) > 1) == (plan.t > 1)   # pieces at t = 2
        assert all(len(set(d)) == 1 for _, d in runs), runs
        per_gemm = [d[0] for _, d in runs]
        assert per_gemm == ["MUST_SAVE", "PREFER_RECOMPUTE"] * (len(per_gemm) // 2), per_gemm


def _tp_dropout_rank(rank: int, world: int, mode: str) -> dict:
    """t=2 GPT with attention and residual dropout: one SGD step's loss and weights, whether
    its attention runs on per-rank dropout streams, and how many regions were checkpointed."""
    plan = dataclasses.replace(make_plan(t=2, p=1, m=2, layers=2), recompute=mode)
    model = models.build("gpt", seed=0, heads=2, dropout=0.1)
    x, y = make_data(plan, 64)[0]
    ex = torch.zeros(plan.micro_batch_size, x.shape[1], dtype=torch.long)
    prog = ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(ex,),
                           loss_fn=loss_fn, example_targets=ex, cluster=None)
    runner = prog.compile(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), timeout_s=60)
    torch.manual_seed(3)          # the replicated stream: the same on both ranks and runs
    loss = runner.train_step(x, y)
    graph = build_program(prog).chunks(rank, weights=False)[0]
    return {"loss": loss, "state": runner.full_state_dict(),
            "split_attention_dropout": "tp_sdpa" in prog.source(0, rank),
            "regions": len(graph.meta[K.RECOMPUTE]["regions"])}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_tensor_parallel_attention_dropout_is_replayed_by_recompute(mode):
    """Attention dropout on split heads draws from each tensor rank's own stream; the
    recomputation must replay that stream (and, selective, find the rewritten attention core),
    so one step gives exactly the numbers of the same run without recompute."""
    ref = spawn(_tp_dropout_rank, 2, "none", timeout_s=240)
    got = spawn(_tp_dropout_rank, 2, mode, timeout_s=240)
    assert all(r["split_attention_dropout"] for r in ref + got)
    assert all(r["regions"] == 2 for r in got), [r["regions"] for r in got]
    assert ref[0]["loss"] == got[0]["loss"]
    for key, value in ref[0]["state"].items():
        torch.testing.assert_close(got[0]["state"][key], value, rtol=1e-6, atol=1e-7,
                                   msg=lambda m, k=key: f"{k}: {m}")
