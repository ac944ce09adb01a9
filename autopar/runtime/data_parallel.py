"""Data-parallel gradient averaging in buckets, overlapped with the last backward (like DDP).

Math: with d replicas each holding the gradient g_r of its share's mean loss, the global mean
loss's gradient is (1/d) Σ_r g_r — one all-reduce (sum) per bucket, then a divide by d.

Bucketing (PyTorch DDP, Li et al. 2006.15704 §3.2): parameters are taken in *reverse*
registration order (the order backward produces their gradients) and packed greedily into
flat buffers of about `bucket_bytes` (the first one at most 1 MiB, as in DDP, so the first
all-reduce starts while most of the backward is still to run); a bucket never mixes dtypes and never crosses a chunk
boundary (`chunks=`), so a chunk's reduction can be launched alone (breadth-first schedule).

When a gradient is final: only on the last micro-batch of a step. The runtime arms the hooks:

    sync = GradSync(params, pg.data)               # once
    for i, mb in enumerate(micro_batches):         # each step
        if i == len(micro_batches) - 1:
            sync.begin_final_microbatch()          # next accumulation is the final one
        backward(mb)                               # hooks launch ready buckets (async_op=True)
    sync.finish()                                  # wait; .grad becomes the averaged bucket view

A parameter's `register_post_accumulate_grad_hook` fires after its .grad holds the sum over
micro-batches; if armed, it copies .grad into its slot of the bucket and, when the bucket is
complete, launches that bucket's all-reduce. Buckets launch in index order on every rank
(a ready bucket waits for the lower-index ones), so all ranks issue the same collectives in
the same order. Breadth-first: `begin_final_microbatch(chunk_params)` arms a subset;
`mark_final(params)` declares already-final gradients ready; `reduce_now(params)` does that
and launches their buckets at once (pass `chunks=` so buckets align with chunks).

Parameters that carry a `main_grad` attribute (fp32 accumulation, see precision.py) are
reduced from and into `main_grad` instead of `.grad`; create MixedPrecision before GradSync
so its hook (which folds .grad into main_grad) runs first.

Expert parameters (expert parallelism) are reduced over their expert-data group, the c·d/ep
ranks holding the same experts, but divided by c·d (`divide_by`): each expert's gradient on a
rank already sums the ranks of its expert group whose tokens reached it (the combine's
backward all-to-all), so Σ over the expert-data group covers all c·d replicas' mean losses
once. With a group of one (ep = c·d) only the division is left.

Memory (DDP's gradient_as_bucket_view, Megatron-Core's contiguous gradient buffer): the buckets
are where the gradients live, not a copy of them. A `main_grad` is its bucket slot from the
start (MixedPrecision.step points its masters' grads at it), and an fp32 .grad moves into
its slot at its first accumulation of a step and accumulates there after, so a step holds one
gradient per parameter, not two.

A parameter that no micro-batch reached keeps .grad None (the same on every replica: AdamW
skips it as on one device); its bucket slot is sent as zeros. Buckets that never became
ready (no hook fired, e.g. unarmed) are launched by `finish()` from the then-final gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import group_size
from autopar.runtime.dist import peer_guard
from autopar.runtime.hooks import weak_hook
from autopar.runtime.precision import adopt_grad, grad_of, home_main_grad

DEFAULT_BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 2**20   # DDP's trick: a small first bucket starts communication early


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list[torch.Tensor]
    offsets: list[int]
    flat: torch.Tensor                    # (numel,) the bucket's buffer
    ready: set[int] = field(default_factory=set)   # positions whose gradient is final
    handle: Any = None
    launched: bool = False

    def view(self, pos: int) -> torch.Tensor:
        p = self.params[pos]
        return self.flat[self.offsets[pos]:self.offsets[pos] + p.numel()].view_as(p)


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    return p.main_grad.dtype if hasattr(p, "main_grad") else p.dtype


class GradSync:
    """Bucketed, overlapped gradient all-reduce over a data-parallel `group` (see module doc)."""

    def __init__(self, params: Sequence[torch.Tensor], group: Any, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, average: bool = True,
                 chunks: Sequence[Sequence[torch.Tensor]] | None = None,
                 divide_by: int | None = None):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be > 0; pass e.g. 25 * 2**20")
        self.params = [p for p in params if p.requires_grad]
        self.ids = {id(p) for p in self.params}
        self.group, self.average = group, average
        self.size = group_size(group)
        if divide_by is not None and (divide_by < self.size or divide_by % self.size):
            raise ValueError(f"divide_by={divide_by} with a group of {self.size} ranks: the "
                             f"divisor is a multiple of the group size (c·d over the c·d/ep "
                             f"ranks of an expert-data group); pass None to average")
        self.divisor = divide_by or self.size   # what the sum is divided by (when averaging)
        self.bucket_bytes = int(bucket_bytes)
        self.num_collectives = 0          # all-reduces launched since construction
        self._armed: set[int] = set()     # id(param) whose next accumulation is final
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self.buckets: list[_Bucket] = []
        if self.size == 1:
            return                        # no reduction (finish() divides by divide_by)
        self._build_buckets(self._chunk_lists(chunks))
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))

    # ---- construction -------------------------------------------------------------------
    def _chunk_lists(self, chunks: Sequence[Sequence[torch.Tensor]] | None
                     ) -> list[list[torch.Tensor]]:
        if chunks is None:
            return [self.params]
        mine = {id(p) for p in self.params}
        seen: set[int] = set()
        out = []
        for c in chunks:
            lst = [p for p in c if p.requires_grad]
            for p in lst:
                if id(p) not in mine or id(p) in seen:
                    raise ValueError(
                        f"chunks: a tensor of shape {tuple(p.shape)} is not in params or is in "
                        f"two chunks; chunks must partition the params list")
                seen.add(id(p))
            out.append(lst)
        if seen != mine:
            raise ValueError(f"chunks cover {len(seen)} of {len(mine)} parameters; chunks must "
                             f"partition the params list (every parameter in exactly one chunk)")
        return out

    def _build_buckets(self, chunk_lists: list[list[torch.Tensor]]) -> None:
        # Reverse registration order over the whole list: backward meets later chunks first.
        cap = min(FIRST_BUCKET_BYTES, self.bucket_bytes)
        for chunk in reversed(chunk_lists):
            current: list[torch.Tensor] = []
            nbytes = 0
            for p in reversed(chunk):
                size = p.numel() * torch.empty((), dtype=_grad_dtype(p)).element_size()
                if current and (nbytes + size > cap
                                or _grad_dtype(current[0]) != _grad_dtype(p)):
                    self._add_bucket(current)
                    current, nbytes, cap = [], 0, self.bucket_bytes
                current.append(p)
                nbytes += size
            if current:
                self._add_bucket(current)
                cap = self.bucket_bytes

    def _add_bucket(self, params: list[torch.Tensor]) -> None:
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        flat = torch.zeros(n, dtype=_grad_dtype(params[0]), device=params[0].device)
        b = _Bucket(len(self.buckets), params, offsets, flat)
        for pos, p in enumerate(params):
            self._where[id(p)] = (b, pos)
            if hasattr(p, "main_grad"):     # the fp32 accumulation happens in the bucket
                home_main_grad(p, b.view(pos))
        self.buckets.append(b)

    # ---- arming and readiness -----------------------------------------------------------
    def begin_final_microbatch(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """The next gradient accumulation of `params` (default all) is their last this step."""
        if self.size == 1:
            return
        self._armed.update(id(p) for p in (self.params if params is None else params))

    def mark_final(self, params: Iterable[torch.Tensor]) -> None:
        """The gradients of `params` are final now (their last backward has run)."""
        if self.size == 1:
            return
        for p in params:
            if id(p) in self._where:
                self._set_ready(p)

    def launch_ready(self) -> int:
        """Launch, in bucket order, every bucket whose gradients are all final; return how many."""
        n = 0
        for b in self.buckets:
            if b.launched:
                continue
            if len(b.ready) < len(b.params):
                break                     # keep the launch order identical on every rank
            self._launch(b)
            n += 1
        return n

    def reduce_now(self, params: Iterable[torch.Tensor]) -> None:
        """Per-chunk reduction (breadth-first): mark `params` final and launch their buckets now.

        Every bucket holding one of `params` must hold only final gradients (build GradSync
        with `chunks=` so buckets align with the chunks reduced together)."""
        if self.size == 1:
            return
        params = list(params)
        self.mark_final(params)
        todo = sorted({self._where[id(p)][0].index for p in params if id(p) in self._where})
        for i in todo:
            b = self.buckets[i]
            if b.launched:
                continue
            if len(b.ready) < len(b.params):
                missing = [tuple(b.params[j].shape) for j in range(len(b.params))
                           if j not in b.ready][:4]
                raise ValueError(
                    f"reduce_now: bucket {i} also holds parameters whose gradients are not "
                    f"final (shapes {missing}); build GradSync(..., chunks=[chunk params, ...]) "
                    f"so that buckets never mix parameters reduced at different times")
            self._launch(b)

    def _on_grad(self, p: torch.Tensor) -> None:
        if id(p) in self._armed:    # final: copied (÷ d) into its slot, which becomes .grad
            self._set_ready(p)
            self.launch_ready()
        else:
            self._adopt(p)

    def _adopt(self, p: torch.Tensor) -> None:
        """A fresh .grad (the step's first accumulation) moves into its bucket slot, where the
        next micro-batches accumulate in place (module doc); main_grad is one already."""
        b, pos = self._where[id(p)]
        if not b.launched:
            adopt_grad(p, b.view(pos))

    def _set_ready(self, p: torch.Tensor) -> None:
        b, pos = self._where[id(p)]
        if b.launched:
            raise RuntimeError(
                f"GradSync: a gradient of shape {tuple(p.shape)} changed after its bucket's "
                f"all-reduce was launched; call begin_final_microbatch() only before the last "
                f"backward of the step (each parameter may be final once per step)")
        self._armed.discard(id(p))
        b.ready.add(pos)
        self._copy_in(b, pos)

    def _copy_in(self, b: _Bucket, pos: int) -> None:
        """Gradient -> its bucket slot, pre-divided by d when averaging (one pass, as DDP)."""
        p = b.params[pos]
        g, view = grad_of(p), b.view(pos)
        if g is None:
            view.zero_()
        elif g.data_ptr() == view.data_ptr():
            if self.average:      # .grad already is the bucket view (adopted)
                view.div_(self.divisor)
        else:
            if self.average:
                torch.div(g, self.divisor, out=view)
            else:
                view.copy_(g)
            if g is p.grad and g.dtype == view.dtype:
                p.grad = view     # the fresh .grad is freed now, not at finish

    def _launch(self, b: _Bucket) -> None:
        for pos in range(len(b.params)):
            if pos not in b.ready:        # only finish() launches such buckets: grads are final
                self._copy_in(b, pos)
        b.launched = True
        self.num_collectives += 1
        with peer_guard("all-reduce with", self.group):
            b.handle = dist.all_reduce(b.flat, group=self.group, async_op=True)

    # ---- end of step --------------------------------------------------------------------
    def finish(self) -> None:
        """Launch what is left, wait for every bucket, write the averaged gradients back."""
        if self.size == 1:
            if self.average and self.divisor > 1:   # a group of one: the division alone
                for p in self.params:
                    g = grad_of(p)
                    if g is not None:
                        g.div_(self.divisor)
            return
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        with peer_guard("all-reduce with", self.group):
            for b in self.buckets:
                b.handle.wait()
        for b in self.buckets:
            for pos, p in enumerate(b.params):
                if hasattr(p, "main_grad"):
                    if p.main_grad.data_ptr() != b.view(pos).data_ptr():
                        p.main_grad.copy_(b.view(pos))
                elif p.grad is not None:
                    p.grad = b.view(pos)   # the averaged gradient, in place (no copy back)
            b.ready.clear()
            b.handle, b.launched = None, False
        self._armed.clear()

    def __repr__(self) -> str:
        sizes = [b.flat.numel() for b in self.buckets]
        return (f"GradSync(params={len(self.params)}, group_size={self.size}, "
                f"buckets={len(sizes)}, bucket_numels={sizes})")
