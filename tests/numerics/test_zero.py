"""ZeRO-1 on gloo ranks: the same weights as one process running AdamW on the full averaged
gradient (d=2, d=4, and the all-reduce fallback), 1/d optimizer-state bytes, gathered state."""
import pytest
import torch
import torch.distributed as dist

from autopar.runtime.params import ParamInfo
from autopar.runtime.zero import ZeroOptimizer
from autopar.testing import refuse_reduce_scatter, spawn

from reference import optimizer_state_bytes, train

pytestmark = pytest.mark.distributed


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _model():
    torch.manual_seed(0)   # odd sizes: shard boundaries cut parameters, padding is needed
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _data(step, n=8):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 5, generator=gen), torch.randn(n, 3, generator=gen)


def _infos(model):
    return [ParamInfo(key=k, global_shape=tuple(p.shape)) for k, p in model.named_parameters()]


def _reference(steps):
    ref = train(_model(), [_data(step) for step in range(steps)], _adamw,
                loss_fn=torch.nn.functional.mse_loss)
    state = {k: ref.optimizer.state[p] for k, p in ref.model.named_parameters()}
    return [p.detach() for p in ref.model.parameters()], state, ref.optimizer


def _worker(rank, d, fallback):
    refused = refuse_reduce_scatter() if fallback else []
    model = _model()
    zero = ZeroOptimizer(list(model.parameters()), _infos(model), _adamw, dist.group.WORLD)
    for step in range(3):
        x, y = _data(step)
        share = x.shape[0] // d
        zero.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank * share:(rank + 1) * share]),
                                     y[rank * share:(rank + 1) * share]).backward()
        zero.step()
    ref, ref_state, ref_opt = _reference(3)
    weights_ok = all(torch.allclose(p, r, rtol=1e-5, atol=1e-7)
                     for p, r in zip(model.parameters(), ref))
    gathered = zero.gathered_state()
    state_ok = all(torch.allclose(gathered[k][n], ref_state[k][n], rtol=1e-5, atol=1e-8)
                   for k in ref_state for n in ("exp_avg", "exp_avg_sq", "step"))
    # a fresh ZeroOptimizer loads the gathered state and continues like the reference
    model2 = _model()
    with torch.no_grad():
        for p, r in zip(model2.parameters(), model.parameters()):
            p.copy_(r)
    zero2 = ZeroOptimizer(list(model2.parameters()), _infos(model2), _adamw, dist.group.WORLD)
    zero2.load_gathered_state(gathered)
    return {"weights": weights_ok, "state": state_ok, "refused": len(refused),
            "bytes": zero.state_bytes(), "ref_bytes": optimizer_state_bytes(ref_opt),
            "segments": len(zero.segments), "n_params": sum(p.numel() for p in model.parameters()),
            "resume": all(torch.equal(zero2.optimizer.state[m2]["exp_avg"],
                                      zero.optimizer.state[m]["exp_avg"])
                          for m, m2 in zip(zero.master, zero2.master))}


@pytest.mark.parametrize("d,fallback", [(2, False), (4, False), (2, True)])
def test_zero1_equals_unsharded_adamw(d, fallback):
    results = spawn(_worker, d, fallback, timeout_s=150)
    for r in results:
        assert r["weights"] and r["state"] and r["resume"], r
        assert (r["refused"] > 0) == fallback, r    # the fallback path really ran
        # memory: m and v are 1/d of unsharded (+ one 4-byte step per segment, + padding)
        S = -(-r["n_params"] // d)
        assert r["bytes"] <= 2 * 4 * S + 4 * r["segments"]
        assert r["bytes"] <= r["ref_bytes"] / d * 1.1 + 4 * r["segments"]
    assert sum(r["bytes"] for r in results) < results[0]["ref_bytes"] * 1.1


def test_single_rank_is_plain_adamw():
    model = _model()
    zero = ZeroOptimizer(list(model.parameters()), _infos(model), _adamw, None)
    for step in range(3):
        x, y = _data(step)
        zero.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        zero.step()
    ref, _, _ = _reference(3)
    assert all(torch.allclose(p, r, rtol=1e-6, atol=1e-8) for p, r in zip(model.parameters(), ref))
    with pytest.raises(ValueError, match="ParamInfo"):
        ZeroOptimizer(list(model.parameters()), [], _adamw, None)
