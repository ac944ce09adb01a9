"""The experts' load measured on one device (autopar/expert_load.py) and handed to the planner
(parallelize(moe_imbalance=...), autopar plan --moe-imbalance / --data; issue 32 item 4)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import autopar
from autopar.expert_load import load_from_token_file, measure_expert_load

import models


def test_measured_rows_per_expert_are_the_routers_top_k_choices(tmp_path):
    """Mixtral (4 experts, top-2, 2 layers) on 2 × 8 tokens read from a flat uint16 token
    file: each layer's measured rows per expert equal the bincount of the top-2 of the router
    logits transformers returns for the same batch."""
    model = models.build("hf_mixtral", seed=0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    path = tmp_path / "tokens.bin"
    ids.numpy().astype(np.uint16).tofile(path)
    load = load_from_token_file(model, (torch.zeros_like(ids),), path)
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    want = tuple(tuple(float(x) for x in torch.bincount(
        torch.topk(layer, 2, dim=-1).indices.reshape(-1), minlength=4)) for layer in logits)
    assert load.counts == want and all(sum(c) == 32 for c in load.counts)
    assert load.rank_factor(1, 4) == 1.0 and load.rank_factor(2, 4) >= 1.0
    assert "measured on 32 routed rows" in load.source


def test_parallelize_prices_and_explains_a_given_imbalance():
    model = models.build("hf_mixtral", seed=0)
    ids = torch.zeros(2, 8, dtype=torch.long)
    prog = autopar.parallelize(model, 4, example_inputs=(ids,), loss_fn=autopar.cross_entropy,
                               global_batch_size=8, cluster="dgx-a100-80gb", ep=2, d=4,
                               moe_imbalance=1.3)
    assert prog.profile.expert_load.factor == 1.3
    assert "expert load imbalance: the most loaded expert gets 1.30×" in prog.plan.explain()
    assert "(this plan: ep=2, 1.15×)" in prog.plan.explain()


def test_batched_experts_are_planned_with_ep_and_have_no_load_to_measure():
    """Llama 4 runs its experts as batched matmuls over every token (each expert's batch: all
    rows, weighted by the router): the profile finds 4 experts per layer whose dispatch moves
    E · tokens · hidden elements per sequence, the planner spreads them (ep = 2), and an
    imbalance (given or measured) is refused in one line: every expert gets the same rows."""
    model = models.build("hf_llama4", seed=0)
    ids = torch.zeros(2, 16, dtype=torch.long)
    kw = dict(example_inputs=(ids,), loss_fn=autopar.cross_entropy, global_batch_size=4,
              cluster="dgx-a100-80gb", d=2)
    prog = autopar.parallelize(model, 2, ep=2, **kw)
    blk = prog.profile.block
    assert (blk.experts, blk.expert_dispatch_elems) == (4, 4 * 16 * 32)
    assert prog.plan.ep == 2 and "expert-parallel comm" in prog.plan.explain()
    with pytest.raises(ValueError, match=r"moe_imbalance=1.3: the model's experts run every "):
        autopar.parallelize(model, 2, moe_imbalance=1.3, **kw)
    with pytest.raises(ValueError, match="no imbalance to measure"):
        measure_expert_load(model, (ids,))


def test_plan_data_checks_the_file_and_host_memory_before_loading_weights(tmp_path):
    """`autopar plan --data` loads the model's real weights to run its routers: a missing file
    or weights larger than the host's memory are refused in one line first (gpt3-175b's 700 GB
    once filled this host's memory before the missing file was noticed)."""
    import pytest
    from autopar.expert_load import check_before_loading
    with torch.device("meta"):
        model = models.build("hf_mixtral", seed=0)
    with pytest.raises(ValueError, match=r"--data '.*nope.bin': no such file; .* --moe-imbalance") as e:
        check_before_loading(model, tmp_path / "nope.bin")
    assert "\n" not in str(e.value)
    path = tmp_path / "tokens.bin"
    np.arange(64, dtype=np.uint16).tofile(path)
    check_before_loading(model, path)
    with pytest.raises(ValueError, match=r"GiB available memory; pass --moe-imbalance") as e:
        check_before_loading(model, path, host_bytes=1024)
    assert "\n" not in str(e.value)


class _Batched(torch.nn.Module):
    """Rows (E=4, N, 8) through two batched products by 3-D parameters (up, a ReLU, down),
    and, with `second_exit`, a third product of the same rows returned beside them."""

    def __init__(self, second_exit: bool):
        super().__init__()
        self.second_exit = second_exit
        self.up = torch.nn.Parameter(torch.randn(4, 8, 16))
        self.down = torch.nn.Parameter(torch.randn(4, 16, 8))
        self.side = torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        y = torch.bmm(torch.bmm(x, self.up).relu(), self.down)
        return (y, torch.bmm(x, self.side)) if self.second_exit else y


@pytest.mark.parametrize("second_exit", [False, True])
def test_a_batched_experts_chain_has_one_rows_input_and_one_exit(second_exit):
    """passes/expert_chains.py: up → ReLU → down is one chain (rows x, exit down); a third
    product of the same rows gives the set two exits, which ep could not combine: no chain,
    so neither the planner nor the pass treats those bmms as experts."""
    from autopar.passes.expert_chains import expert_bmm_chains
    gm = torch.export.export(_Batched(second_exit), (torch.randn(4, 6, 8),)).module()
    chains = expert_bmm_chains(gm)
    if second_exit:
        assert chains == []
        return
    (chain,) = chains
    assert chain.rows.name == "x" and chain.experts == 4 and len(chain.bmms) == 2
    assert chain.exit in chain.bmms and not chain.operands


def test_expert_sets_that_ep_does_not_divide_stay_whole_and_dense():
    """Inkling holds 4 routed experts (a grouped matmul) and 2 shared ones (a batched chain).
    At ep = 4 the pass spreads the routed experts and keeps the shared chain whole on every
    rank (passes/expert_parallel.py): the profile keeps the two sets apart, so the shared
    experts are priced as dense weights (in the block, sharded over c·d like them) and move no
    tokens, while the routed ones are spread; at ep = 2 both sets are spread."""
    from autopar.cost.exchanges import expert_comm_s
    from autopar.cost.hardware import get_cluster
    from autopar.cost.model import Config
    from autopar.cost.shares import rank_params
    model = models.build("hf_inkling", seed=0)
    ids = torch.zeros(2, 16, dtype=torch.long)
    prog = autopar.parallelize(model, 4, example_inputs=(ids,), loss_fn=autopar.cross_entropy,
                               global_batch_size=8, cluster="dgx-a100-80gb", d=4, ep=4)
    blk = prog.profile.block
    layer0 = dict(model.named_parameters())
    numel = lambda *names: sum(layer0[f"model.layers.0.mlp.{n}"].numel() for n in names)  # noqa
    routed = numel("experts.gate_up_proj", "experts.down_proj")
    shared = numel("shared_experts.gate_proj", "shared_experts.up_proj",
                   "shared_experts.down_proj")
    assert [(e, p) for e, p, _ in blk.expert_sets] == [(2, shared), (4, routed)]
    assert all(d > 0 for *_, d in blk.expert_sets)
    assert blk.spread_experts(1) == (routed + shared, blk.expert_dispatch_elems)
    assert blk.spread_experts(4) == (routed, blk.expert_sets[1][2])
    cfg = lambda ep: Config(t=1, p=1, d=4, ep=ep, num_microbatches=1,   # noqa: E731
                            micro_batch_size=2)
    dense = rank_params(prog.profile, cfg(1)).block
    at4, at2 = rank_params(prog.profile, cfg(4)), rank_params(prog.profile, cfg(2))
    assert at4.experts == routed / 4 and at4.block == dense - routed
    assert at2.experts == (routed + shared) / 2 and at2.block == dense - routed - shared
    a100 = get_cluster("dgx-a100-80gb")
    only_routed = dataclasses.replace(blk, expert_sets=(blk.expert_sets[1],))
    priced = dataclasses.replace(prog.profile, block=only_routed)
    assert expert_comm_s(prog.profile, a100, cfg(4)) == expert_comm_s(priced, a100, cfg(4))
    assert expert_comm_s(prog.profile, a100, cfg(2))[0] > expert_comm_s(priced, a100, cfg(2))[0]
