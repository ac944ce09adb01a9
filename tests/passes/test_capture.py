"""Capture: numerics equal the model, meta models, repeat truncation, clear errors."""
from __future__ import annotations

import inspect

import pytest
import torch

from autopar.examples.gpt import GPT, GPTConfig, gpt_preset, lm_cross_entropy
from autopar.passes import meta as K
from autopar.passes.capture import CaptureError, capture, find_repeated_containers

from models import captured, pass_batch, pass_model


def test_capture_loss_matches_model(tiny_name):
    model, cap = captured(tiny_name)
    ids, tgt = pass_batch()
    expected = lm_cross_entropy(model(ids), tgt)
    got = cap.gm(ids, tgt)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    stacks = [n.meta.get(K.NN_MODULE_STACK) for n in cap.gm.graph.nodes
              if n.op == "call_function"]
    assert all(s is not None for s in stacks)


@pytest.mark.parametrize("name", ["gpt", "llama_style"])
def test_capture_without_loss_returns_logits(name):
    model = pass_model(name)
    ids, _ = pass_batch()
    cap = capture(model, (ids,))
    torch.testing.assert_close(cap.gm(ids), model(ids))
    assert not cap.has_loss


def test_same_tensor_as_input_and_target_stays_two_inputs():
    model = pass_model("gpt")
    ids, _ = pass_batch()
    cap = capture(model, (ids,), lm_cross_entropy, ids)
    other = torch.randint(0, 128, ids.shape)
    torch.testing.assert_close(cap.gm(ids, other), lm_cross_entropy(model(ids), other))


@pytest.mark.parametrize("name", ["gpt", "llama_style"])
def test_meta_capture(name):
    with torch.device("meta"):
        model = pass_model(name)
    ids = torch.empty(2, 16, dtype=torch.long, device="meta")
    cap = capture(model, (ids,), lm_cross_entropy)  # targets made from the ids' shape
    loss = [n for n in cap.gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert loss.meta[K.VAL].shape == () and loss.meta[K.VAL].device.type == "meta"


def test_gpt_with_dropout_exports_dropout_ops():
    model = pass_model("gpt", dropout=0.1)
    ids, tgt = pass_batch()
    cap = capture(model, (ids,), lm_cross_entropy, tgt)
    targets = {str(n.target) for n in cap.gm.graph.nodes}
    assert "aten.dropout.default" in targets


def test_repeated_containers_are_found_structurally():
    model = pass_model("gpt", layers=4)
    assert find_repeated_containers(model) == {"transformer.h": 4}
    hf = pass_model("hf_llama", layers=3)
    assert find_repeated_containers(hf) == {"model.layers": 3}


@pytest.mark.parametrize("name,path", [("gpt", "transformer.h"), ("hf_llama", "model.layers"),
                                       ("hf_gpt2", "transformer.h"),
                                       ("hf_bert", "bert.encoder.layer")])
def test_repeat_limit_truncates_and_restores(name, path):
    model = pass_model(name, layers=4)
    ids, tgt = pass_batch()
    cap = capture(model, (ids,), lm_cross_entropy, tgt, repeat_limit=2)
    assert cap.repeats == {path: 4}
    assert len(model.get_submodule(path)) == 4  # restored
    blocks = {v[0] for n in cap.gm.graph.nodes
              for v in (n.meta.get(K.NN_MODULE_STACK) or {}).values()
              if v[0].startswith("model." + path + ".") and v[0].count(".") == path.count(".") + 2}
    assert blocks == {f"model.{path}.0", f"model.{path}.1"}
    # the truncated graph still runs: embedding + 2 blocks + head
    assert torch.isfinite(cap.gm(ids, tgt))


def test_repeat_limit_restores_on_error():
    """A capture that fails while the stack is cut to `repeat_limit` blocks gives the model
    its blocks back. The failure is the model's own (a block that raises), not torch's: float
    ids, used before, made torch 2.13's export fail and 2.11's succeed."""
    model = pass_model("gpt", layers=4)

    def fails(module, args):
        raise RuntimeError("this block cannot be traced")
    model.transformer.h[0].register_forward_pre_hook(fails)
    with pytest.raises(CaptureError):
        capture(model, (torch.zeros(2, 16, dtype=torch.long),), repeat_limit=2)
    assert len(model.transformer.h) == 4


class _Looped(torch.nn.Module):
    """Four alike blocks, the middle two run twice (a recurrent section sliced from the list
    by index, as transformers' Dory runs its loop), then the last."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids):
        h = self.blocks[0](self.emb(ids))
        for _ in range(2):
            for blk in self.blocks[1:3]:
                h = torch.tanh(blk(h))
        return self.head(self.blocks[-1](h))


def test_a_truncated_stack_whose_blocks_run_more_than_once_is_captured_whole():
    """Cut to 2 blocks, the looped model runs block 1 twice and slices the wrong blocks (its
    indices mean the whole list): the capture is redone whole, so the graph is the model's
    (six block calls, the true numbers) and no repeat is recorded for the planner to expand."""
    from autopar.passes.layers import find_layers
    torch.manual_seed(0)
    model = _Looped()
    ids = torch.randint(0, 16, (2, 5))
    cap = capture(model, (ids,), repeat_limit=2)
    assert cap.repeats == {} and len(model.blocks) == 4
    torch.testing.assert_close(cap.gm(ids), model(ids))
    assert find_layers(cap).num_layers == 6


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.lin(x)
        return x


def test_data_dependent_control_flow_names_user_line():
    line = next(i for i, text in enumerate(inspect.getsourcelines(_DataDependent.forward)[0])
                if "x.sum() > 0" in text) + inspect.getsourcelines(_DataDependent.forward)[1]
    with pytest.raises(CaptureError) as info:
        capture(_DataDependent(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert f"{__file__}:{line}" in msg
    assert "torch.cond" in msg or "torch.where" in msg
    assert isinstance(info.value, ValueError)



def test_capture_error_is_one_line_with_a_short_cause():
    """Issue 16: the message fits on one line (value, rule, fix) and is what the screen ends
    with; the detail is the cause, the original error cut to start at the user's frame, not
    torch.export's hundreds of lines of chained wrappers."""
    import traceback
    with pytest.raises(CaptureError) as info:
        capture(_DataDependent(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "\n" not in msg and "fix:" in msg
    cause = info.value.__cause__
    assert cause is not None and cause.__cause__ is None
    printed = "".join(traceback.format_exception(info.value))
    assert printed.rstrip().splitlines()[-1] == f"autopar.passes.capture.CaptureError: {msg}"
    frames = [line for line in printed.splitlines() if line.startswith('  File "')]
    assert frames[0].startswith(f'  File "{__file__}"'), frames[0]   # from the user's line on
    assert len(frames) < 25, len(frames)


def test_meta_model_with_cpu_inputs_is_captured_on_meta():
    with torch.device("meta"):
        model = pass_model("gpt")
    cap = capture(model, (torch.zeros(2, 16, dtype=torch.long),), lm_cross_entropy,
                  torch.zeros(2, 16, dtype=torch.long))
    assert all(n.meta[K.VAL].is_meta for n in cap.gm.graph.nodes
               if isinstance(n.meta.get(K.VAL), torch.Tensor))


def test_bad_arguments():
    model = pass_model("gpt")
    ids, tgt = pass_batch()
    with pytest.raises(ValueError, match="repeat_limit"):
        capture(model, (ids,), repeat_limit=1)
    with pytest.raises(ValueError, match="without loss_fn"):
        capture(model, (ids,), targets=tgt)
    with pytest.raises(ValueError, match="nn.Module"):
        capture(lambda x: x, (ids,))


def test_lm_cross_entropy_accepts_model_outputs():
    logits = torch.randn(2, 5, 7)
    tgt = torch.randint(0, 7, (2, 5))

    class Out:
        pass

    out = Out()
    out.logits = logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(10, 7), tgt.reshape(10))
    torch.testing.assert_close(lm_cross_entropy(out, tgt), ref)
    torch.testing.assert_close(lm_cross_entropy((logits,), tgt), ref)


def test_gpt_presets_follow_the_papers():
    c = gpt_preset("gpt3-175b")
    assert (c.n_layer, c.n_embd, c.n_head, c.block_size, c.vocab_size) == (96, 12288, 96, 2048, 51200)
    assert gpt_preset("megatron-1t").n_head == 160
    assert gpt_preset("gpt-1.2b-v100").block_size == 1024
    with pytest.raises(ValueError, match="known presets"):
        gpt_preset("gpt-9t")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=3, n_embd=8)
    # 12·L·h² + V·h ≈ 175 B
    with torch.device("meta"):
        small = GPT(gpt_preset("gpt3-175b", n_layer=1))
    per_block = sum(p.numel() for p in small.transformer.h[0].parameters())
    assert abs(per_block - 12 * 12288 ** 2) / (12 * 12288 ** 2) < 0.01


@pytest.mark.parametrize("name", ["llama_style", "hf_llama"])
def test_bf16_capture_keeps_the_norms_upcast_apart_from_its_input(name):
    """RMSNorm's `x.float()` on fp32 weights is x itself, so export records every later use of
    x (the residual add) as a use of the cast; captured with compute_dtype=bf16 the cast is a
    node of its own that only the norm's statistic and normalisation read, while the residual
    add reads the bf16 embedding. The graph holds the user's fp32 parameters (the model's own
    are back in place) and, with them cast to bf16, computes the bf16 model's loss."""
    aten = torch.ops.aten
    ids, tgt = pass_batch()

    def first_norm(cap):
        emb = next(n for n in cap.gm.graph.nodes if n.target == aten.embedding.default)
        cast = next(u for u in emb.users if u.target == aten.to.dtype)
        return emb, cast

    model = pass_model(name)
    emb, cast = first_norm(capture(model, (ids,), lm_cross_entropy, tgt))
    assert aten.add.Tensor in {u.target for u in cast.users}        # fp32: the uses merged
    params = dict(model.named_parameters())
    cap = capture(model, (ids,), lm_cross_entropy, tgt, compute_dtype=torch.bfloat16)
    emb, cast = first_norm(cap)
    assert emb.meta[K.VAL].dtype == torch.bfloat16 and cast.meta[K.VAL].dtype == torch.float32
    assert {u.target for u in cast.users} == {aten.pow.Tensor_Scalar, aten.mul.Tensor}
    assert aten.add.Tensor in {u.target for u in emb.users}          # the residual: bf16 x
    assert dict(model.named_parameters()) == params                   # restored, same objects
    assert {id(p) for p in cap.gm.parameters()} <= {id(p) for p in params.values()}
    assert all(p.dtype == torch.float32 for p in cap.gm.parameters())
    with torch.no_grad():   # bf16 parameters, fp32 buffers: as MixedPrecision runs the model
        for p in params.values():
            p.data = p.data.to(torch.bfloat16)
    torch.testing.assert_close(cap.gm(ids, tgt), lm_cross_entropy(model(ids), tgt),
                               rtol=0, atol=0)


def test_bf16_capture_rejects_an_integer_dtype():
    ids, tgt = pass_batch()
    with pytest.raises(ValueError, match=r"compute_dtype=torch.int32: must be a floating"):
        capture(pass_model("gpt"), (ids,), lm_cross_entropy, tgt, compute_dtype=torch.int32)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_build_drops_exports_metadata_checks_under_bf16(precision):
    """transformers' Mixtral captures an `_assert_tensor_metadata(embedding, dtype=...)`;
    build's bf16 graph (passes/export_checks.py) keeps none, its fp32 graph is the capture's
    as it was; each build's embedding has the precision's dtype."""
    from autopar.api import ParallelProgram
    from autopar.build import build_program
    from programs import loss_fn, make_plan
    from models import build
    model = build("hf_mixtral", seed=0)
    ids, tgt = (x % 64 for x in pass_batch(seq=8))   # the model's vocabulary, the plan's seq
    cap = capture(model, (ids,), loss_fn, tgt)
    check = torch.ops.aten._assert_tensor_metadata.default
    assert any(n.target == check for n in cap.gm.graph.nodes)
    prog = ParallelProgram(model=model, plan=make_plan(), profile=None, example_inputs=(ids,),
                           loss_fn=loss_fn, example_targets=tgt, cluster=None)
    built = build_program(prog, precision)
    assert built.precision == precision and build_program(prog, precision) is built
    assert any(n.target == check for n in built.gm.graph.nodes) == (precision == "fp32")
    emb = next(n for n in built.gm.graph.nodes if n.target == torch.ops.aten.embedding.default)
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert emb.meta[K.VAL].dtype == want
