"""GradSync on gloo ranks: averaged gradients equal the full-batch gradient, one all-reduce per
bucket per step (not per micro-batch), launched during the last backward; per-chunk reduction."""
import pytest
import torch
import torch.distributed as dist

from autopar.runtime.data_parallel import GradSync
from autopar.testing import spawn

from reference import train

pytestmark = pytest.mark.distributed


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(step, n=24):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def _reference_grads(step):
    """Single process: gradient of the mean loss over the whole global batch."""
    model = _model()
    x, y = _data(step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _count_all_reduce(counter):
    real = dist.all_reduce

    def counting(*args, **kwargs):
        counter.append(kwargs.get("async_op", False))
        return real(*args, **kwargs)
    dist.all_reduce = counting


def _dp_worker(rank, d, m, bucket_bytes):
    calls: list[bool] = []
    _count_all_reduce(calls)
    model = _model()
    params = list(model.parameters())
    sync = GradSync(params, dist.group.WORLD, bucket_bytes=bucket_bytes)
    out = {"buckets": len(sync.buckets), "steps": []}
    for step in range(2):
        x, y = _data(step)
        share = x.shape[0] // d
        xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        for p in params:
            p.grad = None
        before = len(calls)
        mb = share // m
        for i in range(m):
            if i == m - 1:
                sync.begin_final_microbatch()
            loss = torch.nn.functional.mse_loss(model(xs[i * mb:(i + 1) * mb]),
                                                ys[i * mb:(i + 1) * mb]) / m
            loss.backward()
        launched_in_backward = len(calls) - before
        sync.finish()
        ref = _reference_grads(step)
        out["steps"].append({
            "calls": len(calls) - before, "in_backward": launched_in_backward,
            "all_async": all(calls[before:]),
            "close": all(torch.allclose(p.grad, r, rtol=1e-5, atol=1e-7)
                         for p, r in zip(params, ref))})
    return out


@pytest.mark.parametrize("d,m,bucket_bytes", [(2, 3, 600), (4, 2, 10**6)])
def test_grads_equal_full_batch_one_allreduce_per_bucket(d, m, bucket_bytes):
    results = spawn(_dp_worker, d, m, bucket_bytes, timeout_s=120)
    for r in results:
        assert r["buckets"] == (1 if bucket_bytes == 10**6 else r["buckets"])
        for s in r["steps"]:
            assert s["close"]
            assert s["calls"] == r["buckets"]            # per step, not per micro-batch
            assert s["in_backward"] == r["buckets"]      # all launched during the backward
            assert s["all_async"]
    assert results[0]["buckets"] > 1 or bucket_bytes == 10**6


def _chunk_worker(rank, d):
    """Breadth-first style: two chunks, each reduced as soon as its last backward is done."""
    calls: list[bool] = []
    _count_all_reduce(calls)
    model = _model()
    params = list(model.parameters())
    first, second = params[:2], params[2:]
    sync = GradSync(params, dist.group.WORLD, bucket_bytes=200, chunks=[first, second])
    aligned = all(len({id(p) in {id(q) for q in first} for p in b.params}) == 1
                  for b in sync.buckets)
    x, y = _data(0)
    share = x.shape[0] // d
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    torch.nn.functional.mse_loss(model(xs), ys).backward()
    sync.reduce_now(second)
    after_second = len(calls)
    sync.reduce_now(first)
    after_first = len(calls)
    sync.finish()
    ref = _reference_grads(0)
    ok = all(torch.allclose(p.grad, r, rtol=1e-5, atol=1e-7) for p, r in zip(params, ref))
    bad = None
    try:  # a bucket mixing final and non-final gradients is refused
        mixed = GradSync(params, dist.group.WORLD, bucket_bytes=10**6)
        mixed.reduce_now(second)
    except ValueError as exc:
        bad = str(exc)
    return aligned, after_second, after_first, len(sync.buckets), ok, bad


def test_reduce_now_per_chunk():
    for aligned, after_second, after_first, nb, ok, bad in spawn(_chunk_worker, 2,
                                                                   timeout_s=120):
        assert aligned and ok
        assert 0 < after_second < after_first == nb
        assert bad is not None and "chunks=" in bad


def test_group_of_one_is_identity():
    model = _model()
    x, y = _data(0)
    sync = GradSync(list(model.parameters()), None)
    sync.begin_final_microbatch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    sync.finish()
    assert sync.buckets == [] and sync.num_collectives == 0
    for p, r in zip(model.parameters(), _reference_grads(0)):
        assert torch.equal(p.grad, r)


# ---- bf16 mixed precision (precision.py), alone and under GradSync ----------------------

def _bf16_reference(d, m, steps=3):
    """Plain single-device bf16 training: bf16 forward/backward per micro-batch, fp32 sum of the
    gradients, AdamW on fp32 masters, masters cast back to bf16 — written out by hand."""
    import torch.nn.functional as F
    master = [p.detach().float().clone().requires_grad_() for p in _model().parameters()]
    opt = torch.optim.AdamW(master, lr=1e-2)
    for step in range(steps):
        x, y = _data(step)
        share = x.shape[0] // d
        w16 = [w.detach().bfloat16().requires_grad_() for w in master]
        replica_sums = []
        for r in range(d):
            acc = [torch.zeros_like(w) for w in master]
            xs, ys = x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]
            mb = share // m
            for i in range(m):
                xb, yb = xs[i * mb:(i + 1) * mb].bfloat16(), ys[i * mb:(i + 1) * mb].bfloat16()
                h = torch.tanh(F.linear(xb, w16[0], w16[1]))
                h = torch.tanh(F.linear(h, w16[2], w16[3]))
                loss = F.mse_loss(F.linear(h, w16[4], w16[5]), yb) / m
                for a, g in zip(acc, torch.autograd.grad(loss, w16)):
                    a.add_(g.float())
            replica_sums.append(acc)
        for w, *parts in zip(master, *replica_sums):
            total = parts[0].clone()
            for q in parts[1:]:
                total.add_(q)
            w.grad = total.div_(d) if d > 1 else total
        opt.step()
    return [w.detach().bfloat16() for w in master], [w.detach() for w in master]


def _bf16_train(rank, d, m, group, steps=3):
    from autopar.runtime.precision import MixedPrecision
    model = _model()
    params = list(model.parameters())
    mp = MixedPrecision(params)
    sync = GradSync(params, group) if d > 1 else None
    opt = torch.optim.AdamW(mp.master_params, lr=1e-2)
    for step in range(steps):
        x, y = _data(step)
        share = x.shape[0] // d
        xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        mb = share // m
        for i in range(m):
            if sync is not None and i == m - 1:
                sync.begin_final_microbatch()
            out = model(xs[i * mb:(i + 1) * mb].bfloat16())
            (torch.nn.functional.mse_loss(out, ys[i * mb:(i + 1) * mb].bfloat16()) / m).backward()
        if sync is not None:
            sync.finish()
        mp.step(opt)
    return ([p.detach().clone() for p in params], [w.detach().clone() for w in mp.master_params],
            sync.buckets[0].flat.dtype if sync else None)


def test_bf16_single_device_matches_plain_reference():
    params, masters, _ = _bf16_train(0, 1, 2, None)
    ref16, ref32 = _bf16_reference(1, 2)
    assert all(p.dtype == torch.bfloat16 for p in params)
    # tolerance: exact — the same bf16 kernels and fp32 sums in the same order
    assert all(torch.equal(p, r) for p, r in zip(params, ref16))
    assert all(torch.equal(w, r) for w, r in zip(masters, ref32))
    # and bf16 training stays near fp32 training (3 steps at lr 1e-2: within 2e-2)
    fp32 = train(_model(), [_data(step) for step in range(3)],
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                 loss_fn=torch.nn.functional.mse_loss).model
    assert all(torch.allclose(w, r.detach(), atol=2e-2) for w, r in zip(masters, fp32.parameters()))


def _bf16_dp_worker(rank, d):
    return _bf16_train(rank, d, 2, dist.group.WORLD)


def test_bf16_data_parallel_reduces_fp32_main_grads():
    ref16, ref32 = _bf16_reference(2, 2)
    for params, masters, dtype in spawn(_bf16_dp_worker, 2, timeout_s=120):
        assert dtype == torch.float32          # buckets hold fp32 main_grad, not bf16 grads
        # tolerance: fp32 masters rtol 1e-5 (a 2-rank sum is exact; margin for reduce order)
        assert all(torch.allclose(w, r, rtol=1e-5, atol=1e-7) for w, r in zip(masters, ref32))
        assert all(torch.equal(p, w.bfloat16()) for p, w in zip(params, masters))
