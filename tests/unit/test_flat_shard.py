"""The flat ZeRO layout (autopar/runtime/flat_shard.py): where elements sit, and that building
a flat buffer or a shard writes each element once (counted, not timed)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.flat_shard import FlatLayout

WRITES = {"copy_", "zero_", "fill_", "zeros", "zeros_like", "full"}


class _Written(TorchDispatchMode):
    """Elements written by in-place copies and fills (and allocated zeroed) under the mode."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in WRITES:
            self.elements += out.numel()
        return out


def test_golden_segments():
    """The module docstring's example: numels (5, 7, 3), d = 2."""
    assert FlatLayout([5, 7, 3], 2, 0).shard_numel == 8
    r1 = FlatLayout([5, 7, 3], 2, 1)
    assert [(s.param, s.lo, s.hi, s.shard_lo) for s in r1.segments] == [(1, 3, 7, 0),
                                                                         (2, 0, 3, 4)]


@pytest.mark.parametrize("numels,d", [((5, 7, 3), 2), ((4, 4), 2), ((3,), 4), ((1, 9, 2), 3)])
def test_flatten_and_shard_write_each_element_once(numels, d):
    tensors = [torch.arange(1, k + 1, dtype=torch.float32) * (i + 1)
               for i, k in enumerate(numels)]
    tensors[len(tensors) // 2] = None            # a missing gradient: zeros
    want = torch.cat([torch.zeros(k) if t is None else t for t, k in zip(tensors, numels)])
    want = torch.cat([want, torch.zeros(d * -(-sum(numels) // d) - sum(numels))])
    layout = FlatLayout(numels, d, 0)
    with _Written() as w:
        flat = layout.flatten(tensors, torch.float32, "cpu")
    assert torch.equal(flat, want)
    assert w.elements == flat.numel()            # no fill before the copies
    for r in range(d):
        lay = FlatLayout(numels, d, r)
        whole = [torch.zeros(k) if t is None else t for t, k in zip(tensors, numels)]
        out = torch.full((lay.shard_numel,), float("nan"))    # stale contents: overwritten
        with _Written() as w:
            mine = lay.shard(lay.pieces(whole), torch.float32, "cpu", out=out)
        assert mine.data_ptr() == out.data_ptr()
        assert torch.equal(mine, want[r * lay.shard_numel:(r + 1) * lay.shard_numel])
        assert w.elements == lay.shard_numel
