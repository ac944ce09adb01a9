"""Layers: repeated blocks, embedding and head regions, found from the module stack."""
from __future__ import annotations

import pytest
import torch

from autopar.passes import meta as K
from autopar.passes.capture import capture
from autopar.passes.layers import LayerError, block_signature, find_layers

from models import LAYERS, captured


def test_blocks_and_regions(tiny_name):
    _, cap = captured(tiny_name)
    s = find_layers(cap)
    assert s.num_blocks == s.num_layers == LAYERS
    assert all(block_signature(s, i) == block_signature(s, 0) for i in range(LAYERS))
    nodes = list(cap.gm.graph.nodes)
    assert all(K.REGION in n.meta for n in nodes)
    region = {n.name: n.meta[K.REGION] for n in nodes}
    targets = {n.name: str(n.target) for n in nodes}
    emb = {targets[x] for x in s.embedding_nodes}
    head = {targets[x] for x in s.head_nodes}
    assert "aten.embedding.default" in emb
    assert "aten.cross_entropy_loss.default" in head
    assert not any("embedding" in targets[x] for x in s.head_nodes)
    # every block reads the residual stream from the previous region and hands it on
    for i in range(1, LAYERS):
        assert set(s.block_outputs[i - 1]) & set(s.block_inputs[i])
        assert all(region[x] != ("block", i) for x in s.block_inputs[i])
    by_name = {n.name: n for n in nodes}
    head_reads = {a.name for x in s.head_nodes for a in by_name[x].all_input_nodes}
    assert set(s.block_outputs[-1]) & head_reads


def test_rotary_tables_shared_by_all_blocks_are_embedding():
    _, cap = captured("hf_llama")
    s = find_layers(cap)
    shared = set(s.block_inputs[0])
    for i in range(1, LAYERS):
        shared &= set(s.block_inputs[i])
    assert shared, "the rotary cos/sin (and mask) feed every block"
    region = {n.name: n.meta[K.REGION] for n in cap.gm.graph.nodes}
    assert all(region[x] == ("embedding", None) for x in shared)
    rotary = [n for n in cap.gm.graph.nodes if n.op == "call_function"
              and any("rotary" in v[0] for v in (n.meta.get(K.NN_MODULE_STACK) or {}).values())]
    assert rotary and all(n.meta[K.REGION] == ("embedding", None) for n in rotary)


def test_truncated_capture_reports_true_layer_count():
    _, cap = captured("gpt", 2)
    s = find_layers(cap)
    assert (s.num_blocks, s.num_layers) == (2, LAYERS)
    _, full = captured("gpt")
    assert block_signature(find_layers(full), 0) == block_signature(s, 0)


class _Uneven(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8),
                                           torch.nn.Linear(8, 8)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i != 1 else layer(x).relu()
        return x


def test_differing_blocks_become_kinds():
    """Blocks of one stack whose graphs differ are kinds, in the stack's order (issue 31)."""
    cap = capture(_Uneven(), (torch.randn(2, 8),))
    s = find_layers(cap)
    assert s.mixed and s.num_blocks == 3 and len(s.kinds) == 2
    assert s.pattern == (0, 1, 0)
    assert [k.block_ids for k in s.kinds] == [(0, 2), (1,)]


def _tiny(name: str, **sizes):
    from autopar.examples.gpt import lm_cross_entropy
    from models import build, token_batches
    ids, tgt = token_batches(64, (2, 8), 1, seed=1)[0]
    return capture(build(name, seed=0, **sizes), (ids,), lm_cross_entropy, tgt)


@pytest.mark.parametrize("name,mod", [
    ("hf_albert", "model.albert.encoder.albert_layer_groups.0"), ("shared_block", "model.block")])
def test_block_called_at_several_depths_is_a_stack_of_calls(name, mod):
    """One module called at every depth (ALBERT's layer group, a decoder calling one block 3
    times) is a stack of its calls, not the embedding tables beside each other that ALBERT's
    finder used to take; its weights are read by the first call (the region of a parameter
    is its first user's), and the plan's notes say they are shared (issue 31 item 2)."""
    cap = _tiny(name, layers=3)
    s = find_layers(cap)
    assert s.block_paths == (mod, mod + "@1", mod + "@2") and s.num_layers == 3
    assert s.kinds[0].shared == (mod,) and not s.mixed
    assert any("called at 3 depths" in n for n in s.notes)
    region = {n.name: n.meta[K.REGION] for n in cap.gm.graph.nodes}
    weights = [n for n in cap.gm.graph.nodes if n.op == "get_attr"
               and n.target.startswith(mod + ".")]
    assert weights and all(region[n.name] == ("block", 0) for n in weights)
    assert all(set(s.block_outputs[i - 1]) & set(s.block_inputs[i]) for i in (1, 2))


def test_a_block_computing_its_own_value_before_reading_the_residual_is_a_stack():
    """Nemotron's LayerNorm1P computes `weight + 1` in each block before its norm reads the
    residual: the norm's inputs are the previous block's output and the block's own value.
    The blocks still run one into the next (each input counts, not only the latest), so they
    are a stack of 3, not one block per child of the model."""
    import models
    model = models.build("hf_nemotron", seed=0, layers=3)
    s = find_layers(capture(model, (torch.zeros(2, 8, dtype=torch.long),)))
    assert s.num_blocks == 3 and not s.notes and not s.mixed
    assert s.block_paths == tuple(f"model.model.layers.{i}" for i in range(3))


def test_no_repeated_stack_plans_one_block_per_child():
    """No stack of repeated blocks (a decoder of named attn / mlp modules; the repeated
    siblings are side by side or inside one module): each child of the model holding a
    matmul, but the last (the LM head), is a block of its own kind, and a note says so
    (issue 31 item 5)."""
    s = find_layers(_tiny("no_list"))
    assert s.block_paths == ("model.attn", "model.mlp") and s.mixed and s.pattern == (0, 1)
    assert [k.block_class.rpartition(".")[2] for k in s.kinds] == ["CausalSelfAttention", "MLP"]
    assert "one block per child of model" in s.notes[0]
    assert set(s.block_outputs[0]) & set(s.block_inputs[1])


def test_no_matmul_is_a_clear_error():
    cap = capture(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()), (torch.randn(2, 4),))
    with pytest.raises(LayerError, match="no block to plan.*Fix:") as e:
        find_layers(cap)
    assert "\n" not in str(e.value)


def _seq2seq(name: str, repeat_limit: int | None = None):
    from autopar.examples.gpt import lm_cross_entropy
    from models import build, seq2seq_batches
    model = build(name, seed=0, layers=3)
    (ids, mask, dec), tgt = seq2seq_batches(64, (2, 8), 1, seed=1)[0]
    return capture(model, (ids, mask, dec), lm_cross_entropy, tgt, repeat_limit=repeat_limit)


@pytest.mark.parametrize("name", ["hf_t5", "hf_bart", "hf_bert2bert"])
def test_encoder_and_decoder_stacks_are_two_kinds(name):
    """The encoder's and the decoder's blocks are two kinds, found from the module stack (T5:
    inside two T5Stacks of one class; BART: two lists of different classes; BERT2BERT: one
    class, the decoder's layers with a self- and a cross-attention, which are not mistaken
    for blocks), numbered over both in execution order; the encoder's output (read by every
    decoder block's cross-attention) leaves the last encoder block."""
    s = find_layers(_seq2seq(name))
    assert [k.num_layers for k in s.kinds] == [3, 3] and s.num_layers == s.num_blocks == 6
    assert [k.first for k in s.kinds] == [0, 3]
    enc, dec = s.kinds
    assert all(p.startswith(enc.container + ".") for p in s.block_paths[:3])
    assert all(p.startswith(dec.container + ".") for p in s.block_paths[3:])
    assert enc.container != dec.container
    encoder_out = set(s.block_outputs[2])
    for i in range(3, 6):   # every decoder block reads the encoder's output
        assert encoder_out & set(s.block_inputs[i]), i
    assert s.kind_of(2) == 0 and s.kind_of(3) == 1


@pytest.mark.parametrize("name", ["hf_t5", "hf_bart"])
def test_truncated_encoder_decoder_counts_each_stack(name):
    cap = _seq2seq(name, repeat_limit=2)
    s = find_layers(cap)
    assert s.num_blocks == 4 and [k.num_layers for k in s.kinds] == [3, 3]
    assert [k.first_layer for k in s.kinds] == [0, 3] and s.num_layers == 6


class _Alternating(torch.nn.Module):
    """Two lists of blocks whose blocks run in turn: a[0], b[0], a[1], b[1]."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.b = torch.nn.ModuleList([torch.nn.Bilinear(8, 8, 8) for _ in range(2)])

    def forward(self, x):
        for a, b in zip(self.a, self.b):
            x = b(a(x), x)
        return x


def test_interleaved_stacks_are_refused():
    cap = capture(_Alternating(), (torch.randn(2, 8),))
    with pytest.raises(LayerError, match="interleave in execution") as e:
        find_layers(cap)
    assert "\n" not in str(e.value)
