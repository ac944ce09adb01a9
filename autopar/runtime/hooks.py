"""Parameter hooks that hold their owner weakly.

A hook registered on a parameter (`register_post_accumulate_grad_hook`) is kept by the tensor,
and a bound method in it keeps its object: the gradient sync (data_parallel.GradSync) or the
ZeRO optimizer, which keep the parameter and their process groups. The cycle runs through the
tensor's hook table, which Python's collector does not traverse, so a freed runner's
optimizer and every process group it held lived to the interpreter's teardown (measured: one
gloo group's three threads per rank after `destroy_process_group`, `del runner` and
`gc.collect()`). A gloo worker that released a collective's tensors there took the finalizing
interpreter's GIL and aborted the process. `weak_hook` breaks the cycle: the hook calls the
method while its object lives and does nothing after.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


def weak_hook(method: Callable[..., Any], *args: Any) -> Callable[[torch.Tensor], None]:
    """A hook calling the bound `method(*args, tensor)` while its object is alive, holding
    the object by a weak reference (module doc)."""
    ref = weakref.WeakMethod(method)

    def hook(tensor: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, tensor)
    return hook
