"""One rank's share of the model: the profile it sees, what the tensor-parallel pass keeps
whole on it, its parameters and the vocabulary padding.

- Tensor-parallel fallbacks (`ModelProfile.tp_fallbacks`, from the graph path's analysis of the
  tensor-parallel pass at each t, autopar/passes/tp_cost.py): the GEMMs the pass keeps replicated
  are priced whole (t = 1), their parameters, saved activations and elementwise bytes are not
  divided by t (not even under sequence parallelism), the all-reduces of row-parallel GEMMs it
  does not split are dropped, and the collectives it inserts (gathers of split values, gradient
  all-gathers / all-reduces of sliced replicated values) are added to the tensor-parallel
  communication, forward ones again under full recompute. Without an entry for t (textbook
  profiles) the structural split of Gemm.tp_split is priced as is.
- Vocabulary: Megatron pads it to a multiple of 128·t (`padded_vocab`); vocabulary-parallel
  work (the head's GEMM and bytes, the embedding table) grows by `vocab_pad_ratio`.
- Context parallelism: `rank_profile` restates the profile for one of c context ranks
  (cost/context.py), priced with the cluster's attention kernel and elementwise mode.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.config import Config
from autopar.cost.context import context_rank_profile
from autopar.cost.hardware import Cluster
from autopar.cost.profile import (NO_FALLBACK, AttentionCall, ModelProfile, RegionProfile,
                                  TPRegionFallback)


def rank_profile(profile: ModelProfile, cluster: Cluster, cfg: Config) -> ModelProfile:
    """The profile as one rank of cfg sees it: priced with the cluster's attention kernel and
    restated for one of cfg.c context ranks (cost/context.py; the profile itself for c = 1)."""
    return context_rank_profile(profile.for_cluster(cluster), cfg.c, cfg.cp_attention)


def tp_fallback(profile: ModelProfile, kind: str, t: int, sp: bool) -> TPRegionFallback:
    """What the tensor-parallel pass keeps whole in region `kind` at (t, sp) (see cost/profile.py
    TPRegionFallback); nothing when the profile has no analysis for t."""
    if not profile.tp_fallbacks or t <= 1:
        return NO_FALLBACK
    c = profile.tp_correction(t, sp)
    return c.region(kind) if c is not None else NO_FALLBACK


def rank_other_bytes(region: RegionProfile, t: int, b: int, sp: bool,
                     fix: TPRegionFallback = NO_FALLBACK) -> float:
    """Non-GEMM bytes per micro-batch on one tensor rank (replicated part split only by SP; the
    part the tensor-parallel pass keeps whole not at all)."""
    repl = region.other_bytes - region.other_split_bytes
    split = region.other_split_bytes - fix.other_split_bytes
    return b * (split / t + repl / (t if sp else 1) + fix.other_split_bytes)


def fused_calls(profile: ModelProfile, region: RegionProfile) -> tuple[AttentionCall, ...]:
    """The region's attention calls priced as fused kernels: those of a profile priced with
    flash attention (`ModelProfile.with_attention`); none otherwise."""
    if profile.attention != "flash" or region.fused is None:
        return ()
    return region.fused.calls


def op_checkpoint(profile: ModelProfile, region: RegionProfile
                  ) -> tuple[frozenset[int], frozenset[int]]:
    """Recompute mode 'op' (torchtitan's per-op selective checkpointing, passes/recompute.py
    `op_policy`) on a block: (the GEMMs whose outputs it keeps, those its backward runs again),
    as indices into region.gemms. Of the 2-D weight GEMMs in order it keeps the 1st, 3rd, ...
    and reruns the others, but neither keeps nor reruns the block's last GEMM (its output
    feeds the residual add, which saves nothing: the recomputation stops before it); experts'
    grouped GEMMs and an attention core written out are rerun; a fused attention kernel's
    output is kept (its context GEMM's output) and not rerun."""
    calls = fused_calls(profile, region)
    fused = frozenset(i for c in calls for i in c.gemms)
    gemms = region.gemms
    linear = [i for i, g in enumerate(gemms) if not (g.batch_scales or g.expert)]
    again = set(linear[1::2]) | {i for i, g in enumerate(gemms)
                                 if g.expert or (g.batch_scales and i not in fused)}
    kept = set(linear[0::2])
    if linear and linear[-1] == len(gemms) - 1:
        again.discard(linear[-1])
        kept.discard(linear[-1])
    kept |= {c.gemms[-1] for c in calls if c.gemms}
    return frozenset(kept), frozenset(again)


def rank_attention_bytes(blk: RegionProfile, t: int, fix: TPRegionFallback,
                         b: float = 1) -> float:
    """Attention activations (the s² tensors) of b sequences on one tensor rank."""
    return b * (blk.act_attention_bytes - fix.act_attention_bytes) / t + b * fix.act_attention_bytes


def padded_vocab(vocab: int, t: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128·t so each shard is GEMM-friendly."""
    q = 128 * t
    return -(-vocab // q) * q


def vocab_pad_ratio(vocab: int, t: int) -> float:
    """padded_vocab / vocab: the factor vocab-parallel work grows by; 1 for a model without a
    vocabulary (vocab 0: ViT, a classification or regression head), which pads nothing."""
    return padded_vocab(vocab, t) / vocab if vocab > 0 else 1.0


def shard_params_elems(profile: ModelProfile, t: int, sp: bool = False,
                       p: int = 2) -> tuple[float, float, float]:
    """Parameters on one tensor rank: (per block, embedding on rank 0, head on rank p-1); the
    split ones the tensor-parallel pass keeps whole at (t, sp) count whole. A tied word
    embedding's copy counts in the head only at p > 1 (at p = 1 the one rank holds the table
    once)."""
    vpad = vocab_pad_ratio(profile.vocab, t)
    blk, emb, head = profile.block, profile.embedding, profile.head
    bf, ef, hf = (tp_fallback(profile, k, t, sp).params_elems
                  for k in ("block", "embedding", "head"))
    block = (blk.params_split_elems - bf) / t + blk.params_replicated_elems + bf
    table = (emb.params_split_elems - ef) * vpad / t + ef
    embp = table + emb.params_replicated_elems
    headp = ((head.params_split_elems - hf) * vpad / t
             + head.params_replicated_elems + hf)
    if profile.tied_embeddings and p > 1:  # the last stage keeps a copy of the word embedding
        headp += table
    return block, embp, headp


def expert_params_elems(profile: ModelProfile, t: int, ep: int = 1) -> float:
    """Expert parameters of one block on one rank: the experts' weights split by t (expert
    tensor parallelism) and spread over ep ranks, E/ep experts each (part of
    `shard_params_elems`' block term, which counts them at ep = 1). Only the sets ep spreads
    (`RegionProfile.spread_experts`): ep · this is what leaves the dense block term."""
    return profile.block.spread_experts(ep)[0] / (t * ep)


def tied_table_elems(profile: ModelProfile, t: int, sp: bool) -> float:
    """Elements of the (tied) word embedding on one tensor rank, as the gradient sync sees it."""
    ef = tp_fallback(profile, "embedding", t, sp).params_elems
    return (profile.embedding.params_split_elems - ef) / t + ef


@dataclass(frozen=True, kw_only=True)
class RankParams:
    """Parameter elements on one rank of a configuration (`rank_params`): per block without
    the experts under expert parallelism, the rank's E/ep experts per block (0 at ep = 1:
    they are in `block`), the embedding on pipeline rank 0 and the head on rank p-1 (each
    with a shared block's weights: its first set, its last copy), a shared block's copy on
    each rank between them (`middle`)."""
    block: float
    embedding: float
    head: float
    experts: float = 0.0
    middle: float = 0.0   # held by every stage between the first and the last (a shared
    #                       block's copy, p > 2)


def rank_params(profile: ModelProfile, cfg: Config) -> RankParams:
    """The parameters one rank of cfg holds; `profile` is the rank's (`rank_profile`)."""
    t = cfg.t
    block_p, emb_p, head_p = shard_params_elems(profile, t, cfg.sequence_parallel and t > 1,
                                                cfg.p)
    # expert parallelism: the rank holds E/ep of the experts (block_e), the dense rest whole
    block_e = expert_params_elems(profile, t, cfg.ep) if cfg.ep > 1 else 0.0
    block_p -= cfg.ep * block_e
    shared = shared_block_elems(profile, t)   # the first stage's set, the last stage's copy
    return RankParams(block=block_p, embedding=emb_p + shared,
                      head=head_p + (shared if cfg.p > 1 else 0.0), experts=block_e,
                      middle=shared if cfg.p > 2 else 0.0)


def shared_block_elems(profile: ModelProfile, t: int) -> float:
    """Elements of the weights of a block called at several depths on one tensor rank (held
    by a stage once, however many of its layers call it)."""
    return profile.shared_split_elems / t + profile.shared_replicated_elems
