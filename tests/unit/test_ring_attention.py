"""Ring attention (issue 15's optional part): the online-softmax merge of partial attentions
equals full attention (one process, causal chunk masks included), the causal tiles cover
exactly the (query, key) pairs the mask keeps, c = 1 is plain SDPA. On gloo ranks:
tests/numerics/test_context_attention_ranks.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.runtime import groups as G
from autopar.runtime.ring_attention import (_causal_tiles, _tile_backward, _tile_forward,
                                            merge_partials)


def _partial(q, k, v, bias):
    """(out, lse) of attention of q over one key block, fp32, −inf bias masking."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def test_merge_of_partials_is_full_attention_with_causal_chunk_masks():
    """Keys cut in 4 blocks of a causal mask (some rows see no key of a block: lse −inf):
    merged in any order, the partials give SDPA's causal output."""
    torch.manual_seed(0)
    T, E = 16, 8
    q, k, v = (torch.randn(2, 3, T, E, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    bias = torch.zeros(T, T, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        out = torch.zeros(2, 3, T, E, dtype=torch.float64)
        lse = torch.full((2, 3, T), float("-inf"), dtype=torch.float64)
        for b in order:
            cols = slice(4 * b, 4 * b + 4)
            bo, bl = _partial(q, k[..., cols, :], v[..., cols, :], bias[:, cols])
            bo = torch.nan_to_num(bo)          # rows with no key in the block: weight 0 anyway
            out, lse = merge_partials(out, lse, bo, bl)
        torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, torch.logsumexp(
            q @ k.transpose(-1, -2) / E ** 0.5 + bias, -1))


@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_causal_tiles_cover_exactly_the_causal_pairs_with_equal_work(c):
    """Over the c ring steps each rank's tiles cover its queries' causal (query, key) pairs
    once, and every rank (and every step but its own) computes the same number of pairs."""
    n = 3
    T = 2 * c * n
    work = []
    for rank in range(c):
        qpos = G.sequence_positions(T, rank, c)
        seen = set()
        steps = []
        for s in range(c):
            owner = (rank - s) % c
            kpos = G.sequence_positions(T, owner, c)
            pairs = 0
            for tile in _causal_tiles(rank, owner, c, n):
                for i in range(tile.qn):
                    for j in range(tile.kn):
                        qp, kp = qpos[tile.q0 + i], kpos[j]
                        if tile.diagonal and j - (tile.kn - tile.qn) > i:
                            continue
                        assert kp <= qp, (rank, owner, tile)
                        assert (qp, kp) not in seen
                        seen.add((qp, kp))
                        pairs += 1
            steps.append(pairs)
        assert seen == {(qp, kp) for qp in qpos for kp in range(qp + 1)}
        assert len(set(steps[1:])) <= 1
        work.append(sum(steps))
    assert len(set(work)) == 1


@pytest.mark.parametrize("diagonal, masked", [(True, False), (False, True)])
def test_fused_tile_kernel_equals_the_written_out_one(diagonal, masked):
    """The CPU fused kernel (with its lse, and its backward from the merged output and lse)
    and the written-out product the ring uses off CPU give the same tile, a masked-out row
    included (lse −inf, output 0)."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 6, 8, dtype=torch.float64) for _ in range(4))
    bias = None
    if masked:
        bias = torch.zeros(6, 6, dtype=torch.float64)
        bias[0] = float("-inf")
        bias[2, 3:] = float("-inf")
    fwd = [_tile_forward(q, k, v, bias, diagonal, 0.3, fused=f) for f in (True, False)]
    for a, b in zip(*fwd):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if masked:
        assert torch.isneginf(fwd[0][1][..., 0]).all() and (fwd[0][0][..., 0, :] == 0).all()
    out, lse = fwd[1]
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)   # rows seen elsewhere
    bwd = [_tile_backward(dout, q, k, v, out, lse, bias, diagonal, 0.3, fused=f)
           for f in (True, False)]
    for a, b in zip(*bwd):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_one_context_rank_is_plain_sdpa():
    """c = 1 (a group of one): scaled_dot_product_attention itself, the kv_group's repeat read
    as grouped-query attention."""
    from autopar.runtime.context_shard import ContextShard
    from autopar.runtime.ring_attention import context_ring_attention
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 8)
    k, v = (torch.randn(2, 2, 8, 8).repeat_interleave(2, 1) for _ in range(2))
    cp = ContextShard(group=None, c=1, cp_rank=0, seq_len=8)
    out = context_ring_attention(q, k, v, cp, is_causal=True, kv_group=2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
