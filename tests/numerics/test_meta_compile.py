"""compile() of a meta-device model through the runner (p = 2, t = 1): each rank materialises
its parameters from the model's own init (per-module seeds, global shapes) and trains to the same
losses and weights as the real model re-initialised the same way (shard.init_full_like_meta)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.examples.gpt import GPT
from autopar.runtime.shard import init_full_like_meta
from autopar.testing import spawn

import models
from reference import train, weight_mismatches

pytestmark = pytest.mark.distributed

VOCAB, SEQ = 64, 8
STEPS, BATCH = 3, 4


def _gpt(layers: int = 2) -> torch.nn.Module:
    return models.gpt(vocab=VOCAB, seq=SEQ, layers=layers, heads=2, hidden=16)


def _batches():
    return models.token_batches(VOCAB, (BATCH, SEQ), STEPS, seed=3)


def _rank(rank: int, world: int, precision: str = "fp32"):
    with autopar.meta_init():
        model = _gpt()
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    prog = autopar.parallelize(model, gpus=world, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=BATCH,
                               cluster="local-cpu", p=2, micro_batch_size=1, schedule="1f1b",
                               init=GPT.init_weights)
    runner = prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                          precision=precision)
    assert not any(p.is_meta for p in runner.parameters())
    losses = [runner.train_step(x, y) for x, y in _batches()]
    return losses, runner.full_state_dict()


def test_meta_model_compiles_and_matches_its_real_twin():
    results = spawn(_rank, 2, timeout_s=300)
    model = init_full_like_meta(_gpt(), GPT.init_weights, seed=0)
    ref = train(model, _batches(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                loss_fn=autopar.cross_entropy)
    losses, state = results[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-4,
                               atol=1e-5)
    assert not weight_mismatches(state, ref.state, ref.init), \
        weight_mismatches(state, ref.state, ref.init)


def test_meta_model_compiles_in_bf16_and_matches_its_real_twin():
    """bf16: the capture's bf16 stand-ins of meta parameters are meta too; each rank
    materialises fp32 weights from the init (its masters) and trains like the real twin in
    bf16 (the bf16 tolerances of tests/programs.py)."""
    from programs import BF16_LOSS_RTOL, BF16_WEIGHT_ATOL
    results = spawn(_rank, 2, "bf16", timeout_s=300)
    model = init_full_like_meta(_gpt(), GPT.init_weights, seed=0)
    ref = train(model, _batches(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                loss_fn=autopar.cross_entropy, precision="bf16")
    losses, state = results[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses),
                               rtol=BF16_LOSS_RTOL, atol=0.0)
    for k, v in ref.state.items():
        torch.testing.assert_close(state[k], v, rtol=0.0, atol=BF16_WEIGHT_ATOL, msg=k)


@pytest.mark.parametrize("t", [1, 2])
def test_a_pipeline_rank_materialises_only_its_own_chunks(t):
    """Local shards only (issue 3): the build for pipeline rank r makes real tensors for the
    weights of r's chunks (c ≡ r mod p) only; the other chunks' weights stay meta shapes."""
    from autopar.build import build_program
    with autopar.meta_init():
        model = _gpt(layers=4)
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    prog = autopar.parallelize(model, gpus=2 * t, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=4,
                               cluster="local-cpu", t=t, p=2, v=2, micro_batch_size=1,
                               schedule="interleaved-1f1b", init=GPT.init_weights)
    built = build_program(prog)
    total = sum(x.numel() for x in built.gm.parameters())
    for r in range(2):
        chunks = built.chunks(t - 1, pp_rank=r)
        mine = {id(x) for c, gm in enumerate(chunks) if c % 2 == r for x in gm.parameters()}
        for c, gm in enumerate(chunks):
            for name, x in gm.named_parameters():
                if c % 2 == r:
                    assert not x.is_meta, (r, c, name)
                elif id(x) not in mine:
                    assert x.is_meta, (r, c, name)
        real = {id(x): x.numel() for gm in chunks for x in gm.parameters() if not x.is_meta}
        assert 0 < sum(real.values()) < 0.8 * total / t   # about half of this rank's 1/t
    assert all(x.is_meta for gm in built.chunks(0, weights=False) for x in gm.parameters())
