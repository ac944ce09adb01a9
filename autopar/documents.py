"""Packed documents: rows of concatenated documents, attention kept inside each document.

Pretraining packs documents end to end into fixed-length rows, each document ended by an
end-of-document token (EOD). Trained as one causal sequence per row, attention crosses the
documents and positions run on across them — another model than the one each document alone
gives. With packed documents on, the program's model receives what `transformers` models take
for this (their forward's keywords):

    position_ids    (B, T) int64: each token's offset in its document (restarting at 0)
    attention_mask  (B, 1, T, T) bool, True = attend: key k is seen by query q when both lie
                    in one document and k <= q (the block-diagonal causal mask; transformers
                    takes a 4-D mask as it is, masking_utils._preprocess_mask_arguments)

Document boundaries (Megatron-LM's `get_ltor_masks_and_position_ids` with reset_position_ids
and reset_attention_mask): an EOD token is the last token of its document; the next token
starts a new one at position 0. A row cut from the middle of a document starts it at 0 too.
A data function may give the boundaries itself: its global batch (inputs, targets, doc_ids)
with doc_ids (B, T) the index of each token's document, non-decreasing along a row.

Under context parallelism (c > 1) each context rank holds chunks r and 2c−1−r of a row
(runtime/context_shard.py). With documents, that cut would give a rank whole short documents and
another the costly ends of long ones, so the row is first reordered (`balance_order`) by the
rule of TransformerEngine's THD load balancing (`thd_partition_indices_kernel`, what
Megatron-Core runs for packed sequences under CP) and of PyTorch's context parallelism for
document masks (`torch.distributed.tensor.experimental._attention.
_PerDocumentHeadTailLoadBalancer`, torchtitan's FlexAttention path, which rearranges the input
the same way): every document is cut into 2c pieces and rank r holds pieces r and 2c−1−r of
each. Piece j of a document of L tokens is its offsets o with ⌊2c·o / L⌋ = j; the row is sorted
by (piece, document, offset), so the standard cut hands rank r pieces r and 2c−1−r of every
document. Both references require every length divisible by 2c (TE pads each document); a
fixed-length row cannot grow, so here up to one token per document crosses into the
neighbouring chunk. The model is indifferent to the order: its positions and mask come with
the tokens (both computed from the reordered doc ids and positions), and the token-mean loss
is a sum over tokens, so the reordered row trains exactly the model the row does.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

# the keywords the program passes the document inputs by (transformers' names), in the order
# they follow input_ids among the program's inputs
KEYWORDS = ("position_ids", "attention_mask")


@dataclass(frozen=True, kw_only=True)
class PackedDocuments:
    """Packed documents for `parallelize(documents=)`. mean_doc_len: the documents' mean
    length in tokens, for pricing (cost/documents.py: a fused kernel skips the tiles the block
    mask leaves empty); None prices every row as one document (the plain causal cost)."""
    mean_doc_len: float | None = None

    def __post_init__(self) -> None:
        m = self.mean_doc_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or m < 1):
            raise ValueError(f"PackedDocuments.mean_doc_len={m!r}: must be a number of tokens "
                             f">= 1 (the documents' mean length), or None to price each row "
                             f"as one document")


def doc_ids_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(B, T) index of each token's document: an EOD token ends its document (module doc)."""
    ends = (tokens == eod).to(torch.int64)
    return torch.cumsum(ends, dim=-1) - ends          # the EOD itself stays in its document


def positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) offset of each token in its document, from non-decreasing doc ids."""
    T = doc_ids.shape[-1]
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    start = torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - start


def block_causal_mask(doc_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query q sees key k when they share a document and k's position is not
    after q's — the block-diagonal causal mask (in any order of the row's tokens)."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & (pos[:, None, :] <= pos[:, :, None]))[:, None]


def check_doc_ids(doc_ids: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """A data function's doc ids: (B, T) integers, non-decreasing along each row."""
    if (not isinstance(doc_ids, torch.Tensor) or tuple(doc_ids.shape) != tuple(shape)
            or doc_ids.is_floating_point() or doc_ids.dtype == torch.bool):
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(f"{name}: doc_ids {got} must be an integer tensor shaped {tuple(shape)} "
                         f"(the document index of every token of the inputs)")
    if doc_ids.shape[-1] > 1 and bool((doc_ids[..., 1:] < doc_ids[..., :-1]).any()):
        raise ValueError(f"{name}: doc_ids decrease along a row; give each token the index of "
                         f"its document, counting up along the row (0, 0, 1, 1, 1, 2, ...)")


def balance_order(doc_ids: torch.Tensor, c: int) -> torch.Tensor:
    """(B, T) permutation of each row that balances its documents over c context ranks (module
    doc): the row sorted by (piece of 2c of the token's document, document, offset)."""
    if c == 1:
        return torch.arange(doc_ids.shape[-1]).expand_as(doc_ids).clone()
    pos = positions(doc_ids)
    # each token's document length: the position of its document's last token, plus one
    T = doc_ids.shape[-1]
    last = torch.zeros_like(pos).scatter_reduce(-1, doc_ids - doc_ids[..., :1], pos, "amax")
    length = torch.gather(last, -1, doc_ids - doc_ids[..., :1]) + 1
    piece = pos * (2 * c) // length
    key = (piece * T + (doc_ids - doc_ids[..., :1])) * T + pos
    return torch.argsort(key, dim=-1, stable=True)


def document_inputs(tokens: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor,
                    c: int = 1) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((input_ids, position_ids, attention_mask), targets) of a batch of packed rows, its
    tokens reordered by balance_order under c > 1 (identity at c = 1)."""
    pos = positions(doc_ids)
    if c > 1:
        order = balance_order(doc_ids, c)
        tokens, targets, doc_ids, pos = (torch.gather(x, -1, order)
                                         for x in (tokens, targets, doc_ids, pos))
    return (tokens, pos, block_causal_mask(doc_ids, pos)), targets


def document_example(input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The program's example inputs for packed documents: input_ids, then one document per
    row's position ids and an all-True mask of the right shape — shapes are what capture
    needs, and an expanded (B, 1, T, T) view costs no T² bytes when planning 128K tokens."""
    B, T = input_ids.shape[:2]
    pos = torch.arange(T, device=input_ids.device).expand(B, T).clone()
    mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=input_ids.device).expand(B, 1, T, T)
    return input_ids, pos, mask


def check_model(model: torch.nn.Module, where: str) -> None:
    """The model takes position_ids and attention_mask keywords (a transformers decoder) and,
    when it says how it runs attention, one that reads a boolean 4-D mask."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    missing = [k for k in KEYWORDS if k not in params]
    if missing:
        raise ValueError(f"{where}: packed documents pass the model {', '.join(KEYWORDS)} as "
                         f"keywords, and {type(model).__name__}.forward takes no "
                         f"{', '.join(missing)}; use a model that does (a transformers "
                         f"decoder), or train without --eod / documents=")
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl == "eager":
        raise ValueError(f"{where}: packed documents give the model a boolean (B, 1, T, T) "
                         f"mask, which transformers' 'sdpa' attention reads and its 'eager' "
                         f"attention would add as numbers; build {type(model).__name__} with "
                         f"attn_implementation='sdpa'")


def program_inputs(model: torch.nn.Module, example_inputs: tuple,
                   documents: Any) -> tuple[tuple, tuple[str, ...]]:
    """parallelize's (example inputs, keywords): unchanged and () without documents; with
    them (input_ids,) becomes document_example(input_ids), the last two passed by KEYWORDS."""
    if documents is None:
        return example_inputs, ()
    if not isinstance(documents, PackedDocuments):
        raise ValueError(f"parallelize: documents={documents!r} must be an "
                         f"autopar.PackedDocuments(mean_doc_len=...) or None")
    check_model(model, "parallelize(documents=)")
    first = example_inputs[0]
    if (len(example_inputs) != 1 or not isinstance(first, torch.Tensor) or first.dim() != 2
            or first.is_floating_point()):
        raise ValueError(f"parallelize(documents=): example_inputs must be (input_ids,) of "
                         f"shape (batch, seq); the document inputs ({', '.join(KEYWORDS)}) "
                         f"are made from it, got {len(example_inputs)} inputs")
    return document_example(first), KEYWORDS


# tokens read from the start of a token file to measure its mean document length
MEASURE_TOKENS = 1 << 24
