"""Global-norm clipping on gloo ranks equals torch.nn.utils.clip_grad_norm_ on the full model:
t=2 hand-split layers with replicated norm weights and vocabulary padding, p=2 x d=2 with a tied
embedding on the first and last stage, and ZeRO-style dp-sharded flat gradients."""
import pytest
import torch

from autopar.runtime.clip import clip_grad_norm_
from autopar.runtime.dist import ProcessGroups
from autopar.runtime.params import ParamInfo
from autopar.testing import spawn

pytestmark = pytest.mark.distributed

SHAPES = {"emb": (10, 4), "fc1.weight": (8, 4), "fc1.bias": (8,), "norm.weight": (8,),
          "fc2.weight": (4, 8), "fc2.bias": (4,)}
SPLIT = {"emb": 0, "fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}   # column / row / vocab


def _full_grads(scale):
    gen = torch.Generator().manual_seed(7)
    return {k: scale * torch.randn(*s, generator=gen) for k, s in SHAPES.items()}


def _reference(scale, max_norm):
    grads = _full_grads(scale)
    params = [torch.zeros(s, requires_grad=True) for s in SHAPES.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm, {k: p.grad for k, p in zip(SHAPES, params)}


def _local(key, full, t, tp, pad_rows=0, shared=None):
    """This tensor rank's slice of `full` (plus `pad_rows` garbage rows of vocab padding)."""
    dim = SPLIT.get(key) if t > 1 else None
    if dim is None:
        info = ParamInfo(key=key, global_shape=tuple(full.shape), shared_with=shared)
        return full.clone(), info
    n = full.shape[dim]
    per = -(-n // t)
    start, stop = min(n, tp * per), min(n, (tp + 1) * per)
    part = full.narrow(dim, start, stop - start).clone()
    if pad_rows or stop - start < per:   # vocab padding: garbage that must not be counted
        extra = per - (stop - start) + pad_rows
        shape = list(part.shape)
        shape[dim] = extra
        part = torch.cat([part, torch.full(shape, 1e3)], dim)
    info = ParamInfo(key=key, global_shape=tuple(full.shape), split_dim=dim, start=start,
                     stop=stop, replicated_over_tp=False, shared_with=shared)
    return part, info


def _check(params, infos, groups, scale, max_norm, ref_norm, ref_grads, dp_sharded=False,
           full_slices=None):
    norm = clip_grad_norm_(params, infos, max_norm, groups, dp_sharded=dp_sharded,
                           real_parts=not dp_sharded)
    ok = torch.allclose(norm, ref_norm, rtol=1e-5)
    for p, info in zip(params, infos):
        want = ref_grads[info.key][info.global_index()] if full_slices is None \
            else full_slices[id(p)]
        got = info.real_part(p.grad) if not dp_sharded else p.grad
        ok = ok and torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    return float(norm), float(ref_norm), ok


def _tp_worker(rank, world, scale, max_norm):
    groups = ProcessGroups.create(world, 1, 1, timeout_s=30)
    ref_norm, ref_grads = _reference(scale, max_norm)
    params, infos = [], []
    for key, g in _full_grads(scale).items():
        local, info = _local(key, g, world, groups.tp_rank, pad_rows=1 if key == "emb" else 0)
        p = torch.zeros_like(local, requires_grad=True)
        p.grad = local
        params.append(p)
        infos.append(info)
    return _check(params, infos, groups, scale, max_norm, ref_norm, ref_grads)


@pytest.mark.parametrize("scale,max_norm", [(1.0, 0.5), (0.01, 100.0)])  # clipping on / off
def test_tensor_parallel_norm_equals_single_device(scale, max_norm):
    for norm, ref, ok in spawn(_tp_worker, 2, scale, max_norm, timeout_s=120):
        assert ok, (norm, ref)
        assert (norm > max_norm) == (scale == 1.0)


def _pp_dp_worker(rank, world, scale, max_norm):
    """p=2, d=2: stage 0 holds emb + fc1 + norm, stage 1 holds fc2 and the tied emb copy."""
    groups = ProcessGroups.create(1, 2, 2, timeout_s=30)
    ref_norm, ref_grads = _reference(scale, max_norm)
    full = _full_grads(scale)
    # tied: emb.grad is the sum of both uses; both stages hold that same summed gradient
    keys = ["emb", "fc1.weight", "fc1.bias", "norm.weight"] if groups.pp_rank == 0 \
        else ["fc2.weight", "fc2.bias", "emb"]
    params, infos = [], []
    for key in keys:
        p = torch.zeros(SHAPES[key], requires_grad=True)
        p.grad = full[key].clone()
        params.append(p)
        infos.append(ParamInfo(key=key, global_shape=SHAPES[key],
                               shared_with="embedding" if key == "emb" else None))
    return _check(params, infos, groups, scale, max_norm, ref_norm, ref_grads)


def test_pipeline_data_parallel_tied_embedding_counted_once():
    for norm, ref, ok in spawn(_pp_dp_worker, 4, 1.0, 0.5, timeout_s=120):
        assert ok, (norm, ref)


def _zero_worker(rank, world, scale, max_norm):
    """d=2 ZeRO-style: each dp rank holds a contiguous half of the flattened gradients."""
    groups = ProcessGroups.create(1, 1, world, timeout_s=30)
    ref_norm, ref_grads = _reference(scale, max_norm)
    params, infos, want = [], [], {}
    for key, g in _full_grads(scale).items():
        flat, ref_flat = g.reshape(-1), ref_grads[key].reshape(-1)
        half = -(-flat.numel() // world)
        lo, hi = rank * half, min(flat.numel(), (rank + 1) * half)
        if lo >= hi:
            continue
        p = torch.zeros(hi - lo, requires_grad=True)
        p.grad = flat[lo:hi].clone()
        params.append(p)
        infos.append(ParamInfo(key=key, global_shape=SHAPES[key]))
        want[id(p)] = ref_flat[lo:hi]
    return _check(params, infos, groups, scale, max_norm, ref_norm, ref_grads,
                  dp_sharded=True, full_slices=want)


def test_dp_sharded_norm_sums_over_data_group():
    for norm, ref, ok in spawn(_zero_worker, 2, 1.0, 0.5, timeout_s=120):
        assert ok, (norm, ref)


def test_single_process_matches_torch():
    ref_norm, ref_grads = _reference(1.0, 0.5)
    params, infos = [], []
    for key, g in _full_grads(1.0).items():
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g.clone()
        params.append(p)
        infos.append(ParamInfo(key=key, global_shape=tuple(g.shape)))
    norm, _, ok = _check(params, infos, None, 1.0, 0.5, ref_norm, ref_grads)
    assert ok
    with pytest.raises(ValueError, match="ParamInfo"):
        clip_grad_norm_(params, infos[:-1], 1.0, None)


def _mixed_worker(rank, world, flat_pieces):
    """A partly split parameter (q rows split, the k/v rows whole on every tensor rank, as
    multi-query c_attn): its whole rows count once; also as ZeRO's flat pieces (spans)."""
    from autopar.runtime.params import describe_param
    from autopar.runtime.shard import ParamSplit, local_shard
    groups = ProcessGroups.create(world, 1, 1, timeout_s=30)
    full = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    ref = torch.zeros(8, 3, requires_grad=True)
    ref.grad = full.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_([ref], 0.5)
    split = ParamSplit(0, (4, 2, 2), whole=(False, True, True))
    local = local_shard(full, split, groups.tp_rank, world)                 # (6, 3)
    info = describe_param(key="qkv", aliases=(), local_shape=tuple(local.shape),
                          global_shape=(8, 3), split=(split, 8), tp_rank=groups.tp_rank,
                          t=world, shared=False)
    flat = local.reshape(-1)
    cuts = [(0, 5), (5, flat.numel())] if flat_pieces else None   # cut inside the q rows
    grads = [flat[a:b] for a, b in cuts] if flat_pieces else [local]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = clip_grad_norm_(params, [info] * len(params), 0.5, groups,
                           real_parts=not flat_pieces, spans=cuts)
    return float(norm), float(ref_norm), info.tp_whole


@pytest.mark.parametrize("flat_pieces", [False, True])
def test_partly_split_parameter_counts_its_whole_rows_once(flat_pieces):
    for norm, ref, whole in spawn(_mixed_worker, 2, flat_pieces, timeout_s=120):
        assert whole == ((6, 12), (12, 18))   # k, v: local rows 2..4, 4..6 of 3 columns
        assert norm == pytest.approx(ref, rel=1e-6)


def test_shared_block_counted_on_its_first_holding_stage():
    """A block some stages only call ("stages:1,2"): stage 1's copy counts, not stage 0 (which
    holds none) nor stage 2; a tied embedding's ("embedding") counts on stage 0."""
    from types import SimpleNamespace
    from autopar.runtime.clip import counts_here
    block = ParamInfo(key="w", global_shape=(2,), shared_with="stages:1,2")
    tied = ParamInfo(key="e", global_shape=(2,), shared_with="embedding")
    at = [SimpleNamespace(tp_rank=0, pp_rank=s) for s in range(4)]
    assert [counts_here(block, g) for g in at] == [False, True, False, False]
    assert [counts_here(tied, g) for g in at] == [True, False, False, False]
