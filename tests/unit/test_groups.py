"""Golden tests for the pure rank-group math (autopar/runtime/groups.py)."""
import itertools

import pytest

from autopar.runtime import groups as G


def test_eight_ranks_t2_p2_d2():
    assert G.tensor_groups(2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert G.data_groups(2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert G.pipeline_groups(2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert G.embedding_groups(2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert G.model_parallel_groups(2, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_megatron_16_gpu_example():
    # Megatron-LM parallel_state docstring: 16 GPUs, tensor 2, pipeline 4 (so data 2).
    t, p, d = 2, 4, 2
    assert G.tensor_groups(t, p, d) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11],
                                        [12, 13], [14, 15]]
    assert G.data_groups(t, p, d) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                                      [12, 14], [13, 15]]
    assert G.pipeline_groups(t, p, d) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14],
                                          [3, 7, 11, 15]]
    assert G.embedding_groups(t, p, d) == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert G.model_parallel_groups(t, p, d) == [[0, 1, 4, 5, 8, 9, 12, 13],
                                                [2, 3, 6, 7, 10, 11, 14, 15]]
    # a block some stages only call (issue 31): the ranks of those stages in each pipeline
    assert G.stage_subset_groups((0, 1, 2), t, p, d) == [[0, 4, 8], [1, 5, 9], [2, 6, 10],
                                                         [3, 7, 11]]
    assert G.stage_subset_groups((1, 2), 2, 4, 1) == [[2, 4], [3, 5]]
    with pytest.raises(ValueError, match="stages=.2, 1.*increasing order"):
        G.stage_subset_groups((2, 1), t, p, d)


def test_degenerate_degrees():
    assert G.tensor_groups(1, 1, 4) == [[0], [1], [2], [3]]
    assert G.data_groups(1, 1, 4) == [[0, 1, 2, 3]]
    assert G.pipeline_groups(1, 3, 1) == [[0, 1, 2]]
    assert G.embedding_groups(1, 3, 1) == [[0, 2]]
    assert G.embedding_groups(2, 1, 1) == [[0], [1]]
    assert G.tensor_groups(4, 1, 1) == [[0, 1, 2, 3]]


def test_coords_examples_and_neighbours():
    assert G.rank_coords(5, 2, 2, 2) == (1, 0, 1)
    assert G.coords_rank(1, 0, 1, 2, 2, 2) == 5
    assert G.pipeline_neighbours(4, 2, 4, 2) == (0, 8)
    assert G.pipeline_neighbours(12, 2, 4, 2) == (8, 0)
    assert G.pipeline_neighbours(3, 1, 1, 4) == (3, 3)


@pytest.mark.parametrize("t,p,d", list(itertools.product([1, 2, 3], [1, 2, 4], [1, 2, 3])))
def test_partitions_and_round_trip(t, p, d):
    n = t * p * d
    for rank in range(n):
        tp, dp, pp = G.rank_coords(rank, t, p, d)
        assert G.coords_rank(tp, dp, pp, t, p, d) == rank
        assert rank == pp * t * d + dp * t + tp
    for family, size, count in ((G.tensor_groups, t, p * d), (G.data_groups, d, p * t),
                                (G.pipeline_groups, p, t * d), (G.model_parallel_groups, t * p, d)):
        gs = family(t, p, d)
        assert len(gs) == count and all(len(g) == size for g in gs)
        assert sorted(r for g in gs for r in g) == list(range(n))  # a partition of the ranks
    for g in G.tensor_groups(t, p, d):  # tensor ranks are adjacent
        assert g == list(range(g[0], g[0] + t))
    for g in G.pipeline_groups(t, p, d):  # pipeline groups are in stage order
        assert [G.rank_coords(r, t, p, d)[2] for r in g] == list(range(p))
    # the tensor, data and pipeline groups of a rank intersect only in that rank
    for rank in range(n):
        sets = [set(G.group_of(rank, fam(t, p, d)))
                for fam in (G.tensor_groups, G.data_groups, G.pipeline_groups)]
        assert sets[0] & sets[1] == sets[1] & sets[2] == sets[0] & sets[2] == {rank}


@pytest.mark.parametrize("args,words", [
    ((0, 1, 1), ["t=0", ">= 1", "t=1"]),
    ((1, -2, 1), ["p=-2", "pipeline"]),
    ((1, 1, 2.0), ["d=2.0", "int"]),
    ((2, 1, True), ["d=True", "int"]),
])
def test_bad_degrees(args, words):
    with pytest.raises(ValueError) as e:
        G.tensor_groups(*args)
    for w in words:
        assert w in str(e.value)


def test_bad_rank_and_coords():
    with pytest.raises(ValueError, match=r"rank=8.*t\*p\*d=8.*nproc_per_node=8"):
        G.rank_coords(8, 2, 2, 2)
    with pytest.raises(ValueError, match=r"tp=2"):
        G.coords_rank(2, 0, 0, 2, 1, 1)


def test_hybrid_context_groups_golden():
    """The hybrid's inner degree (a divisor 1 < k < c of c that divides the context ranks per
    node and the heads) and its inner (consecutive) / outer (stride k) groups."""
    assert G.hybrid_candidates(16, 8) == (2, 4, 8)
    assert G.hybrid_candidates(4, 2) == (2,)
    assert G.hybrid_candidates(4, 4) == ()             # one node: all-to-all or all-gather
    assert G.hybrid_candidates(2, 1) == ()
    assert G.hybrid_candidates(16, 6) == (2,)          # 4 and 8 would straddle a node
    assert G.hybrid_inner_degree(16, 32, 8) == 8
    assert G.hybrid_inner_degree(16, 4, 8) == 4        # the heads limit it
    assert G.hybrid_inner_degree(4, 3, 2) == 1         # none: the all-gather over c
    assert G.hybrid_inner_degree(8, 8, 8) == 1         # one node
    assert G.hybrid_heads_rule(8, 4) is None
    assert "none does" in G.hybrid_heads_rule(3, 4) and "c=2" in G.hybrid_heads_rule(4, 2)
    assert G.context_inner_groups(1, 1, 1, c=4, k=2) == [[0, 1], [2, 3]]
    assert G.context_outer_groups(1, 1, 1, c=4, k=2) == [[0, 2], [1, 3]]
    assert G.context_inner_groups(2, 1, 1, c=4, k=2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert G.context_outer_groups(1, 1, 1, c=8, k=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for t, p, d, c, k in ((2, 2, 2, 4, 2), (1, 1, 2, 8, 4)):   # each a partition, inside c
        for fam in (G.context_inner_groups, G.context_outer_groups):
            gs = fam(t, p, d, c=c, k=k)
            assert sorted(r for g in gs for r in g) == list(range(t * p * d * c))
            for g in gs:
                assert G.group_of(g[0], G.context_groups(t, p, d, c=c))[0] <= g[0]
                assert set(g) <= set(G.group_of(g[0], G.context_groups(t, p, d, c=c)))
    with pytest.raises(ValueError, match=r"k=3.*dividing c=4"):
        G.context_inner_groups(1, 1, 1, c=4, k=3)


def test_shared_weight_groups_by_name():
    """ParamInfo.shared_with names the stages a shared weight lives on (issue 31): the first
    and last, every stage, or a subset; shared_ranks reads them off this pipeline's ranks."""
    from types import SimpleNamespace
    from autopar.runtime.dist import ProcessGroups, shared_stages
    assert shared_stages("embedding", 4) == (0, 3)
    assert shared_stages("embedding", 1) == (0,)
    assert shared_stages("pipeline", 3) == (0, 1, 2)
    assert shared_stages("stages:1,2", 4) == (1, 2)
    pg = SimpleNamespace(pipeline_ranks=(1, 5, 9, 13), p=4)
    assert ProcessGroups.shared_ranks(pg, "stages:1,2") == (5, 9)
    assert ProcessGroups.shared_ranks(pg, "embedding") == (1, 13)
