"""The expert-parallel graph pass (passes/expert_parallel.py) on 2 gloo ranks: transformers'
Mixtral and OLMoE (grouped matmuls) and Llama 4 (batched matmuls over every token) captured,
each rank keeping 2 of the 4 experts and exchanging its tokens by all-to-all, against the
whole model on the same rank's batch — the loss, the gradients of the dense weights (the
rank's own), and of its experts (summed over the ranks whose tokens reached them, as the
backward all-to-all brings them). The whole training program (build / compile running this
pass): tests/numerics/test_expert_parallel_program.py."""
import pytest
import torch
import torch.distributed as dist

import models
from autopar.examples.gpt import lm_cross_entropy
from autopar.passes.capture import capture
from autopar.passes.expert_parallel import (apply_expert_parallel, expert_bmm_chains,
                                            expert_chains)
from autopar.testing import spawn

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, name: str) -> dict:
    group = dist.group.WORLD
    sizes = {} if name in BMM else {"experts": 4, "top_k": 2}   # llama4: 4, top-1
    model = models.build(name, seed=0, **sizes)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(100 + rank))
    ref = capture(model, (ids,), lm_cross_entropy, ids).gm
    loss_ref = ref(ids, ids)
    loss_ref = loss_ref[0] if isinstance(loss_ref, (tuple, list)) else loss_ref
    loss_ref.backward()
    grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
    for p in ref.parameters():      # the two captures may share the model's parameters
        p.grad = None
    gm = capture(model, (ids,), lm_cross_entropy, ids).gm
    chains = (len(expert_chains(gm)), len(expert_bmm_chains(gm)))
    apply_expert_parallel(gm, world, rank, group)
    loss = gm(ids, ids)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    loss.backward()
    out = {"chains": chains, "loss": (float(loss), float(loss_ref)), "bad": []}
    for k, p in gm.named_parameters():
        want = grads[k]
        if p.shape != want.shape:                       # this rank's experts: dim 0 sliced
            n = p.shape[0]
            dist.all_reduce(want, group=group)
            want = want[rank * n:(rank + 1) * n]
            out.setdefault("experts", []).append(k)
        if not torch.allclose(p.grad, want, rtol=1e-4, atol=1e-6):
            out["bad"].append(k)
    return out


# per model: (grouped, batched) chains and expert parameters of its 2 layers (the rest: 2, 4)
BMM = {"hf_llama4": ((0, 2), 4),     # routed experts as batched matmuls
       "hf_inkling": ((2, 2), 10)}   # routed grouped, 2 shared batched (gate, up, down)


@pytest.mark.parametrize("name", ["hf_mixtral", "hf_olmoe", "hf_llama4", "hf_inkling"])
def test_ep2_pass_equals_the_whole_model(name):
    results = spawn(_worker, 2, name, timeout_s=120)
    chains, experts = BMM.get(name, ((2, 0), 4))
    for rank, r in enumerate(results):
        assert r["chains"] == chains, r["chains"]
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5), (rank, r["loss"])
        assert len(r["experts"]) == experts, r          # e.g. gate_up and down of 2 layers
        assert not r["bad"], (rank, r["bad"])
