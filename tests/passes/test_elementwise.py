"""How elementwise ops run is part of the hardware model (Cluster.elementwise), and the loss is
computed in fp32 under bf16 (passes/loss_precision.py).

"fused" prices a stack that fuses elementwise chains into single kernels (the calibrated GPU
presets); "eager" prices them op by op with every saved tensor kept, as autopar's runtime runs
its generated chunks (the local-cpu preset). The graph profile measures both
(`RegionProfile.eager`); the textbook profile states one accounting and stays as it is.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.cost.model import Config, predict
from autopar.cost.profile import transformer_profile
from autopar.passes.loss_precision import LOSS_OPS, fp32_loss_pass
from autopar.passes.manager import run_passes
from autopar.passes.layers import find_layers
from autopar.passes.graph_profile import profile_from_graph

from models import captured

aten = torch.ops.aten


def _gpt_profile(name="gpt"):
    _, cap = captured(name)
    return profile_from_graph(cap, find_layers(cap), name=name)


def test_unknown_elementwise_kind_names_value_rule_and_fix():
    with pytest.raises(ValueError) as err:
        dataclasses.replace(autopar.get_cluster("dgx-h100-80gb"), elementwise="lazy")
    msg = str(err.value)
    assert "Cluster.elementwise='lazy'" in msg and "'fused'" in msg and "'eager'" in msg
    assert "dataclasses.replace" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="elementwise='lazy'"):
        _gpt_profile().with_elementwise("lazy")


def test_cli_elementwise_override(capsys):
    from autopar.cli import main
    assert main(["plan", "gpt-1.7b", "--gpus", "32", "--elementwise", "eager"]) == 0
    assert "elementwise eager" in capsys.readouterr().out
    assert main(["plan", "gpt-1.7b", "--gpus", "32", "--elementwise", "lazy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopar: error: Cluster.elementwise='lazy'") and "\n" not in err


def test_eager_keeps_more_and_moves_more_than_fused():
    prof = _gpt_profile("hf_gpt2")
    fused, eager = prof.with_elementwise("fused"), prof.with_elementwise("eager")
    for region in ("embedding", "block", "head"):
        f, e = getattr(fused, region), getattr(eager, region)
        assert e.other_bytes >= f.other_bytes, region
        assert (e.act_split_bytes + e.act_replicated_bytes
                >= f.act_split_bytes + f.act_replicated_bytes), region
    # GPT-2's NewGELU is eight elementwise ops: run one by one they keep their intermediates
    # and write each result (fused: one kernel, its input saved)
    assert (eager.block.act_split_bytes + eager.block.act_replicated_bytes
            > fused.block.act_split_bytes + fused.block.act_replicated_bytes)
    assert eager.block.other_bytes > fused.block.other_bytes


def test_for_cluster_prices_by_the_cluster_and_eager_predicts_more_memory():
    prof = _gpt_profile()
    h100 = autopar.get_cluster("dgx-h100-80gb")
    assert prof.for_cluster(h100).elementwise == "fused"
    assert prof.for_cluster(autopar.get_cluster("local-cpu")).elementwise == "eager"
    cfg = Config(t=1, p=1, d=1, micro_batch_size=2)
    fused = predict(prof, h100, cfg)
    eager = predict(prof, dataclasses.replace(h100, elementwise="eager"), cfg)
    assert eager.elementwise == "eager" and fused.elementwise == "fused"
    assert eager.memory.activations_bytes > fused.memory.activations_bytes


def test_textbook_profile_is_one_accounting():
    tb = transformer_profile(name="tb", num_layers=2, seq_len=64, hidden=32, heads=4, vocab=64)
    assert tb.with_elementwise("fused").block == tb.block
    assert tb.with_elementwise("eager").block == tb.block


# ----- the loss in fp32 ------------------------------------------------------------------------
def _loss(h, w, y):
    return torch.nn.functional.cross_entropy(h @ w, y)                   # logits (B·T, V)


def _loss_graph(dtype):
    from torch.fx.experimental.proxy_tensor import make_fx
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(8, 16, generator=g).to(dtype), torch.randn(16, 32, generator=g).to(dtype),
            torch.randint(0, 32, (8,), generator=g))
    return make_fx(_loss)(*args), args


def _loss_inputs(gm):
    return [n.args[0] for n in gm.graph.nodes
            if n.op == "call_function" and n.target in LOSS_OPS]


def test_fp32_loss_pass_casts_bf16_loss_inputs():
    gm, args = _loss_graph(torch.bfloat16)
    assert gm(*args).dtype == torch.bfloat16
    gm = run_passes(gm, [fp32_loss_pass()])
    inputs = _loss_inputs(gm)
    assert inputs and all(x.target == aten.to.dtype and x.args[1] == torch.float32
                          and x.meta["val"].dtype == torch.float32 for x in inputs)
    h, w, y = args
    got = gm(*args)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.nn.functional.cross_entropy((h @ w).float(), y))


def test_fp32_loss_pass_leaves_fp32_values_unchanged():
    gm, args = _loss_graph(torch.float32)
    before = gm(*args)
    after = run_passes(gm, [fp32_loss_pass()])(*args)
    assert torch.equal(before, after)


def test_fp32_loss_pass_casts_the_vocabulary_parallel_cross_entropy_input():
    """At t = 2 the loss is the tensor-parallel pass's vocabulary-parallel cross-entropy (fp32
    inside, its input's dtype out): in a bf16 build it reads fp32 logits too, so the loss is
    not rounded to bf16's 8 significant bits (in fp32 the cast returns its input itself)."""
    from autopar.build import build_program
    from autopar.runtime.shard import vocab_parallel_cross_entropy
    from programs import make_plan, make_program
    prog, _ = make_program("llama_style", make_plan(t=2))
    for precision, logits in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        last = build_program(prog, precision).chunks(0, weights=False)[-1]
        ce = [n for n in last.graph.nodes if n.target is vocab_parallel_cross_entropy]
        assert len(ce) == 1
        x = ce[0].args[0]
        assert x.target == aten.to.dtype and x.args[1] == torch.float32, precision
        assert x.args[0].meta["val"].dtype == logits
