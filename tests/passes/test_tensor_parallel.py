"""Pass tests for tensor parallelism on small captured graphs (single process, no collectives run).

apply_tensor_parallel(gm, t, rank, group=None) rewrites the graph for inspection: we count the
inserted collective nodes, check the parameter splits and shape constants, lint the graph, and
check the errors for inputs the pass cannot split.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.examples.gpt import GPT, lm_cross_entropy
from autopar.passes import meta as K
from autopar.passes.capture import capture
from autopar.passes.sharding import Partial, Replicate, Shard, unflattened_sizes, map_reshape
from autopar.passes.tensor_parallel import (apply_tensor_parallel, param_splits,
                                            propagate_sharding, tp_report)
from autopar.runtime import collectives as C
from autopar.runtime import shard as shard_rt

import models

B, T = 2, 8


def _gpt_gm(n_layer: int = 2, n_head: int = 4, n_embd: int = 32, vocab: int = 64,
            device: str = "cpu", with_model: bool = False):
    with torch.device(device):
        model = models.gpt(vocab=vocab, layers=n_layer, heads=n_head, hidden=n_embd)
    ids = torch.randint(0, vocab, (B, T), device=device)
    gm = capture(model, (ids,), lm_cross_entropy, ids).gm
    return (gm, model) if with_model else gm


def _llama_gm(kv: int = 2, n_layer: int = 2):
    model = models.llama_style(kv_heads=kv, layers=n_layer)
    ids = torch.randint(0, 64, (B, T))
    return capture(model, (ids,), lm_cross_entropy, ids).gm


def _calls(gm, fn) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


# ----- layouts and reshape mapping -----------------------------------------------------------

def test_map_reshape_splits_hidden_into_heads():
    # (B, T, C=32) split by t=2 → view (B, T, 4 heads, 8): the heads dim carries the split
    lay = map_reshape((2, 8, 32), (2, 8, 4, 8), Shard(2, (32,)), 2)
    assert lay == Shard(2, (4,))
    # and back: (B, T, 4, 8) with heads split → (B, T, 32) split
    assert map_reshape((2, 8, 4, 8), (2, 8, 32), Shard(2, (4,)), 2) == Shard(2, (32,))
    # 3 heads cannot be split in 2
    assert map_reshape((2, 8, 24), (2, 8, 3, 8), Shard(2, (24,)), 2) is None
    # flattening tokens keeps the feature split; a sequence split becomes per-batch blocks
    assert map_reshape((2, 8, 32), (16, 32), Shard(2, (32,)), 2) == Shard(1, (32,))
    assert map_reshape((2, 8, 32), (16, 32), Shard(1, (8,)), 2) == Shard(0, (8, 8))


def test_map_reshape_reads_blocks_repeated_in_each_row_of_the_outer_dim():
    # Llama 4's experts: (B·T, C) rows of 2 sequences of 8, split per sequence, repeated once
    # per expert (E = 4: 8 blocks), viewed (E, B·T, C): each expert's row holds the same two
    # blocks, so the split lands on dim 1
    rows = Shard(0, (8,) * 8)
    assert map_reshape((64, 16), (4, 8 * 2, 16), rows, 2) == Shard(1, (8, 8))
    # blocks that differ from one expert's rows to the next cannot be read that way
    assert map_reshape((32, 16), (4, 8, 16), Shard(0, (4, 4, 8, 8, 4, 4)), 2) is None
    # and each block must divide by t
    assert map_reshape((24, 16), (4, 6, 16), Shard(0, (3, 3) * 4), 2) is None


# ----- the Megatron pattern ----------------------------------------------------------------------

def test_gpt_megatron_pattern_from_propagation():
    gm = propagate_sharding(_gpt_gm(), 2)
    info = gm.meta[K.TP_INFO]
    assert len(info.column) == 2 * 2 + 1     # qkv and fc per layer, and the LM head
    assert len(info.row) == 2 * 2            # proj and fc2 per layer
    assert not info.fallbacks
    params = info.params
    qkv = next(v for k, v in params.items() if k.endswith("h.0.attn.c_attn.weight"))
    assert qkv == shard_rt.ParamSplit(dim=0, blocks=(32, 32, 32))   # split per q / k / v
    proj = next(v for k, v in params.items() if k.endswith("h.0.attn.c_proj.weight"))
    assert proj.dim == 1                                            # row-parallel: input dim
    assert not any(k.endswith("ln_1.weight") or k.endswith("c_proj.bias") for k in params)
    layouts = {n.name: n.meta[K.TP_LAYOUT] for n in gm.graph.nodes}
    assert isinstance(layouts["scaled_dot_product_attention"], Shard)
    assert layouts["scaled_dot_product_attention"].dim == 1        # split by heads
    assert isinstance(layouts["linear_1"], Partial)
    assert isinstance(layouts["layer_norm_1"], Replicate)


def test_two_forward_all_reduces_per_layer():
    for n_layer in (1, 3):
        gm = apply_tensor_parallel(_gpt_gm(n_layer=n_layer), 2, 0, None)
        # 2 per layer + 1 for the vocab-parallel embedding; nothing is gathered
        assert len(_calls(gm, C.reduce_from_tp)) == 2 * n_layer + 1
        assert not _calls(gm, C.gather_from_sp) and not _calls(gm, C.all_gather_sp)
        # f before each column-parallel region (qkv, fc) and the LM head
        f_acts = [n for n in _calls(gm, C.copy_to_tp) if n.args[0].op != "get_attr"]
        assert len(f_acts) == 2 * n_layer + 1
        gm.graph.lint()


@pytest.mark.parametrize("name", ["hf_falcon", "hf_neox", "hf_gptj", "hf_neox_dropout"])
@pytest.mark.parametrize("sp", [False, True], ids=["all-reduce", "sequence-parallel"])
def test_parallel_attention_and_mlp_branches_reduce_once(sp, name):
    """Parallel blocks (Falcon, GPT-NeoX, GPT-J) add the attention and MLP row-parallel outputs
    before the residual: partial + partial stays partial (through dropouts, the biases added
    after the reduction, masked by a dropout's noise), so one reduction per layer (GPT-NeoX's
    Megatron
    reduces its parallel residual once too), not two; the cost model's correction drops the
    merged all-reduce."""
    from autopar.passes.layers import find_layers
    from autopar.passes.graph_profile import profile_from_graph
    from autopar.passes.tp_cost import tp_corrections
    ids = torch.randint(0, 64, (2, 8))
    layers = 3 if name == "hf_falcon" else 2
    make = {"hf_falcon": lambda: models.hf_falcon(layers=layers),
            # dropout 0.3 on each biased branch: bias·noise added after the one reduction
            "hf_neox_dropout": lambda: models.hf_neox(dropout=0.3)}.get(
                name, getattr(models, name, None))
    gm = apply_tensor_parallel(capture(make(), (ids,), lm_cross_entropy, ids).gm, 2, 0, None,
                               sequence_parallel=sp)
    reduce = C.reduce_scatter_to_sp if sp else C.reduce_from_tp
    assert len(_calls(gm, reduce)) == layers + 1          # + the vocab-parallel embedding
    gm.graph.lint()
    cap = capture(make(), (ids,), lm_cross_entropy, ids, repeat_limit=2)
    structure = find_layers(cap)
    prof = profile_from_graph(cap, structure)
    fix = next(c for c in tp_corrections(cap, structure, prof, [2], sequence_parallel=[sp])
               if c.t == 2 and c.sequence_parallel == sp)
    assert prof.block.tp_allreduce_elems == 2 * 8 * prof.hidden     # structural: 2 per layer
    assert fix.block.allreduce_elems_removed == 8 * prof.hidden     # the pass does one


def test_sequence_parallel_swaps_all_reduce_for_gather_and_reduce_scatter():
    gm = apply_tensor_parallel(_gpt_gm(n_layer=2), 2, 0, None, sequence_parallel=True)
    assert not _calls(gm, C.reduce_from_tp)
    assert len(_calls(gm, C.reduce_scatter_to_sp)) == 2 * 2 + 1   # rows + embedding
    assert len(_calls(gm, C.all_gather_sp)) == 2 * 2 + 1          # columns + LM head
    # norm weights live in the sequence-split region: their gradients are all-reduced (f)
    f_params = {n.args[0].target for n in _calls(gm, C.copy_to_tp) if n.args[0].op == "get_attr"}
    assert any(t.endswith("ln_1.weight") for t in f_params)
    gm.graph.lint()


def _overlapped(gm):
    from autopar.passes.overlap import overlap_tp_backward
    return overlap_tp_backward(gm)


def test_overlap_fuses_each_column_entry_with_its_projections():
    """passes.overlap: f + the q/k/v (gate/up, head) linears it feeds become one
    column_parallel call; each row-parallel linear (o, down) and its g one row_parallel call
    (the collective matmul); every other collective is untouched."""
    gm = apply_tensor_parallel(_llama_gm(n_layer=3), 2, 0, None)
    before = len(_calls(gm, C.reduce_from_tp))
    gm = _overlapped(gm)
    fused = _calls(gm, C.column_parallel)
    rows = _calls(gm, C.row_parallel)
    assert len(fused) == 2 * 3 + 1   # attention, MLP; LM head
    assert len(rows) == 2 * 3 and len(fused) + len(rows) == gm.meta[K.OVERLAP]
    assert all(n.args[2] == "linear" and n.args[4] is None for n in rows)
    assert len(_calls(gm, C.reduce_from_tp)) == before - len(rows)
    assert [len(n.args[2]) for n in fused] == [3, 2] * 3 + [1]     # q,k,v | gate,up | head
    assert all(n.args[2] == ("linear",) * len(n.args[2]) and n.args[5] is None for n in fused)
    assert not [n for n in _calls(gm, C.copy_to_tp) if n.args[0].op != "get_attr"]
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default
                and n.args[0].target is C.column_parallel]
    assert "column_parallel(mul_1, tp_group, ('linear', 'linear', 'linear')" in gm.code
    gm.graph.lint()


def test_overlap_under_sequence_parallel_keeps_the_gather_dim():
    gm = _overlapped(apply_tensor_parallel(_llama_gm(), 2, 0, None, sequence_parallel=True))
    fused = _calls(gm, C.column_parallel)
    assert len(fused) == 2 * 2 + 1 and {n.args[5] for n in fused} == {1}
    assert not _calls(gm, C.all_gather_sp)
    rows = _calls(gm, C.row_parallel)   # o and down: reduce-scatter along the sequence
    assert len(rows) == 2 * 2 and {n.args[4] for n in rows} == {1}


def test_overlap_reads_conv1d_addmm_and_x_matmul_w_t():
    """GPT-2's Conv1D is addmm(b, x, W) with W (in, out); Falcon's x @ w.T a matmul: both
    are projections ("mm" layout), biases ride along."""
    model = models.hf_gpt2(layers=1, dropout=0.1, attn_dropout=0.1)
    ids = torch.randint(0, 64, (B, T))
    for m, biased in ((model, True), (models.hf_falcon(layers=1), False)):
        gm = _overlapped(apply_tensor_parallel(
            capture(m, (ids,), lm_cross_entropy, ids).gm, 2, 0, None))
        fused = _calls(gm, C.column_parallel)
        assert len(fused) == 3 and "mm" in {lay for n in fused for lay in n.args[2]}
        # Conv1D's bias rides along (added once per rank: it is split with the columns)
        assert any(b is not None for n in fused for b in n.args[4]) == biased
        gm.graph.lint()


def test_overlap_leaves_an_entry_with_a_non_projection_user():
    """OLMo-2's q/k norm statistic enters the split region through f into a mul, not a
    projection: that f stays a plain copy_to_tp; the others are fused."""
    ids = torch.randint(0, 64, (B, T))
    gm = apply_tensor_parallel(capture(models.hf_olmo2(), (ids,), lm_cross_entropy, ids).gm, 2,
                               0, None)
    entries = [n for n in _calls(gm, C.copy_to_tp) if n.args[0].op != "get_attr"]
    gm = _overlapped(gm)
    left = [n for n in _calls(gm, C.copy_to_tp) if n.args[0].op != "get_attr"]
    columns = _calls(gm, C.column_parallel)
    assert len(columns) == 2 * 2 + 1 == len(entries) - len(left) and left
    assert gm.meta[K.OVERLAP] == len(columns) + len(_calls(gm, C.row_parallel))
    for n in left:
        assert any(u.target is not torch.ops.aten.linear.default for u in n.users)
    gm.graph.lint()


def test_generated_code_reads_like_megatron():
    gm = apply_tensor_parallel(_gpt_gm(n_layer=1), 2, 0, None)
    code = gm.code
    assert "tp_group = self.tp_group" in code
    assert "copy_to_tp(layer_norm, tp_group)" in code
    assert "split_with_sizes.default(linear, [16, 16, 16], 2)" in code    # local q, k, v
    assert "view.default(getitem, [2, 8, 2, 8])" in code                   # n_heads / t
    # row-parallel output reduced after its dropout (p = 0: the identity), bias added after
    assert "reduce_from_tp(dropout_1, tp_group)" in code
    assert "vocab_parallel_cross_entropy" in code and "vocab_parallel_embedding" in code


def test_local_shapes_and_meta_vals():
    gm = apply_tensor_parallel(_gpt_gm(n_layer=1), 2, 1, None)
    w = gm.get_parameter("model.transformer.h.0.attn.c_attn.weight")
    assert tuple(w.shape) == (48, 32)
    sdpa = next(n for n in gm.graph.nodes if n.name == "scaled_dot_product_attention")
    assert tuple(sdpa.meta[K.VAL].shape) == (B, 2, T, 8)
    assert tuple(sdpa.meta[K.TP_GLOBAL_VAL].shape) == (B, 4, T, 8)


def test_transformers_gpt2_conv1d_split_on_stored_dims():
    model = models.hf_gpt2(layers=1, dropout=0.1, attn_dropout=0.1)
    ids = torch.randint(0, 64, (B, T))
    gm = propagate_sharding(capture(model, (ids,), lm_cross_entropy, ids).gm, 2)
    params = gm.meta[K.TP_INFO].params
    c_attn = next(v for k, v in params.items() if k.endswith("c_attn.weight"))
    assert c_attn == shard_rt.ParamSplit(dim=1, blocks=(32, 32, 32))   # Conv1D: (in, out)
    c_proj = next(v for k, v in params.items() if k.endswith("attn.c_proj.weight"))
    assert c_proj.dim == 0


def test_gqa_kv_heads_split_when_divisible():
    gm = propagate_sharding(_llama_gm(kv=2), 2)
    params = gm.meta[K.TP_INFO].params
    assert next(v for k, v in params.items() if k.endswith("0.attn.k_proj.weight")).dim == 0
    assert not gm.meta[K.TP_INFO].fallbacks


def test_gqa_fewer_kv_heads_than_t_replicates_kv_and_reports_it():
    gm = propagate_sharding(_llama_gm(kv=2), 4)
    info = gm.meta[K.TP_INFO]
    assert not any(k.endswith("k_proj.weight") for k in info.params)
    assert any(k.endswith("q_proj.weight") for k in info.params)
    reported = {f.node for f in info.fallbacks}
    assert len(reported) == 4                      # k and v of both layers
    assert all("llama.py" in f.where for f in info.fallbacks)
    assert "replicated" in info.summary()


def test_sequence_parallel_replicated_kv_reads_the_gathered_sequence():
    """SP, t=4 > kv_heads=2: the fallen-back k/v matmuls read the all-gathered block input (as
    q does), so attention sees k/v whole along the sequence and slices them by heads."""
    gm = propagate_sharding(_llama_gm(kv=2), 4, sequence_parallel=True)
    info = gm.meta[K.TP_INFO]
    assert len({f.node for f in info.fallbacks}) == 4     # k and v of both layers
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in {f.node for f in info.fallbacks}:
        node = nodes[name]
        x = node.args[0]
        assert isinstance(x.meta[K.TP_LAYOUT], Shard) and x.meta[K.TP_LAYOUT].seq, name
        assert node.meta[K.TP_CONVERT] == {x.name: Replicate()}, name
        assert isinstance(node.meta[K.TP_LAYOUT], Replicate), name
    sdpa = torch.ops.aten.scaled_dot_product_attention
    attn = [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is sdpa]
    assert len(attn) == 2 and all(not n.meta[K.TP_LAYOUT].seq for n in attn)
    gm = apply_tensor_parallel(gm, 4, 0, None, sequence_parallel=True)
    gm.graph.lint()


# ----- bad input ---------------------------------------------------------------------------------

def test_heads_not_divisible_by_pinned_t_is_a_clear_error():
    gm = _gpt_gm(n_layer=1, n_head=6, n_embd=48)
    with pytest.raises(ValueError) as err:
        propagate_sharding(gm, 4)
    msg = str(err.value)
    assert "t=4" in msg and "gpt.py" in msg and "fix:" in msg


def test_kv_groups_not_divisible_by_pinned_t_names_the_groups():
    # Falcon's fused qkv is grouped per kv head: (…, 64) -> (…, 2 groups, 4, 8); at t=4 the
    # split would cut inside a group (Megatron-Core requires t | query groups as well)
    ids = torch.randint(0, 64, (B, T))
    gm = capture(models.hf_falcon(layers=1), (ids,), lm_cross_entropy, ids).gm
    with pytest.raises(ValueError) as err:
        propagate_sharding(gm, 4)
    msg = str(err.value)
    assert "unflattens into [2, 4, 8]" in msg and "t must divide 2" in msg
    assert "modeling_falcon.py" in msg and "fix:" in msg
    assert unflattened_sizes((2, 8, 64), (2, 8, 2, 4, 8), 2) == [2, 4, 8]
    assert unflattened_sizes((2, 8, 64), (2, 8, 64), 2) is None
    assert unflattened_sizes((2, 8, 64), (16, 64), 2) is None


def test_bad_t_and_sequence_length():
    with pytest.raises(ValueError, match="positive integer"):
        propagate_sharding(_gpt_gm(n_layer=1), 0)
    model = models.gpt(layers=1)
    ids = torch.randint(0, 64, (B, 9))
    gm = capture(model, (ids,), lm_cross_entropy, ids).gm
    with pytest.raises(ValueError, match="sequence length 9"):
        propagate_sharding(gm, 2, sequence_parallel=True)


class _SortMLP(nn.Module):
    """A linear whose output goes through an op the pass has no rule for (sort)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.sort(self.up(x), dim=-1).values
        return (self.down(h) + self.b(torch.relu(self.a(x)))).sum()


def test_unsplittable_op_falls_back_to_replicated_and_is_reported():
    gm = capture(_SortMLP(), (torch.randn(4, 16),)).gm
    info = propagate_sharding(gm, 2).meta[K.TP_INFO]
    assert [f.node for f in info.fallbacks] == ["linear"]
    assert "sort" in info.fallbacks[0].reason
    assert "test_tensor_parallel.py" in info.fallbacks[0].where
    assert "linear_2" in info.column and info.row == ["linear_3"]  # the relu MLP still splits


def test_apply_checks_group_and_rank():
    with pytest.raises(ValueError, match="tp_rank=2"):
        apply_tensor_parallel(_gpt_gm(n_layer=1), 2, 2, None)


# ----- local shards --------------------------------------------------------------------------------

def test_param_split_round_trip():
    full = torch.arange(6 * 4 * 3, dtype=torch.float32).reshape(12, 6)
    for split in (shard_rt.ParamSplit(0, (4, 4, 4)), shard_rt.ParamSplit(1, (6,)),
                  shard_rt.ParamSplit(0, (12,), padded=16)):
        pieces = [shard_rt.local_shard(full, split, r, 2) for r in range(2)]
        assert all(p.shape[split.dim] == split.local_size(2) for p in pieces)
        assert torch.equal(shard_rt.unshard(pieces, split, full.shape[split.dim]), full)


def test_meta_model_materialises_only_local_shards():
    def build(rank):
        gm, model = _gpt_gm(n_layer=1, device="meta", with_model=True)
        return apply_tensor_parallel(gm, 2, rank, None, model=model, init=GPT.init_weights,
                                     seed=7)
    gm = build(1)
    w = gm.get_parameter("model.transformer.h.0.mlp.c_fc.weight")
    assert not w.is_meta and tuple(w.shape) == (64, 32)
    assert 0.01 < w.std().item() < 0.03                      # the model's own N(0, 0.02)
    ln = gm.get_parameter("model.transformer.h.0.ln_1.weight")
    assert torch.equal(ln, torch.ones(32))                    # reset_parameters for the rest
    again = build(1)
    assert torch.equal(again.get_parameter("model.transformer.h.0.mlp.c_fc.weight"), w)
    other = build(0)
    assert not torch.equal(other.get_parameter("model.transformer.h.0.mlp.c_fc.weight"), w)
    assert not any(p.is_meta for p in gm.parameters())


# ----- loss recognition, logits, dropout, report ---------------------------------------------

def _nll_loss(out, y):
    return torch.nn.functional.nll_loss(torch.log_softmax(out.flatten(0, -2), -1), y.flatten(),
                                        ignore_index=-1)


def _smoothed(out, y):
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten(),
                                             label_smoothing=0.1)


def _gm_with(loss_fn, n_embd: int = 32, vocab: int = 64, dropout: float = 0.0):
    model = models.gpt(vocab=vocab, layers=1, hidden=n_embd, dropout=dropout)
    model.train()
    ids = torch.randint(0, vocab, (B, T))
    return capture(model, (ids,), loss_fn, ids).gm if loss_fn else capture(model, (ids,)).gm


def test_log_softmax_nll_loss_is_a_vocab_parallel_cross_entropy():
    gm = apply_tensor_parallel(_gm_with(_nll_loss), 2, 0, None)
    ce = _calls(gm, shard_rt.vocab_parallel_cross_entropy)
    assert len(ce) == 1 and ce[0].args[4] == -1                   # ignore_index carried over
    assert not [n for n in gm.graph.nodes if "log_softmax" in str(n.target)]   # dead, erased
    assert not _calls(gm, C.gather_from_sp) and not _calls(gm, C.all_gather_sp)
    assert not gm.meta[K.TP_INFO].fallbacks


def test_label_smoothing_keeps_the_head_replicated_and_says_why():
    gm = propagate_sharding(_gm_with(_smoothed), 2)
    reasons = " ".join(f.reason for f in gm.meta[K.TP_INFO].fallbacks)
    assert "label smoothing" in reasons
    assert not any(n.meta.get(K.TP_ROLE) == "vocab_ce" for n in gm.graph.nodes)
    report = "\n".join(tp_report(2, gm))
    assert "label smoothing" in report and "replicated:" in report


def test_logits_without_loss_gathered_only_when_it_pays():
    # tiny C=32, V=64: 24 FLOP saved per byte gathered, below any machine balance → replicated
    gm = propagate_sharding(_gm_with(None), 2)
    head = [f for f in gm.meta[K.TP_INFO].fallbacks if "without a loss" in f.reason]
    assert len(head) == 1 and "gpt.py" in head[0].where
    # C=256, V=512 on a balance-50 machine: 192 FLOP per byte → column head + all-gather
    from autopar.cost.hardware import get_cluster, with_overrides
    cheap = with_overrides(get_cluster("dgx-a100-80gb"), peak_flops=50e9,
                           gemm_max_efficiency=1.0, intra_node_bandwidth_Bps=1e9)
    gm = propagate_sharding(_gm_with(None, n_embd=256, vocab=512), 2, cluster=cheap)
    assert not gm.meta[K.TP_INFO].fallbacks
    assert any("all-gathered at the output" in n for n in gm.meta[K.TP_INFO].notes)
    gm = apply_tensor_parallel(gm, 2, 0, None)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    gathers = _calls(gm, C.gather_from_sp)
    assert len(gathers) == 1 and gathers[0] in out.all_input_nodes
    gm.graph.lint()


def test_attention_dropout_in_split_regions_uses_the_rank_stream():
    gm = apply_tensor_parallel(_gm_with(lm_cross_entropy, dropout=0.1), 2, 0, None)
    assert len(_calls(gm, shard_rt.tp_sdpa)) == 1                # the head-split attention
    plain = [n for n in gm.graph.nodes
             if getattr(n.target, "overloadpacket", None) is torch.ops.aten.scaled_dot_product_attention]
    assert not plain
    # the residual / embedding dropouts are replicated: default stream, left as aten.dropout
    assert len([n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default]) == 3
    assert any("per-rank RNG streams" in line for line in tp_report(2, gm))


def test_tp_report_lines():
    gm = _gpt_gm(n_layer=1)
    lines = tp_report(2, gm)
    assert lines[0].startswith("tensor parallel t=2: 3 column, 2 row")   # + LM head
    assert tp_report(1, gm) == ["tensor parallel: off (t=1)"]
    gm = propagate_sharding(_llama_gm(kv=2), 4)
    assert sum("replicated: " in line for line in tp_report(4, gm)) == 4


# ----- more transformers architectures: the pattern comes out of propagation --------------------

# name -> extra forward all-reduces per layer beyond Megatron's 2 (OLMo-2: the q and k RMSNorms
# normalise over all heads, so each all-reduces its (B, T, 1) statistic; Falcon, GPT-J,
# GPT-NeoX and Phi: their parallel attention and MLP outputs are summed before one reduction,
# through dropouts of probability 0, with the row-parallel biases added once after it)
_MORE = {"hf_neox": -1, "hf_falcon": -1, "hf_gptj": -1, "hf_bloom": 0, "hf_olmo2": 2,
         "hf_mistral": 0, "hf_qwen3": 0, "hf_phi": -1, "hf_opt": 0, "hf_gemma": 0,
         "torch_encoder": 0}


@pytest.mark.parametrize("name", sorted(_MORE))
def test_more_transformers_architectures_split_like_megatron(name):
    model = models.build(name, seed=0)
    ids = torch.randint(0, 64, (B, T))
    gm = apply_tensor_parallel(capture(model, (ids,), lm_cross_entropy, ids).gm, 2, 0, None)
    info = gm.meta[K.TP_INFO]
    assert not info.fallbacks, info.summary()
    assert len(info.row) == 2 * 2                       # attention out + MLP down, 2 layers
    # 2 all-reduces per layer (+ the statistics), + 1 for the vocab-parallel embedding
    assert len(_calls(gm, C.reduce_from_tp)) == (2 + _MORE[name]) * 2 + 1
    assert len(_calls(gm, shard_rt.partial_mean)) == max(0, _MORE[name]) * 2
    assert not _calls(gm, C.gather_from_sp) and not _calls(gm, C.all_gather_sp)
    local = sum(p.numel() for p in gm.parameters())
    full = sum(p.numel() for p in model.parameters())
    assert 0.49 < local / full < 0.53                   # only norms and biases replicated
    gm.graph.lint()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_multi_query_fused_qkv_splits_q_and_holds_kv_whole(attn):
    """GPT-BigCode multi-query: c_attn's output is [q (H·d) | k (d) | v (d)]; one k/v head
    cannot be split by heads, so q is split and k/v are held whole on every rank (found from
    the split of the output and attention's use of it, written as sdpa or as matmuls): the
    weight and bias keep all k/v rows, their gradients summed over t (copy_to_tp_parts),
    attention is split by query heads and nothing falls back."""
    model = models.hf_bigcode(attn_implementation=attn)
    ids = torch.randint(0, 64, (B, T))
    gm = apply_tensor_parallel(capture(model, (ids,), lm_cross_entropy, ids).gm, 2, 0, None)
    info = gm.meta[K.TP_INFO]
    assert not info.fallbacks, info.summary()
    assert len(info.row) == 2 * 2 and info.vocab
    hidden, d = 32, 8
    split = info.params["model.transformer.h.0.attn.c_attn.weight"]
    assert split == shard_rt.ParamSplit(0, (hidden, d, d), whole=(False, True, True))
    c_attn = gm.get_submodule("model.transformer.h.0.attn.c_attn")
    assert tuple(c_attn.weight.shape) == (hidden // 2 + 2 * d, hidden)
    parts = _calls(gm, C.copy_to_tp_parts)
    assert len(parts) == 2 * 2 and all(n.args[3] == [(16, 8), (24, 8)] for n in parts)
    splits = [n for n in gm.graph.nodes if n.target is torch.ops.aten.split_with_sizes.default]
    assert [n.args[1] for n in splits] == [[hidden // 2, d, d]] * 2
    local = sum(p.numel() for p in gm.parameters())
    full = sum(p.numel() for p in model.parameters())
    assert local <= 0.75 * full, (local, full)
    assert "replicated:" not in "\n".join(tp_report(2, gm))
    gm.graph.lint()


def test_multi_query_viewed_then_sliced_and_indexed_splits_q_only():
    """Falcon-7B's multi-query: the fused output viewed as (B, T, H+2, d), q sliced
    [..., :-2, :], k and v indexed [..., [-2], :] / [..., [-1], :]: the slice and the index
    refine the seed at their rows (scaled back through the view), the view holds the one-head
    blocks whole, and each becomes a narrow at this rank's local rows."""
    model = models.build("hf_falcon_mq", seed=0)
    ids = torch.randint(0, 64, (B, T))
    gm = apply_tensor_parallel(capture(model, (ids,), lm_cross_entropy, ids).gm, 2, 1, None)
    info = gm.meta[K.TP_INFO]
    assert not info.fallbacks, info.summary()
    split = info.params["model.transformer.h.0.self_attention.query_key_value.weight"]
    assert split == shard_rt.ParamSplit(0, (32, 8, 8), whole=(False, True, True))
    narrows = [n.args[1:] for n in gm.graph.nodes
               if n.target is torch.ops.aten.narrow.default]
    assert narrows == [(2, 0, 2), (2, 2, 1), (2, 3, 1)] * 2     # q: 2 of 4 heads; k; v
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor
                and n.args[0].target is torch.ops.aten.view.default]
    gm.graph.lint()


def test_fused_grouped_query_with_fewer_kv_heads_than_t_holds_kv_whole():
    """Phi-3's fused qkv_proj [q (4 heads) | k (2) | v (2)] at t = 4: the k/v pieces, viewed
    as (B, T, 2, d), cannot be split in 4, so they are held whole and q alone is split; at
    t = 2 everything splits by heads as before."""
    model = models.build("hf_phi3", seed=0)
    ids = torch.randint(0, 64, (B, T))
    gm = capture(model, (ids,), lm_cross_entropy, ids).gm
    key = "model.model.layers.0.self_attn.qkv_proj.weight"
    for t, whole in ((2, ()), (4, (False, True, True))):
        info = propagate_sharding(gm, t).meta[K.TP_INFO]
        assert not info.fallbacks, info.summary()
        assert info.params[key] == shard_rt.ParamSplit(0, (32, 16, 16), whole=whole)


def test_multi_query_in_separate_projections_keeps_only_k_v_replicated():
    """Llama with one kv head at t = 2: k_proj / v_proj (one head each) cannot be split by
    heads and fall back; attention's conflict blames them only, so q, o and the MLP stay
    split (it used to turn the whole attention off)."""
    model = models.build("hf_llama", seed=0, kv_heads=1)
    ids = torch.randint(0, 64, (B, T))
    info = propagate_sharding(capture(model, (ids,), lm_cross_entropy, ids).gm, 2,
                              strict=False).meta[K.TP_INFO]
    assert len(info.fallbacks) == 2 * 2, info.summary()          # k and v of each layer
    assert len(info.row) == 2 * 2 and len(info.column) == 3 * 2 + 1


def test_mixed_param_split_round_trips():
    """ParamSplit with whole blocks: each rank's rows of the split block and all of the whole
    ones; unshard takes the whole blocks once."""
    full = torch.arange(8 * 3.0).reshape(8, 3)
    split = shard_rt.ParamSplit(0, (4, 2, 2), whole=(False, True, True))
    pieces = [shard_rt.local_shard(full, split, r, 2) for r in range(2)]
    assert torch.equal(pieces[1], torch.cat([full[2:4], full[4:8]]))
    assert split.local_size(2) == 6 and split.whole_ranges(2) == [(2, 2), (4, 2)]
    assert torch.equal(shard_rt.unshard(pieces, split, 8), full)


def test_dense_down_projection_after_a_fallen_back_up_projection_keeps_the_stream_whole():
    """FFN 66 at t = 4: gate/up cannot be split and stay replicated, so the down projection
    reads a replicated input and is a column candidate; its split used to reach the residual
    stream through the RMSNorm's mean (partial_mean) and make the next layer's q/k/v
    row-parallel. A mean over the split dim now needs a column-parallel producer (as a norm
    does): the down projection falls back, the stream stays replicated."""
    model = models.build("llama_style", seed=0, ffn=66)
    ids = torch.randint(0, 64, (B, T))
    gm = propagate_sharding(capture(model, (ids,), lm_cross_entropy, ids).gm, 4, strict=False)
    info = gm.meta[K.TP_INFO]
    roles = [n.meta.get(K.TP_ROLE) for n in gm.graph.nodes]
    assert "partial_mean" not in roles
    assert len(info.row) == 2                            # the o_proj of each layer only
    downs = [f for f in info.fallbacks if "a mean over the split dim" in f.reason]
    assert downs and all(f.node not in info.column for f in downs)
    norms = [n for n in gm.graph.nodes if n.meta.get(K.TP_ROLE) is None
             and n.target is torch.ops.aten.mean.dim]
    assert norms and all(isinstance(n.meta[K.TP_LAYOUT], Replicate) for n in norms)


# ----- mixture of experts (issue 17) -----------------------------------------------------------

def _moe_gm(name: str = "hf_mixtral", **sizes):
    model = models.build(name, seed=0, **sizes)
    ids = torch.randint(0, 64, (B, T))
    return capture(model, (ids,), lm_cross_entropy, ids).gm


def test_routing_under_sequence_parallelism_gathers_instead_of_crashing():
    """Mixtral's routing indexes the tokens (sorted by expert): a sequence split cannot be kept
    there. It used to raise `propagation loops at index_4`; now the sequence is gathered before
    the routing and the note names the node, the user's source line and the reason."""
    gm = _moe_gm()
    info = propagate_sharding(gm, 2, sequence_parallel=True).meta[K.TP_INFO]
    gathers = [n for n in info.notes if n.startswith("gathered")]
    assert gathers and all("indexes the split dim" in n and "moe.py" in n for n in gathers)
    assert any("gathered" in line for line in tp_report(type("P", (), {"t": 2,
               "sequence_parallel": True})(), gm))


def test_experts_not_divisible_by_pinned_t_is_a_one_line_error():
    """Each expert's FFN (66) cannot be cut in 4: a pinned t=4 that needs the split is refused
    in one line naming the node, the reason and the user's (transformers') source line."""
    gm = _moe_gm(ffn=66)
    with pytest.raises(ValueError) as err:
        propagate_sharding(gm, 4)
    msg = str(err.value)
    assert "\n" not in msg and "t=4" in msg and "fix:" in msg
    assert "expert output blocks (66, 66)" in msg and "moe.py" in msg


def test_every_layers_experts_are_split_not_only_the_first():
    """The gate/up product of layer 1 reads the residual stream, which the previous layer's
    down product fed: it is still a column candidate (only the down product of its own
    experts, grouped by the same offs, is fed by a grouped matmul). It used to be taken for a
    down product, and layers >= 1 kept their experts whole under t = 2."""
    gm = apply_tensor_parallel(_moe_gm(layers=3), 2, 0, None)
    split = {k for k in param_splits(gm) if ".experts." in k}
    assert split == {f"model.model.layers.{i}.mlp.experts.{w}" for i in range(3)
                     for w in ("gate_up_proj", "down_proj")}, split


class _FlatResidualMLP(nn.Module):
    """OPT's shape of a block: the residual stream flattened to (B·T, C) around a biased MLP,
    the residual added on the flattened rows."""

    def __init__(self, vocab: int = 64, hidden: int = 32, ffn: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.norm_in, self.norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.norm_in(self.emb(ids))                       # (B, T, C)
        x = h.reshape(-1, h.shape[-1])                        # (B·T, C)
        x = x + self.fc2(torch.relu(self.fc1(self.norm(x))))  # (B·T, C)
        return self.head(x.view(h.shape))                     # (B, T, V)


def test_sequence_parallel_reduce_scatter_on_merged_rows_keeps_per_row_blocks():
    """Under SP a (B·T, C) value holds T/t tokens of each of the B rows (Shard(0, (T,)·B)), not
    the first or second B/2 rows. A row-parallel sum added to it on those rows is
    reduce-scattered in that order: its rows go rank-major first (shuffle_blocks), or the
    residual add would pair rank 0's tokens of row 1 with row 0's (OPT's ~0.3% loss gap)."""
    model = _FlatResidualMLP()
    ids = torch.randint(0, 64, (B, T))
    gm = capture(model, (ids,), lm_cross_entropy, ids).gm
    gm = apply_tensor_parallel(gm, 2, 0, None, sequence_parallel=True)
    merged = [n for n in _calls(gm, C.reduce_scatter_to_sp)
              if n.meta[K.TP_LAYOUT] == Shard(0, (T,) * B, seq=True)]
    assert len(merged) == 1                                   # fc2's sum, on the (B·T, C) rows
    shuffle = merged[0].args[0]
    assert shuffle.target is shard_rt.shuffle_blocks and shuffle.args[2:4] == (0, [T] * B)
    (add,) = [u for u in merged[0].users]   # + fc2's bias, then the residual add
    residual = next(u for u in add.users if u.target is torch.ops.aten.add.Tensor)
    assert {a.meta[K.TP_LAYOUT] for a in residual.args} == {Shard(0, (T,) * B, seq=True)}
    gm.graph.lint()
