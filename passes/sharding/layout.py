"""The layout algebra: how the tensor-parallel ranks (or the context ranks) hold a value of the
single-device program (Replicate, Shard, Whole, Partial: see passes/sharding/__init__.py), the
two exceptions propagation raises to its driver (Conflict, Refine), and the mapping of a split
dim through a reshape (`map_reshape`). Pure: no graph walking beyond the node a Conflict names.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx as fx


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: tuple[int, ...]
    padded: int = 0
    origins: frozenset = field(default=frozenset(), compare=False)
    seq: bool = field(default=False, compare=False)  # a sequence-parallel shard
    whole: tuple[bool, ...] = ()     # per block: held whole by every rank (empty: none)
    # which blocks of the one origin's seed these blocks are (None: not traceable)
    src: tuple[int, ...] | None = field(default=None, compare=False)

    def flags(self) -> tuple[bool, ...]:
        return self.whole or (False,) * len(self.blocks)

    def local(self, t: int) -> int:
        """Local size of the split dim on each rank."""
        if self.padded:
            return self.padded // t
        return sum(b if w else b // t for b, w in zip(self.blocks, self.flags()))

    def size(self) -> int:
        return sum(self.blocks)

    def __repr__(self) -> str:
        extra = f", padded={self.padded}" if self.padded else ""
        extra += ", seq" if self.seq else ""
        extra += f", whole={self.whole}" if self.whole else ""
        return f"Shard({self.dim}, {self.blocks}{extra})"


@dataclass(frozen=True)
class Whole:
    origins: frozenset = field(default=frozenset(), compare=False)

    def __repr__(self) -> str:
        return "Whole()"


@dataclass(frozen=True)
class Partial:
    biases: tuple[str, ...] = ()   # added once, after the reduction (row-parallel biases)
    # (bias, dropout node): the bias times that dropout's noise, added after the reduction
    # (a dropout of the biased sum Σa + b is Σ(a·noise) + b·noise, one noise on every rank)
    masked: tuple[tuple[str, str], ...] = ()

    @property
    def pending(self) -> bool:
        """Something is still to be added after the reduction."""
        return bool(self.biases or self.masked)

    def __repr__(self) -> str:
        parts = [f"biases={self.biases}"] * bool(self.biases) + \
            [f"masked={self.masked}"] * bool(self.masked)
        return f"Partial({', '.join(parts)})"


Layout = Replicate | Shard | Partial | Whole
R = Replicate()


class Conflict(Exception):
    """A split value would have to be gathered: turn its column candidates off."""

    def __init__(self, origins: frozenset, node: fx.Node, reason: str, indivisible: bool = False):
        super().__init__(reason)
        self.origins, self.node, self.reason, self.indivisible = origins, node, reason, indivisible


class Refine(Exception):
    """A fused output is cut at non-block boundaries: re-seed `origin` with finer blocks.
    `fallback`: a tentative refinement — the Conflict to report instead if the refined split
    later conflicts (the driver then undoes it and turns `origin` off)."""

    def __init__(self, origin: str, blocks: tuple[int, ...], fallback: Conflict | None = None,
                 whole: tuple[bool, ...] = ()):
        super().__init__(f"refine {origin} to {blocks}" + (f", whole {whole}" if whole else ""))
        self.origin, self.blocks, self.fallback, self.whole = origin, blocks, fallback, whole


def is_split(lay: Any) -> bool:
    """A layout (or tuple of them, for a multi-output node) of a split region: no rank holds it
    whole, or (Whole) its gradient is a per-rank summand."""
    if isinstance(lay, tuple):
        return any(is_split(x) for x in lay)
    return isinstance(lay, (Shard, Partial, Whole))


def union(lays: list[Shard]) -> frozenset:
    """The column-parallel origins of `lays` together."""
    out: frozenset = frozenset()
    for l in lays:
        out |= l.origins
    return out


# ----- reshape mapping --------------------------------------------------------------------------

def map_reshape(src: tuple[int, ...], dst: tuple[int, ...], lay: Shard, t: int) -> Shard | None:
    """The layout of reshape(x, dst) when x (shape src) is `lay`, or None if not expressible.

    Size-1 dims are ignored; the remaining dims are grouped into runs of equal products. Inside
    the group holding the split dim, the split is written on the flat index of the group
    (outer product Q, blocks scaled by the inner product P) and read back on the first output
    dim e that can express it: e outermost with every block divisible by t·P(e), or the blocks
    repeating alike in each of e's Q(e) rows, each divisible by t·P(e) (every block exactly
    one row of e: e's own size is split, Q(e) times).
    """
    d = lay.dim
    si = [i for i, s in enumerate(src) if s != 1]
    so = [j for j, s in enumerate(dst) if s != 1]
    groups, a, b = [], 0, 0
    while a < len(si) and b < len(so):
        gi, go, pi, po = [si[a]], [so[b]], src[si[a]], dst[so[b]]
        a, b = a + 1, b + 1
        while pi != po:
            if pi < po:
                gi.append(si[a]); pi *= src[si[a]]; a += 1
            else:
                go.append(so[b]); po *= dst[so[b]]; b += 1
        groups.append((gi, go))
    group = next(((gi, go) for gi, go in groups if d in gi), None)
    if group is None or not group[1]:
        return None
    gi, go = group
    pos = gi.index(d)
    inner = prod(src[i] for i in gi[pos + 1:])
    outer = prod(src[i] for i in gi[:pos])
    if lay.padded:
        return replace(lay, dim=go[0]) if len(gi) == 1 and len(go) == 1 else None
    flat = tuple(b * inner for b in lay.blocks) * outer
    whole = lay.flags() * outer
    src = lay.src * outer if lay.src is not None else None
    for k, e in enumerate(go):
        p_e = prod(dst[j] for j in go[k + 1:])
        q_e = prod(dst[j] for j in go[:k])
        # a whole block need not divide by t, only into rows of e
        if q_e == 1 and all(b % (p_e if w else t * p_e) == 0 for b, w in zip(flat, whole)):
            return replace(lay, dim=e, blocks=tuple(b // p_e for b in flat),
                           whole=whole if lay.whole else (), src=src)
        if lay.whole:
            continue
        # the blocks tile each of the Q(e) rows of e alike: one block a row (e's own size
        # split, Q(e) times), or several (Llama 4's experts: (E·N, C) rows of B sequences
        # viewed (E, N, C), each expert's N rows the same B blocks)
        n = len(flat) // q_e
        if (len(flat) % q_e == 0 and flat == flat[:n] * q_e and sum(flat[:n]) == dst[e] * p_e
                and all(b % (t * p_e) == 0 for b in flat[:n])):
            return replace(lay, dim=e, blocks=tuple(b // p_e for b in flat[:n]), src=None)
    return None


def prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def unflattened_sizes(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> list[int] | None:
    """The sizes `src`'s dim `dim` unflattens into in `dst` (dims before it unchanged), e.g.
    (2, 8, 64) -> (2, 8, 2, 4, 8), dim 2: [2, 4, 8]; None when it does not unflatten."""
    if list(src[:dim]) != list(dst[:dim]):
        return None
    size = 1
    for k in range(dim, len(dst)):
        size *= dst[k]
        if size == src[dim]:
            return list(dst[dim:k + 1]) if k > dim else None
        if size > src[dim]:
            return None
    return None
