"""The exchanges context and expert parallelism add: the K/V exchange of context-parallel
attention (all-gather, ring or all-to-all: `context_comm_s`) and the experts' token
all-to-alls (`expert_comm_s`), per layer per micro-batch on one rank.

- Context parallelism (cost/context.py restates the profile for one of c context ranks; this
  module prices what crossing ranks costs): Llama 3's all-gather of K and V exposed, ring
  attention's hops exposed only past the attention step each overlaps (`ring_attention_s`),
  or DeepSpeed-Ulysses' all-to-alls of q, k, v and the output (`alltoall_attention_s`), or the
  hybrid: those all-to-alls inside a node, the K/V all-gather across (`hybrid_attention_s`),
  or ring attention across ("hybrid-ring": the ring's formula over the c/k outer ranks).
- Expert parallelism (ep > 1, a mixture of experts): each of ep ranks of a gradient group
  holds E/ep of every layer's experts (their weights, gradients and Adam states / ep; ZeRO
  shards them over the c·d/ep ranks holding the same experts), and the expert gradients are
  reduced over those c·d/ep ranks (`expert_data_groups`, stride t·ep), the rest over c·d.
  Tokens reach their experts' rank by an all-to-all and come back by another, per MoE layer:
  2 in forward, 2 in backward (the reverse exchanges of the gradients), 2 more forward under
  full or op recompute, each of micro-batch · tokens · top-k · hidden elements per rank,
  (ep−1)/ep of them leaving the rank (`alltoall_s`), exposed (Megatron-Core's dispatcher
  runs them on the compute stream), on the link the expert group spans (stride t, ep ranks).
  Routing is priced balanced: every rank computes tokens · k expert rows, as without ep.
"""
from __future__ import annotations

from autopar.cost.comm import (allgather_s, alltoall_s, group_spans_nodes, link, p2p_s,
                               reducescatter_s)
from autopar.cost.compute import attention_core_s, elementwise_time_s
from autopar.cost.config import BLOCK_CHECKPOINTED, Config
from autopar.cost.hardware import Cluster
from autopar.cost.imbalance import alltoall_factor
from autopar.cost.profile import ModelProfile
from autopar.runtime.groups import hybrid_inner_degree

# the ops autopar's ring (autopar/runtime/ring_attention.py) dispatches a step, forward and
# backward each, besides its transfers: the exchange's buffers, the tile's views, the fused
# kernel, the online-softmax merge and the writes back (forward), the dq / dK / dV
# accumulations (backward). Counted with a dispatch mode on gloo ranks (2026-11-28), forward /
# backward at c = 2, 3, 4: causal 55-57 / 57-60, 80-84 / 82-88, 105-111 / 109-118 (27-29 a
# step, what a decoder runs), not causal 55 / 55, 80 / 78, 105 / 103 (25 a step);
# tests/numerics/test_context_attention_ranks.py counts them again. On 2 CPU ranks a c = 2
# call of a 4-layer GPT's shape took 5.4 ms of CPU against ~1.3 ms of its kernels: ring plans
# were priced 23-27% fast untuned before these were
RING_OPS_PER_STEP = 27
HYBRIDS = ("hybrid", "hybrid-ring")   # the all-to-all inside a node, all-gather / ring across


def context_comm_s(profile: ModelProfile, cluster: Cluster, cfg: Config) -> tuple[float, float]:
    """(forward, forward + backward + recompute) seconds per layer per micro-batch of the
    context-parallel K/V exchange, on a profile restated for cfg.c (`rank_profile`), × the
    cluster's `cp_comm_scale` (fitted by autopar tune; 1: as measured) — every method's.

    cfg.cp_attention "all-gather": Llama 3's all-gather of K and V along the sequence before
    attention, exposed on the critical path (2407.21783 §3.3.2), and in backward the
    reduce-scatter of their gradients (the same bytes), again in forward under full or op recompute;
    K and V in a call each (the runtime's), each way;
    ring all-gather over the c context ranks on their link (context groups: stride t, inside a
    node when t·c <= GPUs per node). "ring": `ring_attention_s`, the blocks' transfers exposed
    only where they outlast the attention step they overlap, plus the ring's own overheads.
    Each tensor rank moves its kv heads: 1/t of them, or one when t exceeds kv_heads (the
    tensor-parallel pass replicates kv heads then)."""
    fwd, total = _context_comm_s(profile, cluster, cfg)
    return cluster.cp_comm_scale * fwd, cluster.cp_comm_scale * total


def _context_comm_s(profile: ModelProfile, cluster: Cluster, cfg: Config) -> tuple[float, float]:
    """`context_comm_s` as its curves and links price it (the cluster's cp_comm_scale aside)."""
    c, t = cfg.c, cfg.t
    elems = profile.block.cp_gather_elems
    if c <= 1 or not elems:
        return 0.0, 0.0
    local = elems / min(t, max(1, profile.kv_heads))
    cp_inter = group_spans_nodes(cluster, stride=t, size=c, gpus=cfg.gpus)
    kv_bytes = cfg.micro_batch_size * local * profile.activation_bytes_per_elem
    if cfg.cp_attention == "ring":
        fwd, bwd = ring_attention_s(profile, cluster, cfg, kv_bytes, cp_inter)
        return fwd, fwd + bwd + (fwd if cfg.recompute in BLOCK_CHECKPOINTED else 0.0)
    if cfg.cp_attention == "all-to-all":
        fwd, bwd = alltoall_attention_s(profile, cluster, cfg, cp_inter)
        return fwd, fwd + bwd + (fwd if cfg.recompute in BLOCK_CHECKPOINTED else 0.0)
    if cfg.cp_attention in HYBRIDS and hybrid_degree(profile, cluster, cfg) > 1:
        fwd, bwd = hybrid_attention_s(profile, cluster, cfg)
        return fwd, fwd + bwd + (fwd if cfg.recompute in BLOCK_CHECKPOINTED else 0.0)
    if cfg.cp_attention == "hybrid-ring":   # no inner degree: the ring over the c ranks
        fwd, bwd = ring_attention_s(profile, cluster, cfg, kv_bytes, cp_inter)
        return fwd, fwd + bwd + (fwd if cfg.recompute in BLOCK_CHECKPOINTED else 0.0)
    # the runtime (passes/context_parallel.py) gathers K and V in a call each and
    # reduce-scatters each gradient: two calls each way, each paying its latency (on gloo a
    # reduce-scatter is not an all-gather's cost: the measured curves price them apart)
    one = 2 * allgather_s(cluster, kv_bytes / 2, c, cp_inter)
    back = 2 * reducescatter_s(cluster, kv_bytes / 2, c, cp_inter)
    return one, one + back + (one if cfg.recompute in BLOCK_CHECKPOINTED else 0.0)


def ring_exposed_s(hop_s: float, step_s: float, steps: int, overlap: float = 1.0) -> float:
    """Exposed seconds of `steps` ring transfers of hop_s each, every one started before and
    overlapped with an attention step of step_s: what outlasts the step shows, and of what
    hides behind it the part 1 − `overlap` still costs its time (Cluster.comm_overlap: ~1 on
    a GPU, whose copies run beside its kernels; ~0 on CPU ranks that fill every core, measured
    by `autopar calibrate`: there the ring's hops were priced 31% fast with full credit)."""
    hidden = min(hop_s, step_s)
    return steps * (hop_s - overlap * hidden)


def ring_attention_s(profile: ModelProfile, cluster: Cluster, cfg: Config, kv_bytes: float,
                     inter: bool, steps: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds per layer per micro-batch that ring attention adds to the
    rank's attention (autopar/runtime/ring_attention.py), on the rank's profile; kv_bytes: the
    whole sequence's K and V on one tensor rank, so one context rank's block is kv_bytes / c.

    Transfers: forward, c − 1 hops of a block (the first step computes on the rank's own block
    while the next one travels); backward, c − 1 steps each sending a block and a dK/dV
    accumulator of the same size (2 blocks a hop), then the last accumulator's hop home, which
    nothing overlaps. A ring hop crosses nodes when the context group does (its slowest link).
    Each hop overlaps one step's attention: the rank's attention (forward / backward,
    `attention_core_s`) / c, the balanced causal split's equal steps.
    Overheads (not communication, charged here because only the ring has them): each step is a
    kernel over kv_len / c keys (the fused kernel's efficiency falls for short keys:
    Cluster.flash_half_len), c launches where the all-gather's attention has one, and c − 1
    online-softmax merges (read the running output and the step's, write the merged one, fp32,
    and their log-sum-exps) in forward, c − 1 dK/dV accumulations (fp32) in backward; where
    ops are dispatched one by one (elementwise "eager") the ring's own ops, RING_OPS_PER_STEP
    a step each way at kernel_launch_s (its backward runs inside one autograd node).
    steps: the ring's ranks when not c (the hybrid-ring's c/k outer ranks, each holding its
    inner group's tokens of heads/k heads: the same bytes and attention as the rank's own)."""
    c = cfg.c if steps is None else steps
    fwd_s, bwd_s = attention_core_s(profile, cluster, cfg)
    block = kv_bytes / c
    fwd = ring_exposed_s(p2p_s(cluster, block, inter), fwd_s / c, c - 1, cluster.comm_overlap)
    bwd = (ring_exposed_s(p2p_s(cluster, 2 * block, inter), bwd_s / c, c - 1,
                          cluster.comm_overlap)
           + p2p_s(cluster, block, inter))
    step_f, step_b = attention_core_s(profile, cluster, cfg, keys_over=c)
    # fp32 (4 B), read twice and written once: the merged outputs with their lse, the dK/dV
    merges = 3 * 4 * cfg.micro_batch_size * _ring_output_elems(profile, cfg.t)
    accum = 3 * 4 * kv_bytes / profile.activation_bytes_per_elem / c
    fwd += c * step_f - fwd_s + (c - 1) * elementwise_time_s(cluster, merges)
    bwd += c * step_b - bwd_s + (c - 1) * elementwise_time_s(cluster, accum)
    if cluster.elementwise == "eager":     # the ring's own ops, dispatched one by one
        fwd += c * RING_OPS_PER_STEP * cluster.kernel_launch_s
        bwd += c * RING_OPS_PER_STEP * cluster.kernel_launch_s
    return fwd, bwd


def alltoall_heads_rule(heads: int, kv_heads: int, t: int, c: int) -> str | None:
    """Why all-to-all context attention cannot split `heads` query heads over c context ranks
    under t tensor ranks, or None: each tensor rank's heads (heads / t) go heads/(t·c) to each
    context rank, so t·c must divide heads. kv heads need not: with fewer per tensor rank than
    c (or not a multiple) they are repeated up to the query heads before the exchange."""
    if heads % (t * c):
        return (f"all-to-all attention gives each of the c={c} context ranks heads/c of each "
                f"tensor rank's {heads}/{t} heads; t·c = {t * c} does not divide the {heads} "
                f"query heads")
    return None


def alltoall_exchange_elems(profile: ModelProfile, t: int,
                            n: int | None = None) -> tuple[float, float, float]:
    """(q, k + v, output) elements one context rank holds of its tokens per sequence on one
    tensor rank: what the all-to-alls around its attention exchange (heads over t; kv heads
    over t, or one when t exceeds them, as the tensor-parallel pass replicates them; repeated
    up to the query heads when they do not divide by the exchange's n ranks, c by default:
    autopar/runtime/ulysses.py)."""
    c = profile.context if n is None else n
    q = kv = out = 0.0
    for x in (profile.block.fused.calls if profile.block.fused is not None else ()):
        heads = x.heads / min(t, max(1, x.heads))
        kv_heads = max(1, x.kv_heads // t)
        if kv_heads % c:
            kv_heads = heads
        q += heads * x.q_len * x.head_dim
        kv += kv_heads * x.q_len * (x.head_dim + x.v_head_dim)
        out += heads * x.q_len * x.v_head_dim
    return q, kv, out


def alltoall_attention_s(profile: ModelProfile, cluster: Cluster, cfg: Config,
                         inter: bool) -> tuple[float, float]:
    """(forward, backward) seconds per layer per micro-batch of all-to-all context attention
    (DeepSpeed-Ulysses, 2309.14509 §3; autopar/runtime/ulysses.py) on the rank's profile.

    Forward: q, k and v traded tokens-for-heads (three all-to-alls over the c context ranks)
    and the output traded back (one); backward the four conjugates (dq, dk, dv, d-output), the
    same bytes. Each all-to-all is exposed (nothing overlaps it: attention needs its result)
    and each rank keeps 1/c of what it holds (`alltoall_s`), so its volume does not grow with c.
    Plus the reorder to global token order and back (the runtime's index_select: one read and
    one write of q, k, v after the exchange and of the output before it, forward; of their
    gradients, backward), charged at elementwise bandwidth. The attention kernel itself is the
    rank profile's: heads/c heads over the whole sequence run the same causal tiles as the
    local queries against every key."""
    q, kv, out = alltoall_exchange_elems(profile, cfg.t)
    e, b, c = profile.activation_bytes_per_elem, cfg.micro_batch_size, cfg.c
    moved = sum(alltoall_s(cluster, b * x * e, c, inter) for x in (q, kv, out))
    if kv:       # k and v are two all-to-alls: the second one's latency
        moved += link(cluster, inter)[1]
    reorder = elementwise_time_s(cluster, 2 * b * (q + kv + out) * e)
    one = moved + reorder
    return one, one


def hybrid_degree(profile: ModelProfile, cluster: Cluster, cfg: Config) -> int:
    """The hybrid's inner (all-to-all) degree at cfg: the runtime's rule
    (groups.hybrid_inner_degree) on the heads one tensor rank holds and the context ranks one
    of the cluster's nodes holds (its GPUs over t); 1: none, the hybrid is the all-gather."""
    heads = profile.heads // cfg.t if profile.heads % cfg.t == 0 else 1
    return hybrid_inner_degree(cfg.c, heads, max(1, cluster.gpus_per_node // cfg.t))


def hybrid_attention_s(profile: ModelProfile, cluster: Cluster,
                       cfg: Config) -> tuple[float, float]:
    """(forward, backward) seconds per layer per micro-batch of the hybrid context method
    (Megatron-Core's a2a+p2p with the all-gather across; autopar/runtime/ulysses.py
    `context_hybrid_attention`) on the rank's profile, k = `hybrid_degree`, m = c / k.

    Inside: `alltoall_attention_s`'s four exposed all-to-alls (q, k, v, the output; their
    conjugates backward) over the k inner ranks (stride t: inside a node by construction),
    the rank's q, k, v holding their size (its inner group's tokens of heads/k heads).
    Across: the all-gather of that K/V over the m outer ranks (stride t·k: the inter-node link
    when they leave a node), exposed as Llama 3's is, the reduce-scatter of its gradient
    backward (the same bytes); and its reorder to global order (one read and one write of the
    gathered K/V, forward; its gradient's, backward) at elementwise bandwidth.
    "hybrid-ring" (a2a+p2p as TransformerEngine runs it): across, `ring_attention_s` with m
    steps on the outer link instead, each hop one outer rank's K/V (its inner group's tokens of
    heads/k heads, the rank's own K/V size), hidden under a step's attention where it can be;
    the inner reorder (to the ring's order and back) is the all-to-all's, already charged."""
    t, c = cfg.t, cfg.c
    k = hybrid_degree(profile, cluster, cfg)
    m = c // k
    q, kv, out = alltoall_exchange_elems(profile, t, k)
    e, b = profile.activation_bytes_per_elem, cfg.micro_batch_size
    inner = group_spans_nodes(cluster, stride=t, size=k, gpus=cfg.gpus)
    outer = group_spans_nodes(cluster, stride=t * k, size=m, gpus=cfg.gpus)
    moved = sum(alltoall_s(cluster, b * x * e, k, inner) for x in (q, kv, out))
    if kv:       # k and v are two all-to-alls: the second one's latency
        moved += link(cluster, inner)[1]
    reorder = elementwise_time_s(cluster, 2 * b * (q + kv + out) * e)
    gathered = b * kv * m * e                    # heads/k heads of the whole sequence
    if cfg.cp_attention == "hybrid-ring":
        fwd, bwd = ring_attention_s(profile, cluster, cfg, gathered, outer, steps=m)
        return moved + reorder + fwd, moved + reorder + bwd
    across = allgather_s(cluster, gathered, m, outer) + elementwise_time_s(cluster, 2 * gathered)
    one = moved + reorder + across
    return one, one


# Where both hybrids are weighed, hybrid-ring is weighed only where its exchange costs no more
# in total than the hybrid's; elsewhere the methods are weighed as without it (the ring over
# all c ranks the memory-lean one: hybrid-ring saves none of the other ranks' K/V, the hybrid
# their heads/k share). Not strict dominance: where the hybrid is faster but does not fit and
# hybrid-ring would, the ring is weighed instead. Measured (2026-11-26, hybrid-tp, hybrid-ring
# added to the free set in a trial): weighed beside the hybrid as a second memory-lean method
# it grew the 1T's search (3,072 A100) 2,660 -> 2,860 families built and 189,316 -> 202,096
# configurations, its cheaper bounds building families that never win; with this rule the
# counts are the base's (the 1T 2,660 / 189,316, Llama 3 405B at 8K on 16,384 H100 390 -> 372
# / 20,780 -> 19,912) and the free choice takes it where it wins: Llama 3 405B at 131,072
# tokens on 16,384 H100 t=4 c=32 12.11 s/step (the hybrid 12.12), a multi-head 8B at 131,072
# on 128 H100 t=1 c=16 4.25 s/step (the hybrid 4.34): benchmarks/context_parallel.py --choices.
HYBRID_RING_SLOWER = (
    "slower exchange: hybrid-ring context attention costs more in total than hybrid at the same "
    "knobs (cost.model.context_comm_s); it is weighed only where it costs no more, the ring "
    "being the memory-lean method")


def hybrid_ring_weighed(cost: dict[str, tuple[float, float]]) -> bool:
    """Whether hybrid-ring is weighed among the context methods `cost` prices at the same
    knobs ({method: (forward, forward + backward + recompute) exchange seconds},
    `context_comm_s`): True unless both hybrids are there and hybrid-ring's total exceeds the
    hybrid's (`HYBRID_RING_SLOWER`; drop it before the dominance test, cost/families.py
    `_Exchanges._undominated`).

    Example: {"hybrid": (1.0, 3.0), "hybrid-ring": (1.1, 2.9)} -> True (kept beside the
    hybrid: a slower forward); {"hybrid": (1.0, 3.0), "hybrid-ring": (0.8, 3.2)} -> False;
    {"ring": (1.0, 3.0), "hybrid-ring": (2.0, 6.0)} -> True (no hybrid to stand in).
    """
    if "hybrid" not in cost or "hybrid-ring" not in cost:
        return True
    return cost["hybrid-ring"][1] <= cost["hybrid"][1]


def context_saved_kv_bytes(profile: ModelProfile, cluster: Cluster, cfg: Config) -> float:
    """Bytes per layer per micro-batch of the other context ranks' K/V that cfg's context
    attention saves for the backward on one rank (on the rank's profile; none under full
    or op recompute, which checkpoint the block whole): the all-gather the (c−1)/c of the whole
    sequence's K/V it gathered (split by t: cost/context.py charges it in the profile), ring,
    all-to-all and hybrid-ring none (the ring's blocks are the rank's own K/V size), the
    hybrid the m − 1 outer ranks' share of the K/V its inner group holds (heads/k heads of
    the whole sequence: `alltoall_exchange_elems` at its k, times m − 1), 1/k of the
    all-gather's where kv heads are not repeated (cost/context.py charges its least, 1/c of
    the whole sequence's at m = 2, and cost/memory.py the rest
    (`hybrid_saved_excess_bytes`): its k needs the cluster, which the profile does not know)."""
    if (cfg.c <= 1 or cfg.recompute in BLOCK_CHECKPOINTED
            or cfg.cp_attention in ("ring", "all-to-all", "hybrid-ring")):
        return 0.0
    e, b = profile.activation_bytes_per_elem, cfg.micro_batch_size
    k = hybrid_degree(profile, cluster, cfg) if cfg.cp_attention == "hybrid" else 1
    if k == 1:       # the all-gather (a hybrid with no inner degree is one)
        kv = profile.block.cp_gather_elems
        return b * e * (kv - -(-kv // cfg.c)) / cfg.t
    return b * e * alltoall_exchange_elems(profile, cfg.t, k)[1] * (cfg.c // k - 1)


def hybrid_saved_excess_bytes(profile: ModelProfile, cluster: Cluster, cfg: Config) -> float:
    """What the hybrid saves per layer per micro-batch (`context_saved_kv_bytes`) beyond the
    least the restated profile charges it (1/c of the whole sequence's K/V, split by t)."""
    if cfg.c <= 1 or cfg.recompute in BLOCK_CHECKPOINTED:
        return 0.0
    kv = profile.block.cp_gather_elems
    least = cfg.micro_batch_size * profile.activation_bytes_per_elem * -(-kv // cfg.c) / cfg.t
    return context_saved_kv_bytes(profile, cluster, cfg) - least


def _ring_output_elems(profile: ModelProfile, t: int) -> float:
    """Elements of a block's attention outputs and their log-sum-exps per sequence on one
    tensor rank (heads split over t): what each online-softmax merge reads and writes."""
    heads_t = min(t, max(1, profile.heads))
    blk = profile.block
    if blk.fused is not None and blk.fused.calls:
        return sum(x.heads * x.q_len * (x.v_head_dim + 1) for x in blk.fused.calls) / heads_t
    whole = profile.seq_len * profile.context
    return sum(g.batch * g.m * (g.n + 1) for g in blk.gemms
               if g.batch_scales and g.k == whole) / heads_t


def expert_comm_s(profile: ModelProfile, cluster: Cluster, cfg: Config) -> tuple[float, float]:
    """(forward, forward + backward + recompute) seconds per layer per micro-batch of the
    experts' token exchange under expert parallelism, on a profile restated for cfg.c.

    Per MoE layer the dispatch all-to-all sends each token's hidden vector to the ranks of its
    k experts and the combine brings the results back: 2 in forward, their reverses in
    backward, 2 more under full or op recompute (Megatron-Core's alltoall token dispatcher,
    exposed).
    Each rank exchanges micro-batch · its tokens · k · hidden elements
    (`RegionProfile.expert_dispatch_elems`; every tensor rank of a replicated token stream
    sends them for its expert shards), (ep−1)/ep of them leaving it, over the expert group:
    ep ranks at stride t (groups.expert_groups), inside a node when t·ep <= GPUs per node."""
    elems = profile.block.spread_experts(cfg.ep)[1]   # sets left whole move no tokens
    if cfg.ep <= 1 or not elems:
        return 0.0, 0.0
    inter = group_spans_nodes(cluster, stride=cfg.t, size=cfg.ep, gpus=cfg.gpus)
    one = alltoall_s(cluster, cfg.micro_batch_size * elems * profile.activation_bytes_per_elem,
                     cfg.ep, inter) * alltoall_factor(profile, cfg.ep)   # the busiest rank
    return 2 * one, (6 if cfg.recompute in BLOCK_CHECKPOINTED else 4) * one
