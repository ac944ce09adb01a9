"""Rank-group math: pure integer functions of the parallel degrees (t, p, d).

The layout is Megatron-LM's (2104.04473 §3; Megatron-Core `parallel_state`): tensor-parallel
ranks innermost, so a tensor group is a run of adjacent ranks and shares a node; data-parallel
next; pipeline outermost::

    global_rank = pp * (t * d) + dp * t + tp

Megatron's documented example, 16 GPUs with t=2, p=4 (so d=2)::

    tensor   groups [0,1] [2,3] [4,5] ... [14,15]
    data     groups [0,2] [1,3] [4,6] [5,7] ... [13,15]
    pipeline groups [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]

Nothing here touches torch.distributed; `autopar.runtime.dist.ProcessGroups` turns these lists
into process groups. Every function returns groups in a fixed order (the same on every rank),
which is the order `dist.new_group` must be called in.
"""
from __future__ import annotations

Groups = list[list[int]]


def validate_degrees(t: int, p: int, d: int) -> None:
    """Raise ValueError naming the value, the rule and the fix unless t, p, d are positive ints."""
    for name, value, what in (("t", t, "tensor"), ("p", p, "pipeline"), ("d", d, "data")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"{name}={value!r}: the {what}-parallel degree must be an int; "
                f"pass a whole number such as {name}=1")
        if value < 1:
            raise ValueError(
                f"{name}={value}: the {what}-parallel degree must be >= 1; "
                f"use {name}=1 for no {what} parallelism")


def world_size(t: int, p: int, d: int) -> int:
    """Number of ranks a (t, p, d) layout needs: t * p * d."""
    validate_degrees(t, p, d)
    return t * p * d


def coords_rank(tp: int, dp: int, pp: int, t: int, p: int, d: int) -> int:
    """Global rank of coordinates (tp, dp, pp).

    Example: t=2, p=2, d=2: coords_rank(1, 0, 1, 2, 2, 2) == 1*4 + 0*2 + 1 == 5.
    """
    validate_degrees(t, p, d)
    for name, value, size, deg in (("tp", tp, t, "t"), ("dp", dp, d, "d"), ("pp", pp, p, "p")):
        if not 0 <= value < size:
            raise ValueError(
                f"{name}={value}: must lie in [0, {deg}={size}); "
                f"pass a coordinate below the {deg} degree")
    return pp * (t * d) + dp * t + tp


def rank_coords(rank: int, t: int, p: int, d: int) -> tuple[int, int, int]:
    """(tp, dp, pp) coordinates of a global rank; the inverse of `coords_rank`.

    Example: t=2, p=2, d=2: rank_coords(5, 2, 2, 2) == (1, 0, 1)
    (5 = pp 1 * 4 + dp 0 * 2 + tp 1).
    """
    n = world_size(t, p, d)
    if not 0 <= rank < n:
        raise ValueError(
            f"rank={rank}: must lie in [0, t*p*d={n}) for t={t}, p={p}, d={d}; "
            f"launch exactly {n} processes (torchrun --nproc_per_node={n})")
    pp, rest = divmod(rank, t * d)
    dp, tp = divmod(rest, t)
    return tp, dp, pp


def tensor_groups(t: int, p: int, d: int) -> Groups:
    """Tensor-parallel groups: t adjacent ranks each, ordered by (pp, dp).

    Example: t=2, p=2, d=2 -> [[0, 1], [2, 3], [4, 5], [6, 7]].
    """
    validate_degrees(t, p, d)
    return [[coords_rank(tp, dp, pp, t, p, d) for tp in range(t)]
            for pp in range(p) for dp in range(d)]


def data_groups(t: int, p: int, d: int) -> Groups:
    """Data-parallel groups: d ranks strided by t, ordered by (pp, tp).

    Example: t=2, p=2, d=2 -> [[0, 2], [1, 3], [4, 6], [5, 7]].
    """
    validate_degrees(t, p, d)
    return [[coords_rank(tp, dp, pp, t, p, d) for dp in range(d)]
            for pp in range(p) for tp in range(t)]


def pipeline_groups(t: int, p: int, d: int) -> Groups:
    """Pipeline groups: p ranks strided by t*d, stage order, ordered by (dp, tp).

    Example: t=2, p=2, d=2 -> [[0, 4], [1, 5], [2, 6], [3, 7]];
    t=2, p=4, d=2 (Megatron's 16 GPUs) -> [[0, 4, 8, 12], [1, 5, 9, 13], ...].
    """
    validate_degrees(t, p, d)
    return [[coords_rank(tp, dp, pp, t, p, d) for pp in range(p)]
            for dp in range(d) for tp in range(t)]


def embedding_groups(t: int, p: int, d: int) -> Groups:
    """First and last rank of each pipeline (tied input/output embeddings sync their grads here).

    Example: t=2, p=4, d=2 -> [[0, 12], [1, 13], [2, 14], [3, 15]];
    with p=1 each group is a single rank: t=2, p=1, d=1 -> [[0], [1]].
    """
    return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pipeline_groups(t, p, d)]


def model_parallel_groups(t: int, p: int, d: int) -> Groups:
    """Model-parallel groups: the t*p ranks that hold one replica, ordered by dp.

    Example: t=2, p=2, d=2 -> [[0, 1, 4, 5], [2, 3, 6, 7]].
    """
    validate_degrees(t, p, d)
    return [sorted(coords_rank(tp, dp, pp, t, p, d) for pp in range(p) for tp in range(t))
            for dp in range(d)]


def group_of(rank: int, groups: Groups) -> list[int]:
    """The group in `groups` that contains `rank` (each rank is in exactly one)."""
    for g in groups:
        if rank in g:
            return g
    raise ValueError(f"rank={rank}: in none of the groups {groups}; "
                     f"pass groups built for a world that contains this rank")


def pipeline_neighbours(rank: int, t: int, p: int, d: int) -> tuple[int, int]:
    """(previous, next) global rank in this rank's pipeline, wrapping around (interleaved ring).

    Example: t=2, p=4, d=2: pipeline_neighbours(4, 2, 4, 2) == (0, 8);
    pipeline_neighbours(12, 2, 4, 2) == (8, 0).
    """
    tp, dp, pp = rank_coords(rank, t, p, d)
    return (coords_rank(tp, dp, (pp - 1) % p, t, p, d),
            coords_rank(tp, dp, (pp + 1) % p, t, p, d))
