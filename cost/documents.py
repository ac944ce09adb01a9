"""Packed documents in the cost model: attention priced at the tiles the block mask leaves.

A fused attention kernel (FlashAttention-2/3; FlexAttention's block mask; cuDNN's THD / varlen
path) skips every FLASH_TILE × FLASH_TILE tile of the score matrix its mask leaves empty. With
packed documents (autopar/documents.py) the mask is block-diagonal causal: a query block sees
only the key blocks from the start of its first query's document to itself. So the kernel's
FLOPs fall from the row's causal half to about (tokens / mean document length) causal triangles
of one document each.

The model (not fitted; exact for documents of one length laid end to end from the row's start,
the tile grid aligned with the row): query block i, covering tokens [i·F, (i+1)·F), reads key
blocks ⌊start(i·F) / F⌋ … i, where start(x) = ⌊x / L⌋·L is the start of token x's document —
one more block per tile boundary its documents cross. Documents of mixed lengths with the same
mean leave a similar count (each document's triangle plus the straddled blocks); the mean is
what the user knows (`--mean-doc-len`) or the data file measures (tokens per EOD).

Memory: the mask is materialised (B, 1, T, T) booleans, the whole of it on every rank of a
replica (the pipeline's chunks read the step's inputs, and the context ranks keep the mask
whole), so the profile's `input_bytes_per_sequence` is T² and cost/memory.py holds it per
sequence of the replica's share for the step: 16 MiB per 4K-token row, 16 GiB per 128K row.

Only the fused kernel's FLOPs change (`AttentionCall.active_fraction`, which
`AttentionCall.fwd_flops` and cost/model.py's `fused_attention_time_s` read): attention written
out as GEMMs computes every score whatever the mask, and the papers' FLOP convention (MFU)
counts attention in full.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.cost.profile import FLASH_TILE, AttentionCall, ModelProfile, RegionProfile


def document_tile_fraction(q_len: int, kv_len: int, mean_doc_len: float,
                           tile: int = FLASH_TILE) -> float:
    """Fraction of the tile × tile blocks of a q_len × kv_len block-diagonal causal mask of
    documents of mean_doc_len tokens that hold an attended entry (module doc); the causal
    fraction for documents at least as long as the row."""
    L = max(1, round(mean_doc_len))
    rows, cols = -(-q_len // tile), -(-kv_len // tile)
    shift = kv_len - q_len                      # bottom-right alignment, as causal_tile_fraction
    active = 0
    for i in range(rows):
        first_query = i * tile + shift
        last_key = min(kv_len - 1, (i + 1) * tile - 1 + shift)
        if last_key < 0:
            continue
        first_key = max(0, first_query) // L * L
        active += min(cols, last_key // tile + 1) - first_key // tile
    return active / (rows * cols)


def _call(call: AttentionCall, mean_doc_len: float) -> AttentionCall:
    """A self-attention call (queries are the keys' tokens) masked to its documents; others
    (cross-attention) as they were."""
    if call.q_len != call.kv_len:
        return call
    frac = document_tile_fraction(call.q_len, call.kv_len, mean_doc_len)
    return replace(call, active_fraction=min(call.active_fraction, frac))


def _region(region: RegionProfile, mean_doc_len: float) -> RegionProfile:
    def calls(fused: Any) -> Any:
        return None if fused is None else replace(
            fused, calls=tuple(_call(c, mean_doc_len) for c in fused.calls))
    eager = region.eager if region.eager is None else replace(
        region.eager, fused=calls(region.eager.fused))
    return replace(region, fused=calls(region.fused), eager=eager)


def with_documents(profile: ModelProfile, documents: Any) -> ModelProfile:
    """`profile` with every self-attention call's active tiles those of the block-diagonal
    causal mask at `documents.mean_doc_len` (an autopar.PackedDocuments); an unknown mean
    length prices each row as one document (the causal mask's tiles: the mask is a graph input
    the profile cannot read); unchanged for documents=None."""
    if documents is None:
        return profile
    mean = documents.mean_doc_len or profile.seq_len
    regions = {k: _region(getattr(profile, k), mean) for k in ("embedding", "block", "head")}
    kinds = tuple(replace(k, profile=with_documents(k.profile, documents))
                  if getattr(k, "profile", None) is not None else k
                  for k in profile.layer_kinds)
    note = (f"packed documents of mean length {mean:g} tokens: fused attention priced at the "
            f"block-diagonal mask's tiles (cost/documents.py)")
    # the runtime hands every rank its replica's whole (B, 1, T, T) boolean mask (the data
    # loader builds it; context ranks keep it whole): T² bytes per sequence for the step
    mask = float(profile.seq_len * profile.context) ** 2
    return replace(profile, **regions, layer_kinds=kinds, notes=profile.notes + (note,),
                   input_bytes_per_sequence=mask)
