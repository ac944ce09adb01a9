"""`autopar.runtime.hooks.weak_hook`: a parameter hook that calls its owner's method while the
owner lives and holds it only weakly, so a parameter's hook table never keeps a gradient sync
or a ZeRO optimizer (and their process groups) alive past the runner that made them."""
from __future__ import annotations

import gc
import weakref

import torch

from autopar.runtime.hooks import weak_hook


class _Owner:
    def __init__(self, p: torch.nn.Parameter):
        self.p, self.seen = p, []
        p.register_post_accumulate_grad_hook(weak_hook(self.accumulated, "tag"))

    def accumulated(self, tag: str, p: torch.Tensor) -> None:
        self.seen.append((tag, p.grad.clone()))


def test_the_hook_calls_its_owner_with_the_bound_arguments_then_the_tensor():
    p = torch.nn.Parameter(torch.ones(3))
    owner = _Owner(p)
    (p * 2).sum().backward()
    assert len(owner.seen) == 1 and owner.seen[0][0] == "tag"
    torch.testing.assert_close(owner.seen[0][1], torch.full((3,), 2.0))


def test_the_parameter_does_not_keep_its_hooks_owner_alive():
    p = torch.nn.Parameter(torch.ones(3))
    owner = _Owner(p)
    freed = []
    weakref.finalize(owner, freed.append, True)
    del owner                        # owner -> p -> hook table -> (weak) owner: no cycle
    assert freed == [True]           # freed by reference counting, before any collection
    gc.collect()
    (p * 2).sum().backward()         # the hook outlives its owner and does nothing
    torch.testing.assert_close(p.grad, torch.full((3,), 2.0))
