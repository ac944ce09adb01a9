"""The FP8 pass (passes/fp8.py) on the tiny GPT's chunks, one process: which GEMMs it picks
(FP8_RULE: the blocks' linears; the LM head stays bf16), how it marks the tensor-parallel
ones (a row-parallel forward and a column-parallel input gradient are partial sums over the
tensor group; at c = 2 every call gets the context shard, whose group holds the other
tokens), and its one-line refusal of GEMM dims that are not multiples of 16."""
from __future__ import annotations

import pytest
import torch

from autopar.api import ParallelProgram
from autopar.build import build_program
from autopar.passes.context_parallel import CP_ATTR
from autopar.plan import Plan
from autopar.runtime.fp8 import fp8_column_parallel, fp8_linear

from models import gpt
from programs import SEQ, loss_fn, make_plan, make_program


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_blocks_linears_in_fp8_head_in_bf16():
    prog, _ = make_program("gpt", make_plan())
    (chunk,) = build_program(prog, "fp8").chunks(0, weights=False)
    picked = _calls(chunk, fp8_linear)
    assert len(picked) == 8                           # q/k/v, out, fc, proj of 2 blocks
    assert all(n.args[3] == "tensorwise" and n.args[4] is None for n in picked)
    left = _calls(chunk, torch.ops.aten.linear.default)
    assert [n.args[1].target for n in left] == ["lm_head_weight"]    # the LM head


def test_tensor_parallel_linears_marked_partial():
    plan = Plan.from_dict({**make_plan(t=2, b=4).to_dict(), "c": 2})   # 16 tokens a rank
    prog, _ = make_program("gpt", plan)
    (chunk,) = build_program(prog, "fp8-rowwise").chunks(0, weights=False)
    rows = _calls(chunk, fp8_linear)
    cols = _calls(chunk, fp8_column_parallel)
    assert len(rows) == 4 and len(cols) == 4          # out, proj / q·k·v, fc per block
    assert all(n.args[3] == "rowwise" and n.args[5] is True and n.args[6] is False
               for n in rows)                         # K split: the forward is a partial sum
    assert all(n.args[-2] == "rowwise" for n in cols)
    assert all(n.args[-1].op == "get_attr" and n.args[-1].target == CP_ATTR
               for n in rows + cols)                  # the context group: the other tokens
    chunk.graph.lint()


def test_gemm_dims_not_multiple_of_16_is_one_line():
    plan = make_plan()
    ex = torch.zeros(plan.micro_batch_size, SEQ, dtype=torch.long)
    prog = ParallelProgram(model=gpt(layers=2, heads=2, hidden=40), plan=plan, profile=None,
                           example_inputs=(ex,), loss_fn=loss_fn, example_targets=ex,
                           cluster=None)
    with pytest.raises(ValueError) as err:
        build_program(prog, "fp8").chunks(0, weights=False)
    msg = str(err.value)
    assert "\n" not in msg and "40" in msg and "multiple of 16" in msg and "pad" in msg


def test_rowwise_gemm_where_the_cpu_kernel_takes_one_scale_per_operand(monkeypatch):
    """torch 2.11's CPU `_scaled_mm` refuses rowwise scales: there the GEMM is the unscaled
    FP8 product scaled after. Both ways equal the dequantised operands' product (fp32)."""
    from autopar.runtime import fp8
    torch.manual_seed(0)
    a = torch.randn(32, 64) * torch.logspace(-3, 3, 32)[:, None]    # rows far apart
    b = torch.randn(16, 64)
    r = fp8.RECIPES["rowwise"]
    a8, sa = fp8._cast(a, fp8._amax(a, True, ()), fp8.E4M3, True)
    b8, sb = fp8._cast(b, fp8._amax(b, True, ()), fp8.E4M3, True)
    want = (a8.float() * sa) @ (b8.float() * sb).t()
    got = []
    for native in ([True] if fp8._cpu_takes_rowwise_scales() else []) + [False]:
        monkeypatch.setattr(fp8, "_cpu_takes_rowwise_scales", lambda n=native: n)
        got.append(fp8.scaled_gemm(a, b, fp8.E4M3, fp8.E4M3, r))
    for c in got:
        torch.testing.assert_close(c, want, rtol=1e-5, atol=0)
