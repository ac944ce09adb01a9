"""Megatron mappings on gloo ranks: definitions, round trips, and a t=2 MLP vs one process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime import collectives as C
from autopar.testing import refuse_reduce_scatter

pytestmark = pytest.mark.distributed


def _rand(seed, *shape):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


# ---- workers -----------------------------------------------------------------------------

def _mlp_worker(rank, world_size):
    """Column-parallel -> row-parallel MLP with f/g against the single-process MLP (t = world)."""
    group, t = dist.group.WORLD, world_size
    torch.manual_seed(0)
    B, T, H, Fh = 2, 3, 8, 16
    x = torch.randn(B, T, H)
    A, a = torch.randn(Fh, H), torch.randn(Fh)        # first linear: (F, H)
    W, b = torch.randn(H, Fh), torch.randn(H)         # second linear: (H, F)
    w_loss = torch.randn(B, T, H)

    # single-process reference
    ref = [v.clone().requires_grad_() for v in (x, A, a, W, b)]
    y_ref = F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2])), ref[3], ref[4])
    (y_ref * w_loss).sum().backward()

    # tensor parallel: rank r holds rows r of A/a (column-parallel), columns r of W (row-parallel)
    rows = slice(rank * Fh // t, (rank + 1) * Fh // t)
    xs = x.clone().requires_grad_()
    A_r = A[rows].clone().requires_grad_()
    a_r = a[rows].clone().requires_grad_()
    W_r = W[:, rows].clone().requires_grad_()
    b_p = b.clone().requires_grad_()
    h = F.gelu(F.linear(C.f(xs, group), A_r, a_r))       # (B, T, F/t)
    y = C.g(F.linear(h, W_r), group) + b_p                # (B, T, H); bias once, after the sum
    (y * w_loss).sum().backward()

    close = lambda u, v: torch.allclose(u, v, rtol=1e-5, atol=1e-6)  # noqa: E731
    return {
        "y": close(y, y_ref), "x.grad": close(xs.grad, ref[0].grad),
        "A.grad": close(A_r.grad, ref[1].grad[rows]), "a.grad": close(a_r.grad, ref[2].grad[rows]),
        "W.grad": close(W_r.grad, ref[3].grad[:, rows]), "b.grad": close(b_p.grad, ref[4].grad),
    }



def _definitions_worker(rank, n, force_fallback):
    """Each Function's forward and backward against its definition over all n ranks."""
    group = dist.group.WORLD
    refused = refuse_reduce_scatter() if force_fallback else None
    shape = (n, 2 * n, 3)
    xs = [_rand(100 + q, *shape) for q in range(n)]     # rank q's input
    gs = [_rand(200 + q, *shape) for q in range(n)]     # rank q's grad of the output (full size)
    fails = []

    def check(name, fn, dim, want_out, want_grad, grad_shape=None):
        x = xs[rank].clone().requires_grad_()
        out = fn(x, group, dim) if dim is not None else fn(x, group)
        go = gs[rank] if grad_shape is None else gs[rank][tuple(slice(0, s) for s in grad_shape)]
        out.backward(go)
        if not torch.allclose(out, want_out(go)):
            fails.append(f"{name} dim={dim} forward")
        if not torch.allclose(x.grad, want_grad(go)):
            fails.append(f"{name} dim={dim} backward")

    total_x = sum(xs)
    check("copy_to_tp", C.copy_to_tp, None, lambda go: xs[rank], lambda go: sum(gs))
    check("reduce_from_tp", C.reduce_from_tp, None, lambda go: total_x, lambda go: go)
    for dim in (0, 1, -1):
        d = dim % 3
        if shape[d] % n:
            continue
        chunk = lambda v, r=rank: v.chunk(n, dim=d)[r]  # noqa: E731
        sub = list(shape)
        sub[d] //= n
        gsub = [g[tuple(slice(0, s) for s in sub)] for g in gs]
        big = list(shape)
        big[d] *= n
        gbig = [_rand(300 + q, *big) for q in range(n)]
        check("scatter_to_sp", C.scatter_to_sp, dim, lambda go: chunk(xs[rank]),
              lambda go: torch.cat(gsub, dim=d), grad_shape=sub)
        check("reduce_scatter_to_sp", C.reduce_scatter_to_sp, dim, lambda go: chunk(total_x),
              lambda go: torch.cat(gsub, dim=d), grad_shape=sub)
        # gather-type outputs are n times bigger along d: feed each rank's big gradient
        for name, fn, want_grad in (
                ("gather_from_sp", C.gather_from_sp, lambda go: chunk(gbig[rank])),
                ("all_gather_sp", C.all_gather_sp, lambda go: chunk(sum(gbig)))):
            x = xs[rank].clone().requires_grad_()
            out = fn(x, group, dim)
            out.backward(gbig[rank])
            if not torch.allclose(out, torch.cat(xs, dim=d)):
                fails.append(f"{name} dim={dim} forward")
            if not torch.allclose(x.grad, want_grad(None)):
                fails.append(f"{name} dim={dim} backward")
    if refused is not None and not refused:
        fails.append("the reduce-scatter fallback never ran")
    return fails


def _safety_worker(rank, world_size):
    """Inputs and shared gradients are never overwritten; groups of one are identities."""
    group = dist.group.WORLD
    out = {}
    x = torch.full((3,), float(rank + 1))
    keep = x.clone()
    C.reduce_from_tp(x, group)
    out["forward input untouched"] = torch.equal(x, keep)
    # y = f(x) + z: AddBackward hands the same grad tensor to both; z's grad must stay local
    xa = torch.ones(3, requires_grad=True)
    z = torch.ones(3, requires_grad=True)
    (C.f(xa, group) + z).backward(torch.full((3,), float(rank + 1)))
    out["shared grad untouched"] = torch.equal(z.grad, torch.full((3,), float(rank + 1)))
    out["f grad summed"] = torch.equal(xa.grad, torch.full((3,), 3.0))
    # round trips
    v = _rand(7, 2, 4, 3).requires_grad_()
    back = C.gather_from_sp(C.scatter_to_sp(v, group, 1), group, 1)
    back.backward(torch.ones_like(back))
    out["scatter/gather round trip"] = torch.equal(back, v) and torch.equal(v.grad,
                                                                            torch.ones_like(v))
    u = _rand(8, 4, 2)
    out["all_gather/reduce_scatter"] = torch.allclose(
        C.reduce_scatter_to_sp(C.all_gather_sp(u, group, 0), group, 0), 2 * u)
    # groups of one: every rank must create both singleton groups, in the same order
    singles = [dist.new_group([r]) for r in range(world_size)]
    mine = singles[rank]
    w = torch.ones(2)
    out["singleton identity"] = all(fn(w, mine) is w for fn in (C.f, C.g)) and all(
        fn(w, mine, 0) is w for fn in (C.scatter_to_sp, C.gather_from_sp,
                                       C.reduce_scatter_to_sp, C.all_gather_sp))
    try:
        C.scatter_to_sp(torch.ones(2, 3), group, 1)
        out["indivisible error"] = False
    except ValueError as e:
        out["indivisible error"] = "size 3" in str(e) and "group size 2" in str(e)
    return out


def _column_parallel_worker(rank, world_size):
    """column_parallel == f (or all_gather_sp) + separate projections, gradients included:
    "linear" and "mm" layouts, a bias, a frozen weight, an output that gets no gradient."""
    group, bad = dist.group.WORLD, []
    for sp_dim in (None, 1):
        x = _rand(10 + rank if sp_dim is not None else 10, 2, 4, 6)      # (B, T or T/t, C)
        w1, b1, w2, w3 = _rand(11, 5, 6), _rand(12, 5), _rand(13, 6, 3), _rand(14, 7, 6)
        w_loss = _rand(15 + rank, 2, 4 * (world_size if sp_dim else 1), 5)
        outs = {}
        for fused in (False, True):
            xs, a1, c1, a2 = (v.clone().requires_grad_() for v in (x, w1, b1, w2))
            a3 = w3.clone()                                               # frozen
            if fused:
                y1, y2, y3 = C.column_parallel(xs, group, ("linear", "mm", "linear"),
                                               (a1, a2, a3), (c1, None, None), sp_dim)
            else:
                full = C.copy_to_tp(xs, group) if sp_dim is None else C.all_gather_sp(
                    xs, group, sp_dim)
                y1, y2, y3 = F.linear(full, a1, c1), full @ a2, F.linear(full, a3)
            if fused and sp_dim is not None:   # SP saves the shard, gathers it in backward
                assert y1.grad_fn.saved_tensors[0].shape == x.shape
            (y1 * w_loss).sum().add_(y2.sum()).backward()                 # y3: no gradient
            outs[fused] = [y1, y2, y3, xs.grad, a1.grad, c1.grad, a2.grad]
        for i, (u, v) in enumerate(zip(outs[False], outs[True])):
            if not torch.allclose(u, v, rtol=1e-10, atol=1e-12):
                bad.append(f"sp_dim={sp_dim} item {i}")
    return bad


def _vocab_ce_worker(rank, world_size, vocab, slice_cols):
    """vocab_parallel_cross_entropy on this rank's columns [r·n, (r+1)·n) of logits padded to
    n·t columns, against F.cross_entropy on the unpadded logits; loss and logit gradient."""
    from autopar.runtime.shard import vocab_parallel_cross_entropy
    group, n = dist.group.WORLD, slice_cols
    logits = _rand(0, 6, vocab) * 8            # large logits: the max shift matters
    target = torch.tensor([0, vocab - 1, 3, -100, vocab // 2, 1])   # one ignored row
    weights = _rand(1, 6)
    bad = []
    for code, reduction in ((0, "none"), (1, "mean"), (2, "sum")):
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full, target, reduction=reduction)
        (ref * weights).sum().backward() if code == 0 else ref.backward()
        padded = torch.cat([logits, logits.new_zeros(6, n * world_size - vocab)], dim=1)
        mine = padded[:, rank * n:(rank + 1) * n].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(mine, target, group, vocab, reduction=code)
        (got * weights).sum().backward() if code == 0 else got.backward()
        if not torch.allclose(got, ref.detach(), rtol=1e-5, atol=1e-6):   # computed in fp32
            bad.append(f"{reduction}: loss {got} vs {ref}")
        cols = slice(rank * n, min((rank + 1) * n, vocab))
        want = full.grad[:, cols]
        if not torch.allclose(mine.grad[:, :want.shape[1]], want, rtol=1e-5, atol=1e-7):
            bad.append(f"{reduction}: gradient of columns {cols}")
        if mine.grad[:, want.shape[1]:].count_nonzero() != 0:
            bad.append(f"{reduction}: padding columns got a gradient")
    return bad


def _per_row_blocks_worker(rank, n):
    """Sequence parallelism on (B·T, C) rows, Shard(0, (T,)·B): shuffle_blocks + the
    reduce-scatter hand each rank local_blocks of the sum (its T/n tokens of every row), the
    gradient all-gathered back in global order; all_gather_sp + unshuffle_blocks invert it."""
    from autopar.runtime import shard
    group, (B, T, Cd) = dist.group.WORLD, (2, 3 * n, 4)
    blocks = [T] * B
    xs = [_rand(300 + q, B * T, Cd) for q in range(n)]   # rank q's summand, (B·T, C)
    x = xs[rank].clone().requires_grad_()
    y = C.reduce_scatter_to_sp(shard.shuffle_blocks(x, group, 0, blocks), group, 0)  # (B·T/n, C)
    want = torch.cat([sum(xs).narrow(0, b * T + rank * (T // n), T // n) for b in range(B)])
    gys = [_rand(400 + q, B * T // n, Cd) for q in range(n)]   # rank q's upstream gradient
    y.backward(gys[rank])
    grad = torch.cat([gys[q].narrow(0, b * (T // n), T // n) for b in range(B)
                      for q in range(n)])                      # (B·T, C), global order
    back = shard.unshuffle_blocks(C.gather_from_sp(y.detach(), group, 0), group, 0, blocks)
    return [name for name, ok in (("forward", torch.allclose(y, want)),
                                  ("backward", torch.allclose(x.grad, grad)),
                                  ("unshuffle", torch.allclose(back, sum(xs))))
            if not ok]


# ---- tests --------------------------------------------------------------------------------

def test_identity_without_any_group():
    x = torch.ones(2)
    assert all(fn(x, None) is x for fn in (C.f, C.g, C.copy_to_tp, C.reduce_from_tp))
    assert all(fn(x, None, 0) is x for fn in (C.scatter_to_sp, C.gather_from_sp,
                                               C.reduce_scatter_to_sp, C.all_gather_sp))


def test_tensor_parallel_mlp_matches_single_process():
    from autopar.testing import spawn
    for rank_result in spawn(_mlp_worker, 2, timeout_s=120):
        assert rank_result == {k: True for k in rank_result}, rank_result


@pytest.mark.parametrize("n,force_fallback", [(2, False), (3, False), (2, True)])
def test_functions_match_definitions(n, force_fallback):
    from autopar.testing import spawn
    assert spawn(_definitions_worker, n, force_fallback, timeout_s=120) == [[]] * n


def test_column_parallel_matches_f_and_separate_projections():
    from autopar.testing import spawn
    assert spawn(_column_parallel_worker, 2, timeout_s=120) == [[], []]


def test_safety_round_trips_and_singletons():
    from autopar.testing import spawn
    for rank_result in spawn(_safety_worker, 2, timeout_s=120):
        assert rank_result == {k: True for k in rank_result}, rank_result


@pytest.mark.parametrize("world,vocab,slice_cols", [
    (2, 10, 5),     # even split
    (3, 11, 6),     # the last slice part padding
    (3, 7, 6),      # the last slice all padding (its row max is -inf)
])
def test_vocab_parallel_cross_entropy_matches_cross_entropy(world, vocab, slice_cols):
    from autopar.testing import spawn
    assert spawn(_vocab_ce_worker, world, vocab, slice_cols, timeout_s=120) == [[]] * world


@pytest.mark.parametrize("n", [2, 3])
def test_per_row_blocks_reduce_scatter_matches_local_blocks_of_the_sum(n):
    from autopar.testing import spawn
    assert spawn(_per_row_blocks_worker, n, timeout_s=120) == [[]] * n
