"""Packed documents in the cost model (cost/documents.py): a fused kernel runs only the tiles
the block-diagonal causal mask leaves, so attention's price falls with the mean document length
and the materialized (written-out) attention's does not."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.cost import model as M
from autopar.cost.documents import document_tile_fraction, with_documents
from autopar.cost.hardware import get_cluster
from autopar.cost.profile import FLASH_TILE, causal_tile_fraction, transformer_profile
from autopar.documents import PackedDocuments

A100 = get_cluster("dgx-a100-80gb")


def test_tile_fraction_counts_the_tiles_the_block_mask_leaves():
    n = 8 * FLASH_TILE
    # documents as long as the row: the causal mask's tiles
    assert document_tile_fraction(n, n, n) == causal_tile_fraction(n, n)
    assert document_tile_fraction(n, n, 10 * n) == causal_tile_fraction(n, n)
    # one tile per document: each query block reads its own key block only
    assert document_tile_fraction(n, n, FLASH_TILE) == pytest.approx(1 / 8)
    # two tiles per document: even blocks read 1 key block, odd ones 2 → 12 of 64
    assert document_tile_fraction(n, n, 2 * FLASH_TILE) == pytest.approx(12 / 64)
    # documents that straddle tile boundaries cost their straddled blocks too
    assert document_tile_fraction(n, n, 200) > 200 / n / 2


@pytest.mark.parametrize("attention, cheaper", [("flash", True), ("materialized", False)])
def test_documents_lower_the_fused_attention_price_only(attention, cheaper):
    prof = transformer_profile(num_layers=4, hidden=1024, heads=16, seq_len=8192, vocab=32000)
    docs = with_documents(prof, PackedDocuments(mean_doc_len=512))
    cluster = dataclasses.replace(A100, attention=attention)
    cfg = M.Config(t=1, p=1, d=1)
    whole, packed = (M.predict(p, cluster, cfg).step_time_s for p in (prof, docs))
    call = docs.block.fused.calls[0]
    assert call.active_fraction == document_tile_fraction(8192, 8192, 512)
    assert call.fwd_flops < prof.block.fused.calls[0].fwd_flops / 8
    assert (packed < 0.9 * whole) if cheaper else packed == whole
    # no mean length: each row priced as one document, the causal mask's tiles
    assert with_documents(prof, PackedDocuments()).block.fused.calls[0].active_fraction == \
        causal_tile_fraction(8192, 8192)
    assert with_documents(prof, None) is prof


def test_the_materialized_mask_is_held_on_every_rank_for_the_step():
    """The runtime hands every rank its replica's whole (B, 1, T, T) boolean mask: T² bytes per
    sequence of the share (b·m) on each pipeline rank, context ranks included, in the memory the
    plan reports and in the activation bound the search prunes with; none without documents."""
    from autopar.cost.context import context_rank_profile
    from autopar.cost.memory import activation_bytes_lower_bound
    T = 8192
    prof = transformer_profile(num_layers=4, hidden=1024, heads=16, seq_len=T, vocab=32000)
    docs = with_documents(prof, PackedDocuments(mean_doc_len=512))
    assert prof.input_bytes_per_sequence == 0 and docs.input_bytes_per_sequence == T * T
    cfg = M.Config(t=1, p=2, d=1, micro_batch_size=2, num_microbatches=4)
    whole, packed = (M.config_costs(p, A100, cfg) for p in (prof, docs))
    for r in range(2):
        assert packed.mem_fixed_bytes[r] - whole.mem_fixed_bytes[r] == pytest.approx(
            2 * 4 * T * T, abs=1)
    assert (activation_bytes_lower_bound(docs, cfg) - activation_bytes_lower_bound(prof, cfg)
            == pytest.approx(8 * T * T))
    assert context_rank_profile(docs, 2, "all-gather").input_bytes_per_sequence == T * T


def test_bad_mean_length_is_one_line():
    with pytest.raises(ValueError, match=r"mean_doc_len=0: must be a number of tokens >= 1"):
        PackedDocuments(mean_doc_len=0)


def test_models_that_cannot_take_documents_are_refused_in_one_line():
    """Documents reach the model as transformers' keywords: a forward without them, or
    transformers' eager attention (which would add the boolean mask), is refused."""
    import torch

    from autopar.documents import program_inputs
    from models import gpt, hf_llama
    ids = torch.zeros(1, 16, dtype=torch.long)
    cases = ((gpt(), (ids,), ["GPT.forward takes no position_ids, attention_mask"]),
             (hf_llama(attn_implementation="eager"), (ids,), ["attn_implementation='sdpa'"]),
             (hf_llama(), (ids, ids), ["example_inputs must be (input_ids,)"]))
    for model, inputs, words in cases:
        with pytest.raises(ValueError) as err:
            program_inputs(model, inputs, PackedDocuments())
        assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), err.value
    inputs, keywords = program_inputs(hf_llama(), (ids,), PackedDocuments())
    assert keywords == ("position_ids", "attention_mask") and inputs[2].shape == (1, 1, 16, 16)


def test_parallelize_with_documents_prices_the_block_mask_and_takes_its_inputs():
    import torch

    import autopar
    from models import hf_llama
    ids = torch.zeros(1, 512, dtype=torch.long)
    prog = autopar.parallelize(hf_llama(seq=512), 1, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, cluster="dgx-a100-80gb",
                               documents=PackedDocuments(mean_doc_len=128))
    call = prog.profile.block.fused.calls[0]
    assert call.active_fraction == document_tile_fraction(512, 512, 128) == 0.25
    assert prog.input_keywords == ("position_ids", "attention_mask")
    assert [tuple(x.shape) for x in prog.example_inputs] == [(1, 512), (1, 512), (1, 1, 512, 512)]
