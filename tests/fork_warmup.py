"""Imported by the fork server of autopar.testing.spawn (conftest.py preloads it): one tiny
capture, build and training step before the server forks, so every spawned rank starts with
torch.export's and the passes' lazy imports and first-call caches warm (the first export in a
fresh process took 4.9 s against 1.3 s for the next, measured on this 2-core host under load).
Nothing of it is shared state a test reads: each rank still captures its own model."""
from __future__ import annotations

import torch

from autopar.compile import build_program
from programs import loss_fn, make_plan, make_program


def _warm() -> None:
    for plan in (make_plan(t=2, layers=2), make_plan(p=2, layers=2)):
        prog, _ = make_program("gpt", plan)
        built = build_program(prog, "fp32")
        built.chunks(0, 0, ep_rank=0)
    # one eager forward/backward: autograd's and the loss's first-call set-up
    prog, vocab = make_program("gpt", make_plan(layers=2))
    x = torch.randint(0, vocab, (2, 8))
    loss_fn(prog.model(x), x).backward()


_warm()
