"""Checkpoints: save under one layout, load under another (t=2,p=2 -> t=1 and -> t=4; t=2 -> d=2),
Adam states follow their parameters, step restored, a rank killed mid-save leaves the previous
checkpoint loadable, mismatched models refused by key name, metadata never unpickles code."""
import os
import pickle

import pytest
import torch

from autopar.runtime import checkpoint as ckpt
from autopar.runtime.dist import ProcessGroups
from autopar.runtime.params import ParamInfo
from autopar.testing import spawn

pytestmark = pytest.mark.distributed

SHAPES = {"emb.weight": (10, 4), "fc1.weight": (8, 4), "fc2.weight": (4, 8), "fc2.bias": (4,)}
SPLIT = {"emb.weight": 0, "fc1.weight": 0, "fc2.weight": 1}
STAGE = {"emb.weight": 0, "fc1.weight": 0, "fc2.weight": 1, "fc2.bias": 1}  # emb tied on both


def _full(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: {"param": torch.randn(*s, generator=gen), "exp_avg": torch.randn(*s, generator=gen),
                "exp_avg_sq": torch.rand(*s, generator=gen), "step": torch.tensor(3.0 + seed)}
            for k, s in SHAPES.items()}


def _shard(key, full, t, tp):
    """(local tensor incl. vocab padding rows, ParamInfo) of tensor rank tp of t."""
    dim = SPLIT.get(key) if t > 1 else None
    if dim is None:
        return full.clone(), ParamInfo(key=key, global_shape=tuple(full.shape))
    n = full.shape[dim]
    per = -(-n // t)
    start, stop = min(n, tp * per), min(n, (tp + 1) * per)
    part = full.narrow(dim, start, stop - start)
    shape = list(part.shape)
    shape[dim] = per - (stop - start)
    local = torch.cat([part, torch.full(shape, -7.0)], dim)   # padding rows: garbage
    return local.clone(), ParamInfo(key=key, global_shape=tuple(full.shape), split_dim=dim,
                                    start=start, stop=stop, replicated_over_tp=False,
                                    shared_with="embedding" if key == "emb.weight" else None)


def _local_state(groups, t, p, seed=0, blank=False):
    tensors, optim = {}, {}
    for key, f in _full(seed).items():
        if p > 1 and STAGE[key] != groups.pp_rank and key != "emb.weight":
            continue
        tp = groups.tp_rank if groups is not None else 0
        local, info = _shard(key, f["param"], t, tp)
        if p > 1 and key == "emb.weight":
            info = ParamInfo(**{**info.__dict__, "shared_with": "embedding"})
        if blank:
            local = torch.zeros_like(local)
        tensors[key] = (local, info)
        optim[key] = {n: _shard(key, f[n], t, tp)[0] for n in ("exp_avg", "exp_avg_sq")}
        optim[key]["step"] = f["step"].clone()
    return tensors, optim


def _matches(tensors, optim, seed=0):
    full = _full(seed)
    for key, (local, info) in tensors.items():
        idx = info.global_index()
        if not torch.equal(info.real_part(local), full[key]["param"][idx]):
            return f"param {key}"
        for n in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(info.real_part(optim[key][n]), full[key][n][idx]):
                return f"{n} {key}"
        if float(optim[key]["step"]) != float(full[key]["step"]):
            return f"step {key}"
    return "ok"


def _save_worker(rank, world, path, t, p, seed, step, die_in_commit=False):
    groups = ProcessGroups.create(t, p, world // (t * p), timeout_s=20)
    tensors, optim = _local_state(groups, t, p, seed)
    if die_in_commit and rank == 0:
        real_replace = os.replace

        def die(src, dst):
            if str(dst) == str(path):
                os._exit(1)       # killed after the new version is written, before the commit
            return real_replace(src, dst)
        os.replace = die
    try:
        ckpt.save_checkpoint(path, tensors, optim, step, groups, plan_json='{"t": %d}' % t)
    except Exception as exc:  # noqa: BLE001 - the survivors of a killed rank report it
        return f"failed: {type(exc).__name__}"
    return "saved"


def _load_worker(rank, world, path, t, p):
    groups = ProcessGroups.create(t, p, world // (t * p), timeout_s=20)
    tensors, _ = _local_state(groups, t, p, blank=True)
    optim: dict = {}
    step = ckpt.load_checkpoint(path, tensors, groups, optimizer_state=optim)
    return step, _matches(tensors, optim)


def test_reshard_t2p2_to_t1_and_t4(tmp_path):
    path = str(tmp_path / "ck")
    assert spawn(_save_worker, 4, path, 2, 2, 0, 5, timeout_s=150) == ["saved"] * 4
    assert os.path.islink(path)
    # t=1 on one process
    tensors, _ = _local_state(None, 1, 1, blank=True)
    optim: dict = {}
    assert ckpt.load_checkpoint(path, tensors, None, optimizer_state=optim) == 5
    assert _matches(tensors, optim) == "ok"
    assert ckpt.read_plan_json(path) == '{"t": 2}'
    # t=4 on four ranks: emb rows [3, 6) span both saved t=2 pieces
    for step, ok in spawn(_load_worker, 4, path, 4, 1, timeout_s=150):
        assert (step, ok) == (5, "ok")


def test_reshard_t2_to_d2_and_kill_during_save(tmp_path):
    path = str(tmp_path / "ck")
    assert spawn(_save_worker, 2, path, 2, 1, 0, 1, timeout_s=120) == ["saved"] * 2
    # rank 0 is killed between writing step 2 and committing it: step 1 must stay loadable
    out = spawn(_save_worker, 2, path, 2, 1, 1, 2, True, timeout_s=120, allow_exit=[0])
    assert out[0] is None and out[1].startswith("failed")
    for step, ok in spawn(_load_worker, 2, path, 1, 1, timeout_s=120):   # d=2 now
        assert (step, ok) == (1, "ok")
    # the next save succeeds and cleans the leftovers of the killed one
    assert spawn(_save_worker, 2, path, 2, 1, 1, 3, timeout_s=120) == ["saved"] * 2
    assert sorted(n.split("-")[0] for n in os.listdir(tmp_path)) == ["ck", "ck.ckpt"]
    tensors, _ = _local_state(None, 1, 1, blank=True)
    optim: dict = {}
    assert ckpt.load_checkpoint(path, tensors, optimizer_state=optim) == 3
    assert _matches(tensors, optim, seed=1) == "ok"


def test_single_process_crash_mismatch_and_safety(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    tensors, optim = _local_state(None, 1, 1)
    ckpt.save_checkpoint(path, tensors, optim, 7, None)
    # a crash between writing and committing keeps the old checkpoint
    monkeypatch.setattr(ckpt, "commit", lambda *a: (_ for _ in ()).throw(RuntimeError("crash")))
    with pytest.raises(RuntimeError, match="crash"):
        ckpt.save_checkpoint(path, *_local_state(None, 1, 1, seed=1), 8, None)
    monkeypatch.undo()
    fresh, _ = _local_state(None, 1, 1, blank=True)
    optim2: dict = {}
    assert ckpt.load_checkpoint(path, fresh, optimizer_state=optim2) == 7
    assert _matches(fresh, optim2) == "ok"
    # another model: missing / unexpected keys and shapes are named
    other = {"fc1.weight": (torch.zeros(8, 5), ParamInfo(key="fc1.weight", global_shape=(8, 5))),
             "head.weight": (torch.zeros(2), ParamInfo(key="head.weight", global_shape=(2,)))}
    with pytest.raises(ValueError) as err:
        ckpt.load_checkpoint(path, other)
    for word in ("head.weight", "emb.weight", "fc1.weight", "(8, 4)", "(8, 5)"):
        assert word in str(err.value)
    # a torch optimizer round trip through the per-key helpers
    params = {k: torch.nn.Parameter(v.clone()) for k, (v, _) in fresh.items()}
    opt = torch.optim.AdamW(params.values())
    ckpt.load_optimizer_state(opt, params, optim2)
    assert ckpt.optimizer_state_by_key(opt, params)["fc2.bias"]["exp_avg"].equal(
        optim2["fc2.bias"]["exp_avg"])
    opt.step()  # the loaded state is usable
    # metadata that would run code is refused
    target = os.path.realpath(path)
    with open(os.path.join(target, ".metadata"), "wb") as f:
        pickle.dump(os.system, f)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        ckpt.load_checkpoint(path, _local_state(None, 1, 1, blank=True)[0])
