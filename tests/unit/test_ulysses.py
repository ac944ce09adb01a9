"""All-to-all (DeepSpeed-Ulysses) context attention with c = 1 is plain SDPA; on gloo ranks
(equal to single-device SDPA, output and gradients):
tests/numerics/test_context_attention_ranks.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def test_one_context_rank_is_plain_sdpa():
    from autopar.runtime.context_shard import ContextShard
    from autopar.runtime.ulysses import context_alltoall_attention
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 8)
    k, v = (torch.randn(2, 2, 8, 8).repeat_interleave(2, 1) for _ in range(2))
    cp = ContextShard(group=None, c=1, cp_rank=0, seq_len=8)
    out = context_alltoall_attention(q, k, v, cp, is_causal=True, kv_group=2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_hybrid_one_context_rank_is_plain_sdpa_and_missing_groups_refused():
    """The hybrid (all-to-all inside a node, all-gather across) with one context rank is plain
    SDPA; without the inner groups its degree needs, one line naming k and the fix. On gloo
    ranks: tests/numerics/test_context_attention_ranks.py (c = 4 = 2 inner × 2 outer)."""
    import pytest

    from autopar.runtime.context_shard import ContextShard
    from autopar.runtime.ulysses import context_hybrid_attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 8) for _ in range(3))
    cp = ContextShard(group=None, c=1, cp_rank=0, seq_len=8)
    out = context_hybrid_attention(q, k, v, cp, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    cp = ContextShard(group=object(), c=4, cp_rank=0, seq_len=8, subgroups={}, node_ranks=2)
    with pytest.raises(ValueError, match=r"k=2.*cp_attention='all-gather'"):
        context_hybrid_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], cp, is_causal=True)
