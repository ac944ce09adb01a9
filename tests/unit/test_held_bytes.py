"""autopar.testing's memory accounting on a CPU, what `autopar tune` reports as a plan's
measured memory: the tensors an object holds (`held_tensor_bytes`) and the most one repeated
step holds above them (`step_peak_tensor_bytes`)."""
from __future__ import annotations

import torch

from autopar.testing import (held_tensor_bytes, in_window, peak_tensor_bytes,
                             step_peak_tensor_bytes)

KB = 1024


def _floats(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)


def test_held_bytes_count_each_storage_once_with_grads_and_closures():
    base = _floats(256)                       # 1 KiB
    w = torch.nn.Parameter(_floats(512))      # 2 KiB, its .grad another 2 KiB
    w.grad = _floats(512)
    tied = torch.nn.Linear(4, 4, bias=False)  # 64 B weight, shared by two modules
    kept = _floats(128)                       # 512 B, held only by a closure
    main = torch.nn.Parameter(_floats(64))    # 256 B, its main_grad 256 B
    main.main_grad = _floats(64)

    def hook() -> torch.Tensor:
        return kept

    class Holder:
        def __init__(self) -> None:
            self.views = [base[:10], base[100:], base]      # one storage
            self.params = {"w": w, "again": w}
            self.modules = [tied, torch.nn.Sequential(tied)]
            self.hook = hook
            self.main = main
            self.released = torch.nn.Parameter(_floats(1000))
            self.released.data = torch.empty(0)              # zero=3 between steps
            self.meta = torch.empty(10 ** 6, device="meta")  # no storage
    assert held_tensor_bytes(Holder()) == 1 * KB + 4 * KB + 64 + 512 + 512


def test_held_bytes_stop_at_modules_and_globals():
    """A function's globals (and so every module) are not walked: another object's tensors
    are not counted as this one's."""
    class Holder:
        def __init__(self) -> None:
            self.fn = _floats            # a module-level function: its globals hold torch
            self.module = torch
    assert held_tensor_bytes(Holder()) == 0


def test_step_peak_counts_what_the_step_frees_of_the_last_one():
    """A step that drops last step's 4 KiB gradient, then allocates 8 KiB of scratch and a new
    gradient: the most it holds above its start is 8 KiB (scratch) + 4 KiB (new) - 4 KiB
    (freed first) = 8 KiB. peak_tensor_bytes over one call sees the freed block as 0 bytes
    (allocated before it started) and says 12 KiB."""
    state = {"grad": _floats(KB)}

    def step() -> None:
        state["grad"] = None
        scratch = _floats(2 * KB)
        state["grad"] = _floats(KB)
        del scratch

    assert step_peak_tensor_bytes(step) == 8 * KB + 4 * KB - 4 * KB
    step()
    assert peak_tensor_bytes(step)[1] == 12 * KB


def test_allocator_events_of_one_nanosecond_keep_the_order_they_were_recorded_in():
    """An allocation and then a free that the profiler's clock stamped alike stay in that
    order: sorted with the bytes as a tie-break, the free came first and a step's peak one
    block short. (ns, bytes, address) in, (ns, bytes) out."""
    recorded = [(5, 4 * KB, 1), (9, 8 * KB, 2), (9, -8 * KB, 2), (7, -4 * KB, 1)]
    assert in_window(recorded) == [(5, 4 * KB), (7, -4 * KB), (9, 8 * KB), (9, -8 * KB)]


def test_a_free_counts_only_blocks_allocated_in_the_window_at_their_own_size():
    """A block freed at an address the window never allocated is 0 bytes, whatever size the
    profiler gives it (c10's reporter can hold a stale size for the address); a reused
    address frees at the size of its latest allocation."""
    recorded = [(1, -4 * KB, 7), (2, 2 * KB, 8), (3, -2 * KB, 8), (4, 1 * KB, 8),
                (5, -64 * KB, 8)]
    assert in_window(recorded) == [(2, 2 * KB), (3, -2 * KB), (4, 1 * KB), (5, -1 * KB)]


def test_a_block_freed_while_not_profiling_leaves_no_stale_size_behind():
    """c10's CPU reporter records a block allocated in one profiled window and does not forget
    it when the block is freed outside one; a new block at that address then freed in a later
    window came out at the stale size (CI, 2026-11-28: a step's peak read 8 KiB for 12).
    malloc reused the address in 19 of 20 rounds here; every round must read the same. (Few
    rounds: each profiled window collects garbage first, ~1 s late in the suite's process.)"""
    state: dict[str, torch.Tensor] = {}

    def make() -> None:
        state["a"] = _floats(KB)

    def swap() -> None:
        state.pop("b")
        state["c"] = _floats(KB)

    for _ in range(4):
        peak_tensor_bytes(make)
        del state["a"]
        state["b"] = _floats(KB)
        assert peak_tensor_bytes(swap)[1:] == (4 * KB, 4 * KB)
