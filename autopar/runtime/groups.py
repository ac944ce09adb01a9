"""Rank-group math: pure integer functions of the parallel degrees (t, p, d), c and ep.

The layout is Megatron-LM's (2104.04473 §3; Megatron-Core `parallel_state`): tensor-parallel
ranks innermost, so a tensor group is a run of adjacent ranks and shares a node; then context
parallel (c, the sequence split; Megatron-Core's "tp-cp-ep-dp-pp" order: both tensor and
context groups want the fastest links, as in Llama 3's TP8·CP16); data-parallel next;
pipeline outermost::

    global_rank = pp * (t * c * d) + dp * (t * c) + cp * t + tp

Every function takes c keyword-only with default 1, where the layout is the (t, p, d) one.
Worked example, 16 ranks with t=2, c=2, p=2, d=2::

    tensor   groups [0,1] [2,3] [4,5] [6,7] ... [14,15]
    context  groups [0,2] [1,3] [4,6] [5,7] [8,10] ... [13,15]
    data     groups [0,4] [1,5] [2,6] [3,7] [8,12] ... [11,15]
    gradient groups [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]   (c·d ranks: the
             context ranks hold the same weights, so weight gradients are reduced over c·d)
    pipeline groups [0,8] [1,9] ... [7,15]
    with ep=2 (experts over the c·d ranks of each gradient group, consecutive in it):
    expert      groups [0,2] [4,6] [1,3] [5,7] [8,10] ...   (tokens all-to-all here)
    expert-data groups [0,4] [2,6] [1,5] [3,7] [8,12] ...   (expert gradients reduced here)

Megatron's documented example, 16 GPUs with t=2, p=4 (so d=2)::

    tensor   groups [0,1] [2,3] [4,5] ... [14,15]
    data     groups [0,2] [1,3] [4,6] [5,7] ... [13,15]
    pipeline groups [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]

Nothing here touches torch.distributed; `autopar.runtime.dist.ProcessGroups` turns these lists
into process groups. Every function returns groups in a fixed order (the same on every rank),
which is the order `dist.new_group` must be called in.
"""
from __future__ import annotations

import math

Groups = list[list[int]]


def validate_degrees(t: int, p: int, d: int, *, c: int = 1) -> None:
    """Raise ValueError naming the value, the rule and the fix unless t, p, d, c are positive
    ints."""
    for name, value, what in (("t", t, "tensor"), ("p", p, "pipeline"), ("d", d, "data"),
                              ("c", c, "context")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"{name}={value!r}: the {what}-parallel degree must be an int; "
                f"pass a whole number such as {name}=1")
        if value < 1:
            raise ValueError(
                f"{name}={value}: the {what}-parallel degree must be >= 1; "
                f"use {name}=1 for no {what} parallelism")


def world_size(t: int, p: int, d: int, *, c: int = 1) -> int:
    """Number of ranks a (t, p, d, c) layout needs: t * c * p * d."""
    validate_degrees(t, p, d, c=c)
    return t * c * p * d


def coords_rank(tp: int, dp: int, pp: int, t: int, p: int, d: int, *, cp: int = 0,
                c: int = 1) -> int:
    """Global rank of coordinates (tp, cp, dp, pp).

    Example: t=2, p=2, d=2: coords_rank(1, 0, 1, 2, 2, 2) == 1*4 + 0*2 + 1 == 5;
    with c=2: coords_rank(1, 0, 1, 2, 2, 2, cp=1, c=2) == 1*8 + 0*4 + 1*2 + 1 == 11.
    """
    validate_degrees(t, p, d, c=c)
    for name, value, size, deg in (("tp", tp, t, "t"), ("cp", cp, c, "c"), ("dp", dp, d, "d"),
                                   ("pp", pp, p, "p")):
        if not 0 <= value < size:
            raise ValueError(
                f"{name}={value}: must lie in [0, {deg}={size}); "
                f"pass a coordinate below the {deg} degree")
    return pp * (t * c * d) + dp * (t * c) + cp * t + tp


def rank_coords(rank: int, t: int, p: int, d: int, *, c: int = 1) -> tuple[int, int, int]:
    """(tp, dp, pp) coordinates of a global rank; with `context_rank`, the inverse of
    `coords_rank`.

    Example: t=2, p=2, d=2: rank_coords(5, 2, 2, 2) == (1, 0, 1)
    (5 = pp 1 * 4 + dp 0 * 2 + tp 1).
    """
    tp, _, dp, pp = rank_coords4(rank, t, p, d, c=c)
    return tp, dp, pp


def rank_coords4(rank: int, t: int, p: int, d: int, *, c: int = 1
                 ) -> tuple[int, int, int, int]:
    """(tp, cp, dp, pp) coordinates of a global rank; the inverse of `coords_rank`.

    Example: t=2, c=2, p=2, d=2: rank_coords4(11, 2, 2, 2, c=2) == (1, 1, 0, 1)
    (11 = pp 1 * 8 + dp 0 * 4 + cp 1 * 2 + tp 1).
    """
    n = world_size(t, p, d, c=c)
    if not 0 <= rank < n:
        dims = f"t*p*d={n}) for t={t}, p={p}, d={d}" if c == 1 else \
            f"t*c*p*d={n}) for t={t}, c={c}, p={p}, d={d}"
        raise ValueError(
            f"rank={rank}: must lie in [0, {dims}; "
            f"launch exactly {n} processes (torchrun --nproc_per_node={n})")
    pp, rest = divmod(rank, t * c * d)
    dp, rest = divmod(rest, t * c)
    cp, tp = divmod(rest, t)
    return tp, cp, dp, pp


def context_rank(rank: int, t: int, p: int, d: int, *, c: int = 1) -> int:
    """This rank's position in its context group (which sequence chunks it holds).

    Example: t=2, c=2, p=2, d=2: context_rank(11, 2, 2, 2, c=2) == 1.
    """
    return rank_coords4(rank, t, p, d, c=c)[1]


def tensor_groups(t: int, p: int, d: int, *, c: int = 1) -> Groups:
    """Tensor-parallel groups: t adjacent ranks each, ordered by (pp, dp, cp).

    Example: t=2, p=2, d=2 -> [[0, 1], [2, 3], [4, 5], [6, 7]].
    """
    validate_degrees(t, p, d, c=c)
    return [[coords_rank(tp, dp, pp, t, p, d, cp=cp, c=c) for tp in range(t)]
            for pp in range(p) for dp in range(d) for cp in range(c)]


def context_groups(t: int, p: int, d: int, *, c: int = 1) -> Groups:
    """Context-parallel groups: c ranks strided by t (they split one sequence), ordered by
    (pp, dp, tp).

    Example: t=2, c=2, p=2, d=2 -> [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], ...];
    c=1: every rank alone.
    """
    validate_degrees(t, p, d, c=c)
    return [[coords_rank(tp, dp, pp, t, p, d, cp=cp, c=c) for cp in range(c)]
            for pp in range(p) for dp in range(d) for tp in range(t)]


def data_groups(t: int, p: int, d: int, *, c: int = 1) -> Groups:
    """Data-parallel groups: d ranks strided by t*c, ordered by (pp, cp, tp).

    Example: t=2, p=2, d=2 -> [[0, 2], [1, 3], [4, 6], [5, 7]];
    t=2, c=2, p=2, d=2 -> [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], ...].
    """
    validate_degrees(t, p, d, c=c)
    return [[coords_rank(tp, dp, pp, t, p, d, cp=cp, c=c) for dp in range(d)]
            for pp in range(p) for cp in range(c) for tp in range(t)]


def gradient_groups(t: int, p: int, d: int, *, c: int = 1) -> Groups:
    """The c*d ranks that hold the same weights and reduce their gradients together (the data
    group joined with the context group; Megatron-Core's data-parallel-with-context group),
    strided by t, ordered by (pp, tp). With c=1 these are `data_groups`.

    Example: t=2, c=2, p=2, d=2 -> [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]].
    """
    validate_degrees(t, p, d, c=c)
    return [[coords_rank(tp, dp, pp, t, p, d, cp=cp, c=c) for dp in range(d) for cp in range(c)]
            for pp in range(p) for tp in range(t)]


# ----- expert parallelism: experts over the data(-and-context)-parallel ranks ------------------
def check_expert_degree(ep: int, *, c: int, d: int, experts: int | None = None) -> None:
    """Raise ValueError naming the value, the rule and the fix unless ep is a positive int that
    divides c·d (the expert-parallel ranks are drawn from the ranks that hold the same dense
    weights, Megatron-Core's rule) and, when given, the number of experts."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r}: the expert-parallel degree must be a positive int; pass "
                         f"ep=1 for no expert parallelism")
    if (c * d) % ep:
        raise ValueError(f"ep={ep} with c·d = {c}·{d} = {c * d}: the expert-parallel ranks are "
                         f"drawn from the c·d data-and-context-parallel ranks, so ep must divide "
                         f"{c * d}; pick an ep that divides it (ep=1 for none)")
    if experts is not None and experts % ep:
        raise ValueError(f"ep={ep} with {experts} experts: each expert-parallel rank holds "
                         f"experts/ep whole experts, so ep must divide {experts}; pick an ep "
                         f"that divides {experts}")


def expert_groups(t: int, p: int, d: int, *, c: int = 1, ep: int = 1) -> Groups:
    """Expert-parallel groups: ep ranks of one gradient group (`gradient_groups`, in its
    (dp, cp) order) that split the experts and exchange tokens by all-to-all — consecutive in
    that order, so the closest ranks of the c·d (Megatron-Core's tp-cp-ep-dp-pp order, expert
    tensor parallelism equal to t); ordered by (pp, tp, block).

    Example: t=2, p=1, d=4, ep=2 -> [[0, 2], [4, 6], [1, 3], [5, 7]];
    t=1, c=2, p=1, d=2, ep=2 -> [[0, 1], [2, 3]] (a context group); ep=1: every rank alone.
    """
    validate_degrees(t, p, d, c=c)
    check_expert_degree(ep, c=c, d=d)
    return [g[i:i + ep] for g in gradient_groups(t, p, d, c=c) for i in range(0, len(g), ep)]


def expert_data_groups(t: int, p: int, d: int, *, c: int = 1, ep: int = 1) -> Groups:
    """Expert-data-parallel groups: the c·d/ep ranks of one gradient group that hold the same
    experts (the same position in their expert groups), over which the expert weights'
    gradients are reduced (Megatron-Core's expert-data-parallel group); ordered by (pp, tp,
    expert rank). With ep=1 these are `gradient_groups`.

    Example: t=2, p=1, d=4, ep=2 -> [[0, 4], [2, 6], [1, 5], [3, 7]];
    t=1, p=1, d=4, ep=4 -> [[0], [1], [2], [3]] (every expert on one rank: no reduction).
    """
    validate_degrees(t, p, d, c=c)
    check_expert_degree(ep, c=c, d=d)
    return [g[i::ep] for g in gradient_groups(t, p, d, c=c) for i in range(ep)]


def expert_rank(rank: int, t: int, p: int, d: int, *, c: int = 1, ep: int = 1) -> int:
    """This rank's position in its expert group: it holds experts [e·E/ep, (e+1)·E/ep).

    Example: t=2, p=1, d=4, ep=2: expert_rank(4, 2, 1, 4, ep=2) == 0 (rank 4 is dp 2);
    expert_rank(6, 2, 1, 4, ep=2) == 1.
    """
    check_expert_degree(ep, c=c, d=d)
    _, cp, dp, _ = rank_coords4(rank, t, p, d, c=c)
    return (dp * c + cp) % ep


def pipeline_groups(t: int, p: int, d: int, *, c: int = 1) -> Groups:
    """Pipeline groups: p ranks strided by t*c*d, stage order, ordered by (dp, cp, tp).

    Example: t=2, p=2, d=2 -> [[0, 4], [1, 5], [2, 6], [3, 7]];
    t=2, p=4, d=2 (Megatron's 16 GPUs) -> [[0, 4, 8, 12], [1, 5, 9, 13], ...].
    """
    validate_degrees(t, p, d, c=c)
    return [[coords_rank(tp, dp, pp, t, p, d, cp=cp, c=c) for pp in range(p)]
            for dp in range(d) for cp in range(c) for tp in range(t)]


def embedding_groups(t: int, p: int, d: int, *, c: int = 1) -> Groups:
    """First and last rank of each pipeline (tied input/output embeddings sync their grads here).

    Example: t=2, p=4, d=2 -> [[0, 12], [1, 13], [2, 14], [3, 15]];
    with p=1 each group is a single rank: t=2, p=1, d=1 -> [[0], [1]].
    """
    return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pipeline_groups(t, p, d, c=c)]


def stage_subset_groups(stages: tuple[int, ...], t: int, p: int, d: int, *, c: int = 1
                        ) -> Groups:
    """The ranks of pipeline stages `stages` in each pipeline: a block called at several depths
    and held by some stages only sums its gradients over these (Megatron's embedding group,
    generalised to any subset of stages).

    Example: stages (0, 1, 2), t=1, p=4, d=1 -> [[0, 1, 2]]; stages (1, 2), t=2, p=4, d=1 ->
    [[2, 4], [3, 5]].
    """
    if not stages or any(not 0 <= s < p for s in stages) or list(stages) != sorted(set(stages)):
        raise ValueError(f"stage_subset_groups: stages={stages} for p={p}; give distinct "
                         f"pipeline stages in [0, {p}) in increasing order")
    return [[g[s] for s in stages] for g in pipeline_groups(t, p, d, c=c)]


def model_parallel_groups(t: int, p: int, d: int, *, c: int = 1) -> Groups:
    """Model-parallel groups: the t*p ranks that hold one copy of the weights (one per data and
    context rank: context ranks hold the same weights, like data-parallel ones), ordered by
    (dp, cp).

    Example: t=2, p=2, d=2 -> [[0, 1, 4, 5], [2, 3, 6, 7]];
    t=2, c=2, p=2, d=1 -> [[0, 1, 4, 5], [2, 3, 6, 7]].
    """
    validate_degrees(t, p, d, c=c)
    return [sorted(coords_rank(tp, dp, pp, t, p, d, cp=cp, c=c) for pp in range(p)
                   for tp in range(t))
            for dp in range(d) for cp in range(c)]


def group_of(rank: int, groups: Groups) -> list[int]:
    """The group in `groups` that contains `rank` (each rank is in exactly one)."""
    for g in groups:
        if rank in g:
            return g
    raise ValueError(f"rank={rank}: in none of the groups {groups}; "
                     f"pass groups built for a world that contains this rank")


def pipeline_neighbours(rank: int, t: int, p: int, d: int, *, c: int = 1) -> tuple[int, int]:
    """(previous, next) global rank in this rank's pipeline, wrapping around (interleaved ring).

    Example: t=2, p=4, d=2: pipeline_neighbours(4, 2, 4, 2) == (0, 8);
    pipeline_neighbours(12, 2, 4, 2) == (8, 0).
    """
    tp, cp, dp, pp = rank_coords4(rank, t, p, d, c=c)
    return (coords_rank(tp, dp, (pp - 1) % p, t, p, d, cp=cp, c=c),
            coords_rank(tp, dp, (pp + 1) % p, t, p, d, cp=cp, c=c))


# ----- the sequence split of context parallelism -------------------------------------------------
def sequence_chunks(cp: int, c: int) -> tuple[int, int]:
    """The two of the 2c equal sequence chunks context rank cp holds: cp and 2c-1-cp, so that
    under a causal mask every rank attends to the same number of (query, key) pairs (Llama 3,
    2407.21783 §3.3.2; Megatron-Core's load-balanced split).

    Example: c=2: rank 0 holds chunks (0, 3), rank 1 (1, 2).
    """
    validate_degrees(1, 1, 1, c=c)
    if not 0 <= cp < c:
        raise ValueError(f"cp={cp}: must lie in [0, c={c}); pass a context rank below c")
    return cp, 2 * c - 1 - cp


def check_sequence(seq_len: int, c: int) -> None:
    """Raise ValueError unless the sequence splits into 2c equal chunks."""
    validate_degrees(1, 1, 1, c=c)
    if c > 1 and seq_len % (2 * c):
        raise ValueError(
            f"seq_len={seq_len} with c={c}: context parallelism cuts the sequence into 2c = "
            f"{2 * c} equal chunks, so the sequence length must be divisible by {2 * c}; pad "
            f"the sequence to a multiple of {2 * c} or pick a c with 2c dividing {seq_len}")


def sequence_positions(seq_len: int, cp: int, c: int) -> list[int]:
    """Global token positions context rank cp holds, in its local order (its first chunk, then
    its second).

    Example: seq_len=8, c=2: rank 0 holds [0, 1, 6, 7], rank 1 [2, 3, 4, 5].
    """
    check_sequence(seq_len, c)
    n = seq_len // (2 * c)
    first, second = sequence_chunks(cp, c)
    return list(range(first * n, (first + 1) * n)) + list(range(second * n, (second + 1) * n))


# ----- the hybrid context method: all-to-all inside a node, all-gather across ----------------
def hybrid_candidates(c: int, ranks_per_node: int) -> tuple[int, ...]:
    """The inner (all-to-all) degrees k the hybrid context method may use: the divisors
    1 < k < c of c that divide `ranks_per_node`, the context ranks one node holds (its GPUs
    over t; context ranks are strided by t), so every inner group of k consecutive context
    ranks lies inside one node; none when the c ranks fit in one node (the hybrid is for a
    context group across nodes: inside one the all-to-all or the all-gather over all c is the
    choice). Ascending.

    Example: c=16, 8 context ranks per node -> (2, 4, 8); c=4, 2 per node -> (2,); c=4, 4 per
    node -> () (one node); c=2 -> ().
    """
    validate_degrees(1, 1, 1, c=c)
    if c <= ranks_per_node:
        return ()
    # k divides c and the node's ranks: the divisors of their gcd (the planner asks at every
    # c of 16,384 GPUs; scanning up to c took ~0.2 s a solve)
    g = math.gcd(c, max(1, ranks_per_node))
    return tuple(k for k in range(2, min(g, c - 1) + 1) if g % k == 0)


def hybrid_inner_degree(c: int, heads: int, ranks_per_node: int) -> int:
    """The hybrid's inner degree: the largest of `hybrid_candidates` that divides `heads` (the
    query heads one tensor rank holds: each inner rank takes heads/k of them), or 1 when none
    does (the hybrid is then the all-gather over the c ranks). The outer degree is c / k.

    Example: c=16, 32 heads, 8 per node -> 8; c=16, 4 heads, 8 per node -> 4; c=4, 3 heads,
    2 per node -> 1; c=8, 8 per node -> 1 (one node).
    """
    return max((k for k in hybrid_candidates(c, ranks_per_node) if heads % k == 0), default=1)


def hybrid_heads_rule(heads: int, c: int) -> str | None:
    """Why the hybrid cannot split `heads` (per tensor rank) at c, or None: some divisor
    1 < k < c of c must divide them (the node may allow fewer: `hybrid_inner_degree`)."""
    g = math.gcd(heads, c)   # k divides both: a divisor of their gcd
    if not any(g % k == 0 for k in range(2, min(g, c - 1) + 1)):
        return (f"hybrid attention trades heads over k of the c={c} context ranks, a divisor "
                f"1 < k < c of c that divides the {heads} heads per tensor rank; none does "
                f"(use 'all-to-all' or 'all-gather')")
    return None


def context_inner_groups(t: int, p: int, d: int, *, c: int, k: int) -> Groups:
    """The hybrid's inner groups: k consecutive context ranks of each context group (the
    all-to-all; inside a node), in `context_groups` order, then by block.

    Example: t=1, c=4, p=1, d=1, k=2 -> [[0, 1], [2, 3]]; t=2, c=4, k=2 -> [[0, 2], [4, 6],
    [1, 3], [5, 7]].
    """
    _check_inner(c, k)
    return [g[i:i + k] for g in context_groups(t, p, d, c=c) for i in range(0, c, k)]


def context_outer_groups(t: int, p: int, d: int, *, c: int, k: int) -> Groups:
    """The hybrid's outer groups: the c/k context ranks of each context group at the same place
    in their inner groups (stride k in it: the all-gather, across nodes).

    Example: t=1, c=4, p=1, d=1, k=2 -> [[0, 2], [1, 3]]; t=1, c=8, k=2 -> [[0, 2, 4, 6],
    [1, 3, 5, 7]].
    """
    _check_inner(c, k)
    return [g[i::k] for g in context_groups(t, p, d, c=c) for i in range(k)]


def _check_inner(c: int, k: int) -> None:
    validate_degrees(1, 1, 1, c=c)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or c % k:
        raise ValueError(f"k={k!r}: the hybrid's inner degree must be a positive int dividing "
                         f"c={c}; pick a divisor of {c} such as 1")
