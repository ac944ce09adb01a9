"""Imported by the fork server of autopar.testing.spawn (conftest.py preloads it): tiny
captures, builds and training steps before the server forks, so every spawned rank starts with
torch.export's, transformers' and the passes' lazy imports and first-call caches warm (the
first export in a fresh process took 4.9 s against 1.3 s for the next, measured on this 2-core
host under load). The models cover what most numerics tests capture: GPT, the Llama-style
model, transformers' Llama (its masks and rotary) and Mixtral (grouped expert matmuls), cut by
tensor and pipeline plans. With these four beyond GPT a rank's 3-step run of six other models
(c, d, p and t plans) took 14.5 CPU-s in all against 17.5-21 CPU-s with GPT alone (4.2 CPU-s
more, once, in the server). Nothing of it is shared state a test reads: each rank still
captures its own model."""
from __future__ import annotations

import torch

from autopar.compile import build_program
from programs import loss_fn, make_plan, make_program

WARM = [("gpt", dict(t=2)), ("gpt", dict(p=2)), ("llama_style", dict(t=2)),
        ("llama_style", dict(p=2)), ("hf_llama", dict(t=2)), ("hf_mixtral", dict(p=2))]


def _warm() -> None:
    for name, degrees in WARM:
        prog, vocab = make_program(name, make_plan(layers=2, **degrees))
        built = build_program(prog, "fp32")
        built.chunks(0, 0, ep_rank=0)
        # one eager forward/backward: autograd's and the loss's first-call set-up
        x = torch.randint(0, vocab, (2, 8))
        loss_fn(prog.model(x), x).backward()


# Not on a CUDA build of torch (the default wheel; torch 2.11+cu130 on this CPU host): there
# the autograd engine's first use starts its device threads, and every rank forked after it
# failed at its first backward ("Unable to handle autograd's threading in combination with
# fork-based multiprocessing"). Its ranks start cold instead.
if not torch.backends.cuda.is_built():
    _warm()
