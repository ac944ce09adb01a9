"""compile() of a meta-device model through the runner (p = 2, t = 1): each rank materialises
its parameters from the model's own init (per-module seeds, global shapes) and trains to the same
losses and weights as the real model re-initialised the same way (shard.init_full_like_meta)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.examples.gpt import GPT, GPTConfig
from autopar.runtime.shard import init_full_like_meta
from autopar.testing import spawn

pytestmark = pytest.mark.distributed

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
STEPS, BATCH = 3, 4


def _init(module: torch.nn.Module) -> None:
    GPT._init_weights(module)


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g),
             torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g))
            for _ in range(STEPS)]


def _rank(rank: int, world: int):
    with autopar.meta_init():
        model = GPT(CFG)
    ids = torch.zeros(1, CFG.block_size, dtype=torch.long)
    prog = autopar.parallelize(model, gpus=world, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=BATCH,
                               cluster="local-cpu", p=2, micro_batch_size=1, schedule="1f1b",
                               init=_init)
    runner = prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert not any(p.is_meta for p in runner.parameters())
    losses = [runner.train_step(x, y) for x, y in _batches()]
    return losses, runner.full_state_dict()


def test_meta_model_compiles_and_matches_its_real_twin():
    results = spawn(_rank, 2, timeout_s=300)
    model = init_full_like_meta(GPT(CFG), _init, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = []
    for x, y in _batches():
        opt.zero_grad()
        loss = autopar.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        ref.append(loss.item())
    losses, state = results[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)
