"""Expert parallelism's token exchange on gloo ranks (autopar/runtime/experts.py): experts
spread over the ranks, rows dispatched by all-to-all and combined back, against every rank
running all experts itself — outputs, row gradients and expert-weight gradients (summed over
the ranks that sent rows, as the backward all-to-all brings them)."""
import pytest
import torch
import torch.distributed as dist

from autopar.runtime import experts as X
from autopar.testing import spawn

pytestmark = pytest.mark.distributed

E, H, F = 4, 6, 5


def _rows(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s n rows sorted by expert, and offs (E,); expert 2 gets none on rank 0."""
    gen = torch.Generator().manual_seed(10 + rank)
    experts = torch.randint(0, E, (n,), generator=gen)
    if rank == 0:
        experts = experts[experts != 2]
    experts, _ = torch.sort(experts)
    offs = torch.cumsum(torch.bincount(experts, minlength=E), 0).to(torch.int32)
    return torch.randn(experts.numel(), H, generator=gen, dtype=torch.float64), offs


def _experts(x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Row block g of x times w[g] (a grouped matmul, written out)."""
    out, start = [], 0
    for g, stop in enumerate(offs.tolist()):
        out.append(torch.tanh(x[start:stop] @ w[g]))
        start = stop
    return torch.cat(out)


def _worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    w = torch.randn(E, H, F, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x, offs = _rows(rank, 9 + 4 * rank)
    probe = torch.randn(x.shape[0], F, generator=torch.Generator().manual_seed(20 + rank),
                        dtype=torch.float64)
    # every expert on this rank
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = _experts(xr, offs, wr)
    (y_ref * probe).sum().backward()
    w_grad_ref = wr.grad.clone()
    dist.all_reduce(w_grad_ref, group=group)            # every rank's rows reach each expert
    # experts [rank·E/ep, (rank+1)·E/ep) here, rows exchanged
    local = slice(rank * E // world, (rank + 1) * E // world)
    xs, ws = x.clone().requires_grad_(), w[local].clone().requires_grad_()
    r = X.route(offs, group)
    y = X.combine(_experts(X.dispatch(xs, r, group), r.offs_local, ws), r, group)
    (y * probe).sum().backward()
    close = lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-12)  # noqa: E731
    return {"y": close(y, y_ref), "x.grad": close(xs.grad, xr.grad),
            "w.grad": close(ws.grad, w_grad_ref[local]), "offs_local": r.offs_local.tolist(),
            "recv": r.recv, "rows": x.shape[0]}


def test_dispatch_and_combine_equal_every_expert_on_every_rank():
    results = spawn(_worker, 2, timeout_s=60)
    for rank, res in enumerate(results):
        assert res["y"] and res["x.grad"] and res["w.grad"], (rank, res)
    # every row lands on one rank once; rank 1 (experts 2, 3) got none of expert 2 from rank 0
    assert all(r["offs_local"][-1] == sum(r["recv"]) for r in results)
    assert sum(r["offs_local"][-1] for r in results) == sum(r["rows"] for r in results)


def test_a_group_of_one_is_the_identity():
    x, offs = _rows(1, 7)
    r = X.route(offs, None)
    assert X.dispatch(x, r, None) is x and X.combine(x, r, None) is x
    assert torch.equal(r.offs_local, offs)
