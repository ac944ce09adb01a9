"""Codegen: each chunk is valid, readable Python naming its chunk/layers/collectives, and the
saved program directory holds the plan, the chunks and the launcher (that the runtime executes
exactly the saved source is tests/numerics/test_codegen_runtime.py)."""
from __future__ import annotations

import ast
import json
import re

import torch

from autopar.codegen import load_chunk_module
from autopar.plan import Plan

from programs import make_data, make_plan, make_program


def test_chunk_source_is_valid_python_with_a_header():
    plan = make_plan(p=2, m=2, layers=3, split=[2, 1])
    prog, _ = make_program("gpt", plan)
    src0, src1 = prog.source(chunk=0), prog.source(chunk=1)
    for src in (src0, src1):
        ast.parse(src)
    assert "chunk 0 of 2" in src0 and "embedding + layers [0, 2)" in src0
    assert "pipeline rank 0" in src0 and "t=1" in src0 and "d=1" in src0
    assert "chunk 1 of 2" in src1 and "layers [2, 3) + head+loss" in src1
    assert "Collectives: none" in src1
    assert "class Chunk01(torch.nn.Module)" in src1 and "def forward(self" in src1
    assert "cross_entropy_loss" in src1 and "'lm_head.weight'" in src1


def test_generated_module_runs_like_the_graph():
    plan = make_plan(p=1, m=1, layers=2)
    prog, vocab = make_program("llama_style", plan)
    src = prog.source(chunk=0)
    # values are named after the module that computed them (torch.export's nn_module_stack)
    assert re.search(r"^ +layers_1_mlp_down_proj_\w+ = ", src, re.M), src
    mod = load_chunk_module(src)
    net = mod.CHUNK_CLASS()
    sd = prog.model.state_dict()
    for attr, (qual, shape, _) in mod.PARAMETERS.items():
        net.register_parameter(attr, torch.nn.Parameter(sd[qual].clone()))
        assert tuple(shape) == tuple(sd[qual].shape)
    for attr, (qual, _, _) in mod.BUFFERS.items():
        net.register_buffer(attr, dict(prog.model.named_buffers())[qual].clone())
    assert mod.OBJECTS == {"rank_device": "rank_device"}   # positions/masks are made on it
    for sub in net.modules():   # what compile binds: this rank's device
        sub.rank_device = torch.device("cpu")
    x, y = make_data(plan, vocab)[0]
    torch.testing.assert_close(net(x, y), prog.loss_fn(prog.model(x), y))


def test_tensor_parallel_chunk_names_its_collectives():
    plan = make_plan(t=2, p=2, m=2, layers=2)
    prog, _ = make_program("gpt", plan)
    src = prog.source(chunk=1, tp_rank=1)
    ast.parse(src)
    assert "tensor rank\n1 of t=2" in src or "tensor rank 1 of t=2" in src
    # f fused with the projections it feeds, each row-parallel projection with its g
    # (passes.overlap)
    assert "row_parallel" in src and "column_parallel" in src
    assert "OBJECTS = {'tp_group': 'tp_group'}" in src


def test_save_writes_plan_chunks_and_launcher(tmp_path):
    plan = make_plan(p=2, m=2, layers=2)
    prog, _ = make_program("gpt", plan)
    out = prog.save(tmp_path)
    assert Plan.from_json((out / "plan.json").read_text()) == plan
    assert sorted(p.name for p in out.glob("chunk_*.py")) == ["chunk_00.py", "chunk_01.py"]
    assert (out / "chunk_01.py").read_text() == prog.source(chunk=1)
    ast.parse((out / "launch.py").read_text())
    assert "torchrun" in (out / "run.sh").read_text() and "--nproc_per_node=2" in \
        (out / "run.sh").read_text()
    assert json.loads((out / "chunks.json").read_text())["chunk_01.py"]["pipeline_rank"] == 1
