"""Sharded weights (ZeRO-3 / FSDP): gloo numerics (d=2, d=4) of a 4-chunk stack driven by the
gather/release/reduce-scatter plan of autopar.weight_gathers (tested pure in
tests/unit/test_zero3_plan.py) against one process running AdamW on the full batch, with the
collectives counted and the resident bytes measured; one rank against plain AdamW and its
clear errors."""
import pytest
import torch
import torch.distributed as dist

from autopar.runtime.zero3_chunks import Zero3Chunks
from autopar.schedules import breadth_first, interleaved_1f1b
from autopar.testing import spawn
from autopar.weight_gathers import gather_stats, plan_gathers

from reference import train


# ---- numerics ----------------------------------------------------------------------------
SIZES = [(5, 7), (7, 6), (6, 9), (9, 3)]      # odd sizes: shards cut parameters, padding
GLOBAL_BATCH = 12


def _chunks():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.GELU()) for a, b in SIZES]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _data(step):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(GLOBAL_BATCH, SIZES[0][0], generator=gen),
            torch.randn(GLOBAL_BATCH, SIZES[-1][1], generator=gen))


def _reference(steps):
    ref = train(torch.nn.Sequential(*_chunks()), [_data(step) for step in range(steps)], _adamw,
                loss_fn=torch.nn.functional.mse_loss)
    return [p.detach().clone() for p in ref.model.parameters()]


def _train_step(chunks, z, acts, plan, xs, ys, live_trace, step=True):
    """Run one rank's list (p=1: every chunk local) with the plan's ops merged in, async;
    then step the shards (or, step=False, only land the reduce-scatters)."""
    at: dict[int, list] = {}
    for i, op, c in plan:
        at.setdefault(i, []).append((op, c))
    m, C = len(xs), len(chunks)
    inp, out = {}, {}
    for n in range(len(acts) + 1):
        for op, c in at.get(n, []):
            z.run(op, c)
            live_trace.append(sum(ch[0].weight.untyped_storage().nbytes() > 0 for ch in chunks))
        if n == len(acts) or acts[n].kind not in ("F", "B"):
            continue
        a = acts[n]
        c, i = a.chunk, a.mb
        z.wait(c)
        if a.kind == "F":
            x = xs[i] if c == 0 else out[(c - 1, i)].detach().requires_grad_()
            inp[(c, i)], out[(c, i)] = x, chunks[c](x)
        elif c == C - 1:
            (torch.nn.functional.mse_loss(out.pop((c, i)), ys[i]) / m).backward()
        else:
            out.pop((c, i)).backward(inp.pop((c + 1, i)).grad)
    if not step:
        z.finish_reduces()
        return
    z.step()
    z.zero_grad()


def _counted(fn, counts, key):
    def wrapper(*a, **k):
        counts[key] += 1
        return fn(*a, **k)
    return wrapper


def _acts(schedule, C, m):
    return (breadth_first(1, C, m) if schedule == "breadth-first"
            else interleaved_1f1b(1, C, m))[0]


def _worker(rank, d, ms, steps, schedule="breadth-first"):
    counts = {"ag": 0, "rs": 0}
    for key, names in (("ag", ("all_gather_single", "all_gather_into_tensor")),
                       ("rs", ("reduce_scatter_single", "reduce_scatter_tensor"))):
        for name in names:
            if hasattr(dist, name):
                setattr(dist, name, _counted(getattr(dist, name), counts, key))
    results = {}
    for m in ms:
        chunks = _chunks()
        full_bytes = sum(p.numel() * p.element_size() for ch in chunks for p in ch.parameters())
        z = Zero3Chunks([list(ch.parameters()) for ch in chunks], dist.group.WORLD, _adamw)
        acts = _acts(schedule, len(chunks), m)
        plan = plan_gathers(acts)
        per_step, trace = [], []
        for step in range(steps):
            x, y = _data(step)
            share = GLOBAL_BATCH // d
            xs = x[rank * share:(rank + 1) * share].chunk(m)
            ys = y[rank * share:(rank + 1) * share].chunk(m)
            before = dict(counts)
            _train_step(chunks, z, acts, plan, xs, ys, trace)
            per_step.append((counts["ag"] - before["ag"], counts["rs"] - before["rs"]))
        resident = sum(p.untyped_storage().nbytes() for ch in chunks for p in ch.parameters())
        weights = [w for w in z.full_parameters().values()]
        results[m] = dict(per_step=per_step, max_live=max(trace), resident=resident,
                          shard=z.shard_bytes(), full=full_bytes, weights=weights,
                          state=sum(t.numel() * t.element_size() for st in z.optimizer.state.values()
                                    for t in st.values() if t.dim() > 0))
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("schedule,d,ms", [("breadth-first", 2, (3, 6)),
                                           ("breadth-first", 4, (3,)),
                                           ("interleaved-1f1b", 2, (3,))])
def test_zero3_numerics(schedule, d, ms):
    """The plan run for real: the weights equal one process's AdamW, the collectives are the
    plan's (breadth-first: 2C − 2 gathers, the two top chunks kept across the turn, and one
    reduce-scatter per chunk, whatever m is; interleaved: a chunk gathered and reduced once per
    visit, its reduce-scatters adding up in the shard)."""
    steps, C = 3, len(SIZES)
    ref = _reference(steps)
    out = spawn(_worker, d, ms, steps, schedule, timeout_s=180)
    for rank, res in enumerate(out):
        for m in ms:
            r = res[m]
            for got, want in zip(r["weights"], ref):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            st = gather_stats(_acts(schedule, C, m))
            assert r["per_step"] == [(st.gathers, st.reduce_scatters)] * steps, (rank, m)
            if schedule == "breadth-first":
                assert r["per_step"][0] == (2 * C - 2, C)
            else:
                assert st.reduce_scatters > C      # several visits: partial reductions add up
            assert r["max_live"] <= 2
            # between steps: no full weights, 1/d of them as the fp32 shard (+ padding)
            assert r["resident"] == 0
            assert r["shard"] <= r["full"] / d + 4 * C
            assert r["state"] == 2 * r["shard"]        # AdamW's m and v on the shard only
    for m in ms:   # the shards partition the model
        assert sum(res[m]["shard"] for res in out) == out[0][m]["full"]


def test_single_rank_matches_and_errors():
    """d=1 (group None): same numbers as plain AdamW, no collectives; misuse raises."""
    steps = 2
    ref = _reference(steps)
    chunks = _chunks()
    z = Zero3Chunks({c: list(ch.parameters()) for c, ch in enumerate(chunks)}, None, _adamw)
    acts = breadth_first(1, len(chunks), 3)[0]
    plan = plan_gathers(acts)
    for step in range(steps):
        x, y = _data(step)
        _train_step(chunks, z, acts, plan, x.chunk(3), y.chunk(3), [])
    got = [w for w in z.full_parameters().values()]
    for g, w in zip(got, ref):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert z.num_gathers == 0 and z.gathered_bytes() == 0
    z.gather(0)
    with pytest.raises(ValueError, match="already gathered"):
        z.gather(0)
    with pytest.raises(ValueError, match="still gathered"):
        z.step()
    z.release(0)
    with pytest.raises(ValueError, match="released"):
        z.wait(0)
    with pytest.raises(ValueError, match="not one of this rank's chunks"):
        z.gather(7)
    with pytest.raises(ValueError, match="exactly one chunk"):
        p = torch.nn.Parameter(torch.ones(3))
        Zero3Chunks([[p], [p]], None, _adamw)
    with pytest.raises(ValueError, match="no storage"):
        Zero3Chunks([[chunks[0][0].weight]], None, _adamw)   # z holds it, released


# ---- bf16 mixed precision ----------------------------------------------------------------
def _bf16_grads(chunks, xs, ys, m):
    """One process: each micro-batch's bf16 gradients (bf16 weights and data, loss / m) folded
    into fp32 one by one — what the single-device bf16 model accumulates in main_grad."""
    model = torch.nn.Sequential(*[ch for ch in chunks]).to(torch.bfloat16)
    acc = [torch.zeros(p.shape) for p in model.parameters()]
    for x, y in zip(xs, ys):
        model.zero_grad(set_to_none=True)
        (torch.nn.functional.mse_loss(model(x), y) / m).backward()
        for a, p in zip(acc, model.parameters()):
            a.add_(p.grad.float())
    return acc


def _bf16_worker(rank, d, m):
    seen = {"ag": [], "rs": []}
    def recorded(fn, key):
        def wrapper(out, inp, *a, **k):
            seen[key].append((out.dtype, inp.dtype, inp.numel() * inp.element_size()))
            return fn(out, inp, *a, **k)
        return wrapper
    for key, names in (("ag", ("all_gather_single", "all_gather_into_tensor")),
                       ("rs", ("reduce_scatter_single", "reduce_scatter_tensor"))):
        for name in names:
            if hasattr(dist, name):
                setattr(dist, name, recorded(getattr(dist, name), key))
    chunks = _chunks()
    init = [p.detach().clone() for ch in chunks for p in ch.parameters()]
    z = Zero3Chunks([list(ch.parameters()) for ch in chunks], dist.group.WORLD, _adamw,
                    param_dtype=torch.bfloat16)
    out = dict(param_dtypes={p.dtype for ch in chunks for p in ch.parameters()},
               master_dtypes={mp.dtype for ch in z.chunks.values() for mp in ch.master},
               shard=z.shard_bytes(),
               shard_numel=sum(mp.numel() for ch in z.chunks.values() for mp in ch.master),
               init_exact=all(torch.equal(a, b) for a, b in
                              zip(z.full_parameters().values(), init)))
    z.gather(0)
    out["gathered"] = (z.chunks[0].flat.dtype, z.gathered_bytes(),
                       z.chunks[0].layout.shard_numel * d)
    z.release(0)
    out["released"] = z.gathered_bytes()
    # one step's gradients: the plan's gathers / reduce-scatters, micro-batches in bf16
    x, y = _data(0)
    share = GLOBAL_BATCH // d
    xs = x.to(torch.bfloat16).chunk(d * m)
    ys = y.to(torch.bfloat16).chunk(d * m)
    acts = _acts("breadth-first", len(chunks), m)
    seen["ag"].clear()
    _train_step(chunks, z, acts, plan_gathers(acts), xs[rank * m:(rank + 1) * m],
                ys[rank * m:(rank + 1) * m], [], step=False)
    out["collectives"] = {k: sorted(set(v)) for k, v in seen.items()}
    want = [g / d for g in _bf16_grads(_chunks(), xs, ys, m)]   # every rank's micro-batches
    got, exp, k = [], [], 0
    for c in sorted(z.chunks):
        ch = z.chunks[c]
        n = len(ch.params)
        got += [mp.grad for mp in ch.master]
        exp += ch.layout.pieces(want[k:k + n])
        k += n
    out["grads"] = (got, exp)
    z.step()
    z.zero_grad()
    full = z.full_parameters()
    z.gather(1)
    out["after"] = (full, [p.detach().clone() for p in z.chunks[1].params],
                    z.chunks[1].names)
    z.release(1)
    return out


@pytest.mark.distributed
def test_bf16_gathers_bf16_and_reduces_fp32():
    """param_dtype=bf16 at d=2: the parameters compute in bf16, the shards stay the fp32
    masters (full_parameters returns the initial fp32 weights bit for bit); the all-gather
    moves the shard cast to bf16 (2 bytes per element) into a bf16 flat buffer, released to 0
    bytes; the reduce-scatter moves fp32, and the shard gradient equals the fp32 sum of every
    micro-batch's bf16 gradient over both ranks / d at fp32 precision — what the single-device
    bf16 model accumulates in main_grad (a bf16 accumulation or reduction would miss it by
    bf16 roundings, ~1e-3 relative); after the step the next gather is bf16(new master)."""
    d, m = 2, 3
    for res in spawn(_bf16_worker, d, m, timeout_s=120):
        assert res["param_dtypes"] == {torch.bfloat16}
        assert res["master_dtypes"] == {torch.float32}
        assert res["shard"] == 4 * res["shard_numel"]
        assert res["init_exact"]
        dtype, nbytes, numel = res["gathered"]
        assert dtype == torch.bfloat16 and nbytes == 2 * numel
        assert res["released"] == 0
        ags, rss = res["collectives"]["ag"], res["collectives"]["rs"]
        assert ags and all(o == i == torch.bfloat16 for o, i, _ in ags), ags
        assert rss and all(o == i == torch.float32 for o, i, _ in rss), rss
        got, want = res["grads"]
        for g, w in zip(got, want):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        full, gathered, names = res["after"]
        for p, name in zip(gathered, names):
            assert full[name].dtype == torch.float32
            assert torch.equal(p, full[name].to(torch.bfloat16))


def test_bf16_single_rank_frozen_weight_and_bad_dtype():
    """d=1 under bf16: a frozen weight shares the chunk's bf16 buffer and gets no gradient
    (the trainable one's is folded into fp32 and reaches its fp32 master); param_dtype must be
    floating."""
    lin = torch.nn.Linear(3, 2)
    lin.bias.requires_grad_(False)
    z = Zero3Chunks([[lin.weight, lin.bias]], None, _adamw, param_dtype=torch.bfloat16)
    z.gather(0)
    z.wait(0)
    lin(torch.ones(4, 3, dtype=torch.bfloat16)).sum().backward()
    assert lin.weight.grad is None and lin.weight.main_grad.dtype == torch.float32
    z.release(0)
    z.finish_reduces()
    weight, bias = z.chunks[0].master
    assert weight.grad.dtype == torch.float32 and bias.grad is None
    torch.testing.assert_close(weight.grad, torch.full((6,), 4.0))
    with pytest.raises(ValueError, match="param_dtype=torch.int32: must be a floating"):
        Zero3Chunks([[torch.nn.Parameter(torch.ones(2))]], None, _adamw, param_dtype=torch.int32)
