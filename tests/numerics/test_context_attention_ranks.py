"""Context attention on gloo ranks equals single-device SDPA, output and gradients (q, k, v).
Ring attention (autopar/runtime/ring_attention.py): the ring's output and its gradients (kv
heads only under grouped-query attention), causal and with an explicit mask. All-to-all
(DeepSpeed-Ulysses, autopar/runtime/ulysses.py): causal (the 2c-chunk layout reordered to
global positions), an explicit per-head mask read whole and cut to the rank's heads,
grouped-query K/V through a repeat in the graph (only the kv heads exchanged) and with fewer kv
heads than ranks (repeated first). The one-process parts: tests/unit/test_ring_attention.py,
tests/unit/test_ulysses.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.distributed


# ----- ring attention ---------------------------------------------------------------------------
def _ring_rank(rank, world, case):
    import torch.distributed as dist

    from autopar.runtime.context_shard import ContextShard, context_cut, context_gather
    from autopar.runtime.ring_attention import context_ring_attention
    torch.manual_seed(0)
    B, Hq, Hk, T, E = 2, 4, case["kv_heads"], case["T"], 8
    q = torch.randn(B, Hq, T, E, dtype=torch.float64)
    k = torch.randn(B, Hk, T, E, dtype=torch.float64)
    v = torch.randn(B, Hk, T, E, dtype=torch.float64)
    dout = torch.randn(B, Hq, T, E, dtype=torch.float64)
    mask = None
    if case["mask"]:    # a sliding window of 3 (causal): rows' key sets not a prefix
        i = torch.arange(T)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
        if case["mask"] == "heads":   # per head (heads, T, T): windows of 3 and 2 alternating
            mask = torch.stack([mask & (i[:, None] - i[None, :] < 3 - h % 2) for h in range(Hq)])
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    g = Hq // Hk
    rk, rv = (x.repeat_interleave(g, 1) for x in ref[1:])
    full = F.scaled_dot_product_attention(ref[0], rk, rv, attn_mask=mask,
                                          is_causal=mask is None)
    full.backward(dout)
    cp = ContextShard(group=dist.group.WORLD, c=world, cp_rank=rank, seq_len=T)
    mine = [context_cut(x, cp, 2).detach().clone().requires_grad_() for x in (q, k, v)]
    lq, lk, lv = mine
    if case["repeat"]:      # repeat_kv in the graph: the ring reads every g-th head
        lk, lv = (x.repeat_interleave(g, 1) for x in (lk, lv))
    lmask = None if mask is None else context_cut(mask, cp, mask.dim() - 2)   # query rows
    out = context_ring_attention(lq, lk, lv, cp, attn_mask=lmask, is_causal=mask is None,
                                 enable_gqa=not case["repeat"] and Hk < Hq,
                                 kv_group=g if case["repeat"] else 1)
    assert out.transpose(1, 2).is_contiguous()      # the fused kernels' memory layout
    out.backward(context_cut(dout, cp, 2))
    whole = [context_gather(x.detach(), cp, 2) for x in (out, *[m.grad for m in mine])]
    return [w.numpy() for w in whole], [x.detach().numpy() for x in (full, *[r.grad for r in ref])]


@pytest.mark.parametrize("world, case", [
    (2, {"kv_heads": 4, "T": 8, "mask": False, "repeat": False}),      # MHA, causal
    (2, {"kv_heads": 2, "T": 8, "mask": False, "repeat": True}),       # GQA via repeat_kv
    (2, {"kv_heads": 1, "T": 8, "mask": True, "repeat": False}),       # MQA + explicit mask
    (3, {"kv_heads": 2, "T": 12, "mask": False, "repeat": False}),     # c = 3, enable_gqa
    (4, {"kv_heads": 4, "T": 16, "mask": "heads", "repeat": False}),   # c = 4, per-head mask
])
def test_ring_equals_single_device_sdpa_forward_and_backward(world, case):
    from autopar.testing import spawn
    for got, want in spawn(_ring_rank, world, case, timeout_s=120):
        for a, b in zip(got, want):
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b),
                                       rtol=1e-10, atol=1e-10)


def _ring_ops_rank(rank, world):
    """(forward, backward) ops the ring dispatches on this rank, its transfers left out,
    causal and not."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.runtime.context_shard import ContextShard
    from autopar.runtime.ring_attention import context_ring_attention

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not str(func).startswith("c10d."):
                self.n += 1
            return func(*args, **(kwargs or {}))
    out = []
    cp = ContextShard(group=dist.group.WORLD, c=world, cp_rank=rank, seq_len=8 * world)
    for causal in (False, True):
        q, k, v = (torch.randn(2, 2, 8, 8, requires_grad=True) for _ in range(3))
        with Count() as fwd:
            o = context_ring_attention(q, k, v, cp, is_causal=causal)
        with Count() as bwd:
            o.backward(torch.ones_like(o))
        out.append((fwd.n, bwd.n))
    return out


def test_ring_dispatches_the_ops_the_cost_model_prices_per_step():
    """cost/exchanges.py prices RING_OPS_PER_STEP ops a ring step each way where ops are
    dispatched one by one: counted here on the runtime's ring at c = 2 and 3, causal and not
    — the ops a further step adds within 4 of it, and c steps' within 3 a step of it, + 8
    for the call's own views."""
    from autopar.cost.exchanges import RING_OPS_PER_STEP as R
    from autopar.testing import spawn
    counts = {c: spawn(_ring_ops_rank, c, timeout_s=120) for c in (2, 3)}
    for c, ranks in counts.items():
        for rank in ranks:
            for fwd, bwd in rank:
                for n in (fwd, bwd):
                    assert c * (R - 3) <= n <= c * (R + 3) + 8, (c, ranks)
    for (f2, b2), (f3, b3) in zip(counts[2][0], counts[3][0]):
        assert abs(f3 - f2 - R) <= 4 and abs(b3 - b2 - R) <= 4, counts


# ----- all-to-all attention and the hybrid ----------------------------------------------------
def _a2a_rank(rank, world, case):
    """Per method of case["methods"] ("all-to-all"; "hybrid": inner groups of 2 consecutive
    ranks, all-gather over the outer groups; "hybrid-ring": the ring over them), the rank's output and gradients made whole and
    the single device's."""
    import torch.distributed as dist

    from autopar.runtime import groups as G
    from autopar.runtime.context_shard import ContextShard, context_cut, context_gather
    from autopar.runtime.ulysses import (context_alltoall_attention, context_hybrid_attention,
                                         context_hybrid_ring_attention)
    torch.manual_seed(0)
    B, Hq, Hk, T, E = 2, 4, case["kv_heads"], 4 * world, 8
    q = torch.randn(B, Hq, T, E, dtype=torch.float64)
    k = torch.randn(B, Hk, T, E, dtype=torch.float64)
    v = torch.randn(B, Hk, T, E, dtype=torch.float64)
    dout = torch.randn(B, Hq, T, E, dtype=torch.float64)
    mask = None
    if case["mask"]:    # per-head additive bias (ALiBi-like) on a causal window
        i = torch.arange(T)
        keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
        slopes = torch.arange(1, Hq + 1, dtype=torch.float64)[:, None, None] / 4
        mask = (-(i[:, None] - i[None, :]).abs() * slopes).masked_fill(~keep, float("-inf"))
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    g = Hq // Hk
    rk, rv = (x.repeat_interleave(g, 1) for x in ref[1:])
    full = F.scaled_dot_product_attention(ref[0], rk, rv, attn_mask=mask,
                                          is_causal=mask is None)
    full.backward(dout)
    want = [x.detach().numpy() for x in (full, *[r.grad for r in ref])]
    subgroups = {}
    for kk in G.hybrid_candidates(world, 2):     # 2 a node; every rank makes every group
        pair = []
        for family in (G.context_inner_groups, G.context_outer_groups):
            for ranks in family(1, 1, 1, c=world, k=kk):
                grp = dist.new_group(ranks)
                pair += [grp] if rank in ranks else []
        subgroups[kk] = tuple(pair)
    cp = ContextShard(group=dist.group.WORLD, c=world, cp_rank=rank, seq_len=T,
                      subgroups=subgroups, node_ranks=2)
    out_all = []
    for method in case.get("methods", ("all-to-all",)):
        attend = {"hybrid": context_hybrid_attention,
                  "hybrid-ring": context_hybrid_ring_attention}.get(method,
                                                                    context_alltoall_attention)
        mine = [context_cut(x, cp, 2).detach().clone().requires_grad_() for x in (q, k, v)]
        lq, lk, lv = mine
        if case["repeat"]:      # repeat_kv in the graph: every g-th head is exchanged
            lk, lv = (x.repeat_interleave(g, 1) for x in (lk, lv))
        out = attend(lq, lk, lv, cp, attn_mask=mask, is_causal=mask is None,
                     enable_gqa=not case["repeat"] and Hk < Hq,
                     kv_group=g if case["repeat"] else 1)
        assert out.transpose(1, 2).is_contiguous()      # the fused kernels' memory layout
        out.backward(context_cut(dout, cp, 2))
        whole = [context_gather(x.detach(), cp, 2) for x in (out, *[m.grad for m in mine])]
        out_all.append(([w.numpy() for w in whole], want))
    return out_all


@pytest.mark.parametrize("world, case", [
    (2, {"kv_heads": 2, "mask": False, "repeat": True}),     # GQA via repeat_kv, causal
    (2, {"kv_heads": 4, "mask": True, "repeat": False}),     # MHA, per-head mask
    # c = 4 > kv heads: repeated; the hybrid (2 inner × 2 outer) in the same ranks
    # and the hybrid with the ring across (hybrid-ring: the ring over the 2 outer ranks)
    (4, {"kv_heads": 2, "mask": False, "repeat": False,
         "methods": ("all-to-all", "hybrid", "hybrid-ring")}),
    (4, {"kv_heads": 4, "mask": True, "repeat": True, "methods": ("hybrid", "hybrid-ring")}),
])
def test_alltoall_equals_single_device_sdpa_forward_and_backward(world, case):
    """All-to-all and the hybrid (tests/unit/test_ulysses.py: its inner degree) equal SDPA."""
    from autopar.testing import spawn
    for per_method in spawn(_a2a_rank, world, case, timeout_s=120):
        for got, want in per_method:
            for a, b in zip(got, want):
                torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b),
                                           rtol=1e-10, atol=1e-10)
