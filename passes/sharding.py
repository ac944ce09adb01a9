"""Tensor-parallel layouts and the per-op rules that propagate them through an ATen graph.

A layout says how the tensor-parallel ranks 0..t-1 hold a value of the single-device program:

  Replicate()                 every rank holds the whole value
  Shard(dim, blocks)          dimension `dim` is cut into consecutive blocks of global sizes
                              `blocks` (sum = the dim's size); rank r holds the r-th 1/t of EVERY
                              block, concatenated. One block is the plain Megatron split; a fused
                              qkv output (B, T, 3C) is Shard(2, (C, C, C)) so that q, k and v
                              are each split by heads. `padded` > 0: the dim is padded to that
                              global size first (vocab padding), rank r holds rows
                              [r·padded/t, (r+1)·padded/t).
                              `whole` (a flag per block): blocks every rank holds whole (a
                              mixed projection: q split by heads, the one k/v head of
                              multi-query attention replicated); rank r holds the r-th 1/t of
                              each other block and all of these, in block order.
  Whole()                     every rank holds the whole value, computed inside a split region
                              (a mixed projection's replicated part, and what is computed from
                              it): its gradient on each rank is a summand — only this rank's
                              heads read it — summed where it leaves the region (the
                              projection's f and copy_to_tp_parts on its weight rows).
  Partial(biases, masked)     every rank holds a summand; the value is the sum over ranks
                              (a row-parallel product). `biases` names the bias nodes still
                              to be added once, after the reduction; two Partials summed stay
                              Partial (parallel attention + MLP branches: one reduction).
                              A dropout of a biased Partial stays Partial: the summands take
                              its noise (drawn once, on the replicated stream) and `masked`
                              pairs each bias with that dropout, added as bias·noise.

Propagation runs forward in topological order. A weight matmul whose input is replicated is a
column-parallel *candidate*: its output is seeded Shard(last) with the candidate's name as
`origin`. Rules carry shards through elementwise ops, reshapes (the split dim is mapped through
the reshape; see `_map_reshape`), transposes, split/chunk/cat, attention, reductions over other
dims, until a matmul contracts over the split dim (row-parallel → Partial). A value that would
have to be gathered back raises `Conflict(origins)`: the driver turns those candidates off and
runs again (replicated fallback), so only regions that close cheaply stay split. A split that
cuts a fused output at non-block boundaries raises `Refine(origin, blocks)` and the driver
re-seeds that candidate with finer blocks. A block whose piece cannot be split the way its
consumer needs (one k/v head where attention splits heads) raises a tentative
`Refine(origin, blocks, whole=...)`: that block is held whole (Whole) while the rest stays
split; if that conflicts later, the driver undoes it and the candidate falls back.

The same engine runs in a context mode (`ContextPropagator`, `context_layouts`; the end of this
file, docs/DESIGN.md §6.1): over the context ranks (t := c) on the captured graph, the inputs'
tokens seeded as a sequence Shard, no column candidates; whole operands meeting the rank's
tokens resolve to a selection at its global positions, attention reads its keys and values
whole, and what this engine would gather or reduce along the tokens is refused in one line.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from autopar.passes import meta as K

aten = torch.ops.aten


# ----- layouts ----------------------------------------------------------------------------------

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


# ----- op families ------------------------------------------------------------------------------

_TRANSPARENT = {aten.alias, aten.detach, aten.to, aten._to_copy, aten.clone, aten.contiguous,
                aten.lift_fresh_copy, aten.type_as}
_RESHAPES = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten,
             aten.squeeze, aten.unsqueeze}
SIZE_ARG_OPS = frozenset({aten.view, aten.reshape, aten._unsafe_view, aten.expand,
                          aten.broadcast_to})
_NONPOINTWISE_ELEMENTWISE = {aten.dropout, aten.to, aten._to_copy, aten.type_as, aten.alias,
                             aten.contiguous, aten.detach, aten.lift_fresh_copy, aten.zeros_like,
                             aten.ones_like, aten.empty_like, aten.full_like,
                             aten.native_dropout, aten.where}   # where(c, x, scalar): untagged
_REDUCE_DIM = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.max,
               aten.min, aten.argmax, aten.argmin, aten.logsumexp, aten.any, aten.all}
_SOFTMAX = {aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.cumsum}
MATMUL_OPS = frozenset({aten.linear, aten.addmm, aten.mm, aten.matmul, aten.bmm})
_NO_VALUE = {aten._assert_tensor_metadata, aten._assert_scalar, aten.sym_constrain_range_for_size}
SPLIT_OPS = frozenset({aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
                       aten.tensor_split})
_SELECT = frozenset({aten.slice, aten.narrow, aten.index})   # rows of a dim (selected_range)


def packet(node: fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", node.target)


def shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get(K.VAL) if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def is_tensor(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get(K.VAL), torch.Tensor)


def is_split(lay: Any) -> bool:
    """A layout (or tuple of them, for a multi-output node) of a split region: no rank holds it
    whole, or (Whole) its gradient is a per-rank summand."""
    if isinstance(lay, tuple):
        return any(is_split(x) for x in lay)
    return isinstance(lay, (Shard, Partial, Whole))


def is_pointwise(node: fx.Node) -> bool:
    target = node.target
    if packet(node) in _NONPOINTWISE_ELEMENTWISE:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


_TORCH_DIR = os.path.dirname(torch.__file__)


def dropout_is_identity(node: fx.Node) -> bool:
    """aten.dropout(x, p, train) that returns x: p == 0 or train False."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return (isinstance(p, (int, float)) and p == 0) or train is False


def source_line(node: fx.Node) -> str:
    """The user's source line of `node`: the innermost stack-trace frame outside torch."""
    trace = (node.meta.get(K.STACK_TRACE) or "").strip().splitlines()
    frames = [ln.strip() for ln in trace if ln.strip().startswith("File ")]
    user = [f for f in frames if _TORCH_DIR not in f]
    return (user or frames or ["(no stack trace)"])[-1]


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ----- reshape mapping --------------------------------------------------------------------------

def map_reshape(src: tuple[int, ...], dst: tuple[int, ...], lay: Shard, t: int) -> Shard | None:
    """The layout of reshape(x, dst) when x (shape src) is `lay`, or None if not expressible.

    Size-1 dims are ignored; the remaining dims are grouped into runs of equal products. Inside
    the group holding the split dim, the split is written on the flat index of the group
    (outer product Q, blocks scaled by the inner product P) and read back on the first output
    dim e that can express it: e outermost with every block divisible by t·P(e), or every block
    exactly one row of e (then e's own size is split, Q(e) times).
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
    inner = _prod(src[i] for i in gi[pos + 1:])
    outer = _prod(src[i] for i in gi[:pos])
    if lay.padded:
        return replace(lay, dim=go[0]) if len(gi) == 1 and len(go) == 1 else None
    flat = tuple(b * inner for b in lay.blocks) * outer
    whole = lay.flags() * outer
    src = lay.src * outer if lay.src is not None else None
    for k, e in enumerate(go):
        p_e = _prod(dst[j] for j in go[k + 1:])
        q_e = _prod(dst[j] for j in go[:k])
        # a whole block need not divide by t, only into rows of e
        if q_e == 1 and all(b % (p_e if w else t * p_e) == 0 for b, w in zip(flat, whole)):
            return replace(lay, dim=e, blocks=tuple(b // p_e for b in flat),
                           whole=whole if lay.whole else (), src=src)
        if lay.whole:
            continue
        if len(flat) == q_e and all(b == dst[e] * p_e for b in flat) and dst[e] % t == 0:
            return replace(lay, dim=e, blocks=(dst[e],), src=None)
    return None


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


# ----- the propagator ---------------------------------------------------------------------------

# numpy_T (`w.T`: all dims reversed) and mT (last two swapped) are how some models
# (transformers' Falcon, `x @ self.weight.T`) transpose a weight.
_CHAIN = _TRANSPARENT | {aten.t, aten.transpose, aten.permute, aten.numpy_T, aten.mT}


class Propagator:
    """One forward pass of layout propagation under a fixed set of disabled candidates.

    layout[node]  the node's layout (a tuple for multi-output nodes); get_attr values (and
                  transposes/copies of them) stay None until a consumer decides their layout.
    convert[node] {input node: layout this node needs it in}, where that differs from the input's
                  own layout (a collective or a local slice goes on that edge).
    role[node]    'column' | 'row' | 'vocab_embedding' | 'vocab_ce' for the rewritten ops.
    """

    def __init__(self, gm: fx.GraphModule, t: int, *, off: set[str], refine: dict,
                 sequence_parallel: bool, seq_len: int | None, vocab_multiple: int,
                 flop_per_byte: float = float("inf"), whole: dict | None = None):
        self.gm, self.t, self.off, self.refine = gm, t, off, refine
        self.whole = whole if whole is not None else {}   # origin -> its seed's whole flags
        self.sp, self.seq_len, self.vocab_multiple = sequence_parallel, seq_len, vocab_multiple
        self.flop_per_byte = flop_per_byte  # machine balance: FLOP one byte of comm costs
        self.by_name = {n.name: n for n in gm.graph.nodes}
        self.layout: dict[fx.Node, Any] = {}
        self.convert: dict[fx.Node, dict[fx.Node, Layout]] = {}
        self.role: dict[fx.Node, str] = {}
        self.notes: list[str] = []

    def run(self) -> "Propagator":
        for node in self.gm.graph.nodes:
            self.visit(node)
        for node in self.gm.graph.nodes:  # params nobody split stay replicated
            if self.layout.get(node) is None and node.op != "output":
                self.layout[node] = self._forward_chain(node) or R
        return self

    # -- reading and demanding layouts --

    def get(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            return R
        if node in self.layout and self.layout[node] is None:
            fwd = self._forward_chain(node)
            if fwd is not None:
                self.layout[node] = fwd
        return self.layout.get(node, R)

    def _is_chain(self, node: fx.Node) -> bool:
        return node.op == "call_function" and (packet(node) in _CHAIN
                                               or _singleton_view(node))

    def _forward_chain(self, node: fx.Node) -> Any:
        """Layout of a param-derived node once its get_attr root has one."""
        if node.op == "get_attr":
            return self.layout.get(node)
        if not self._is_chain(node):
            return None
        src = self._forward_chain(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        if not isinstance(src, Shard):
            return src
        return replace(src, dim=_chain_dim(node, src.dim, forward=True))

    def _assign(self, node: fx.Node, lay: Layout) -> None:
        self.layout[node] = lay
        if self._is_chain(node) and isinstance(node.args[0], fx.Node) \
                and self.layout.get(node.args[0], R) is None:
            dim = _chain_dim(node, lay.dim, forward=False) if isinstance(lay, Shard) else 0
            # a split broadcast dim reads the whole parameter on every rank
            up = (R if dim < 0 else replace(lay, dim=dim)) if isinstance(lay, Shard) else lay
            self._assign(node.args[0], up)

    def demand(self, consumer: fx.Node, arg: Any, want: Layout) -> None:
        """`consumer` needs `arg` in layout `want`: decide a param, or convert on the edge."""
        if not is_tensor(arg):
            return
        cur = self.get(arg)
        if cur is None:
            self._assign(arg, want)
            return
        have = self.convert.get(consumer, {}).get(arg, cur)
        if have == want and type(have) is type(want):
            return
        if isinstance(cur, Whole) and not (isinstance(want, Shard) and not want.seq):
            # a summand gradient cannot meet a consumer whose gradient is whole on every rank
            raise Conflict(cur.origins, consumer,
                           f"{consumer.name} ({packet(consumer)}) needs {arg.name} as {want} "
                           f"but it is held whole inside a split region")
        if isinstance(cur, Shard) and not cur.seq and not (
                isinstance(want, Shard) and want.dim == cur.dim and want.blocks == cur.blocks
                and want.flags() == cur.flags()):
            if cur.origins:
                conflict = Conflict(cur.origins, consumer,
                                    f"{consumer.name} ({packet(consumer)}) needs {arg.name} as "
                                    f"{want} but it is {cur}")
                if isinstance(want, Shard) and not want.seq:
                    self.hold_whole(cur, conflict)
                raise conflict
            self.notes.append(f"all-gather of {arg.name} {cur} for {consumer.name}")
        self.convert.setdefault(consumer, {})[arg] = want

    def hold_whole(self, lay: Shard, conflict: Conflict, which: list[int] | None = None
                   ) -> None:
        """`lay`, a piece of one fused column-parallel output, cannot be split the way its
        consumer needs (the one k/v head of multi-query attention where attention splits
        heads): raise a tentative Refine holding the seed blocks it comes from whole on every
        rank, the other blocks still split. Nothing when the piece cannot be traced to its
        seed's blocks, or when every block would be whole (no split left)."""
        origin = next(iter(lay.origins)) if len(lay.origins) == 1 else None
        seed = self.refine.get(origin) if origin else None
        if seed is None or len(seed) < 2 or lay.src is None or lay.seq or lay.padded:
            return
        held = [lay.src[i] for i in which] if which is not None else list(lay.src)
        flags = list(self.whole.get(origin) or (False,) * len(seed))
        if all(flags[i] for i in held):
            return
        for i in held:
            flags[i] = True
        if not all(flags):
            raise Refine(origin, seed, fallback=conflict, whole=tuple(flags))

    def refine_at(self, lay: Shard, cuts: set[int]) -> None:
        """Raise Refine cutting the one origin's seed at `cuts` (rows of `lay`'s split dim, a
        view of the whole seed: each row `scale` of the seed's columns, e.g. (B, T, (H+2)·d)
        viewed as (B, T, H+2, d)); nothing when `lay` is not such a view."""
        origin = next(iter(lay.origins)) if len(lay.origins) == 1 else None
        node = self.by_name.get(origin) if origin else None
        if node is None or lay.padded or lay.whole or lay.src is None:
            return
        seed = self.refine.get(origin, (shape(node)[-1],))
        if lay.src != tuple(range(len(seed))) or seed[0] % lay.blocks[0]:
            return
        scale = seed[0] // lay.blocks[0]
        if any(s != b * scale for s, b in zip(seed, lay.blocks)):
            return
        merged = sorted((set(_cumsum(list(lay.blocks))) | cuts) - {0})
        blocks = tuple((y - x) * scale for x, y in zip([0] + merged, merged))
        if blocks != seed:
            raise Refine(origin, blocks)

    def eff(self, consumer: fx.Node, arg: Any) -> Any:
        """The layout `consumer` sees for `arg` (after any conversion already decided)."""
        if not isinstance(arg, fx.Node):
            return R
        got = self.convert.get(consumer, {}).get(arg)
        return got if got is not None else self.get(arg)

    # -- dispatch --

    def visit(self, node: fx.Node) -> None:
        if node.op == "get_attr":
            self.layout[node] = None
            return
        if node.op == "placeholder":
            self.layout[node] = R
            return
        if node.op == "output":
            for arg in _tensor_args(node):
                self._resolve_partial(node, arg, allow_seq=False)
                if not self._gather_output(node, arg):
                    self.demand(node, arg, R)
            return
        if node.op != "call_function":
            self.layout[node] = _like(node, R)
            return
        args = _tensor_args(node)
        if self._is_chain(node) and all(self.get(a) is None for a in args) and args:
            self.layout[node] = None  # a copy / transpose of a parameter: decided by its use
            return
        if packet(node) in _NO_VALUE:
            self.layout[node] = R  # metadata assertions: no value, nothing to convert
            return
        if node.target is operator.getitem:
            src = self.get(node.args[0])
            self.layout[node] = src[node.args[1]] if isinstance(src, tuple) else src
            return
        if not self._keeps_partial(node):
            for arg in args:
                self._resolve_partial(node, arg, allow_seq=True)
        self._check_mixed(node, args)
        try:
            out = self._whole_only(node, args)
            if out is None:
                out = self._rule(node)
        except Conflict as c:
            if c.origins:
                raise      # the driver turns those candidates off and runs again
            # Nothing to turn off: the split is a sequence-parallel one (or a gathered
            # vocab shard) that this op cannot keep (routing's index/sort/scatter over all
            # tokens). Gather the inputs and compute the op whole, as every rank would on
            # one device, and say so (plan.explain()).
            out = self._gather_inputs(node, c)
        for arg in args:  # parameters no rule claimed are replicated
            if self.get(arg) is None:
                self._assign(arg, R)
        self.layout[node] = out

    def _check_mixed(self, node: fx.Node, args: list[fx.Node]) -> None:
        """A mixed projection's output (split and whole blocks side by side) is only viewed
        and cut into its parts (q / k / v): any other op on it conflicts."""
        op = packet(node)
        for a in args:
            lay = self.eff(node, a)
            if isinstance(lay, Shard) and lay.whole and op not in _RESHAPES \
                    and op not in SPLIT_OPS and op not in _SELECT \
                    and not (op in _TRANSPARENT and len(args) == 1):
                raise Conflict(lay.origins, node, f"{node.name} ({op}) reads {a.name}, split "
                               f"blocks next to whole ones ({lay})")

    def _whole_only(self, node: fx.Node, args: list[fx.Node]) -> Any:
        """An op reading a Whole value and nothing split: computed whole on every rank, and
        Whole itself (its backward is linear in the output's gradient, so a summand in gives a
        summand out; a replicated input that needs a gradient gets an f). None otherwise."""
        lays = [self.eff(node, a) for a in args]
        wholes = [l for l in lays if isinstance(l, Whole)]
        if not wholes or any(isinstance(l, (Shard, Partial)) for l in lays):
            return None
        out = Whole(origins=frozenset().union(*(l.origins for l in wholes)))
        return _like(node, out)

    def _gather_inputs(self, node: fx.Node, why: Conflict) -> Any:
        """`node` computed replicated from gathered inputs; a decision already taken for it
        in the failed rule (a role, a conversion) is dropped."""
        self.role.pop(node, None)
        self.convert.pop(node, None)
        for arg in _tensor_args(node):
            self._resolve_partial(node, arg, allow_seq=False)
        split = [a.name for a in _tensor_args(node) if is_split(self.get(a))]
        self.notes.append(f"gathered {', '.join(split) or 'its inputs'} for {node.name}: "
                          f"{why.reason} ({source_line(node)})")
        return _replicated(self, node)

    def _gather_output(self, out: fx.Node, arg: fx.Node) -> bool:
        """A split value returned by the graph (logits without a loss): keep its column-parallel
        origins split and all-gather the value (Megatron's gather_output) when the compute that
        saves beats the communication; else return False (the origins fall back to replicated).

        Per output row (N rows, an origin matmul with contraction K and V output columns, t ranks,
        b bytes per element): splitting saves 6·K·V·(1 - 1/t) FLOP (forward + both backward
        products) and costs an all-gather of V·b·(t-1)/t bytes plus the f all-reduce of the
        input gradient, 2·K·b·(t-1)/t bytes. Split iff 6·K·V / ((V + 2K)·b) >= flop_per_byte.
        """
        lay = self.get(arg)
        if not isinstance(lay, Shard) or lay.seq or not lay.origins or lay.whole:
            return False
        return self.gather_split_input(out, arg, "returned without a loss: column-parallel, "
                                                 "all-gathered at the output")

    def _gather_pays(self, lay: Shard, arg: fx.Node, at: fx.Node, why: str) -> float | None:
        """The FLOP per gathered byte that keeping `lay`'s column-parallel origins split and
        all-gathering `arg` saves (the worst origin; see _gather_output); None when an origin
        is not a weight matmul; raises Conflict on the origins when it is below the machine
        balance (replicated is cheaper)."""
        ratios = []
        for name in lay.origins:
            origin = self.by_name.get(name)
            if origin is None or packet(origin) not in MATMUL_OPS:
                return None
            x, w, _, w_k, w_n = _matmul_operands(origin)
            if w is None:
                return None
            k, v = shape(w)[w_k], shape(w)[w_n]
            b = origin.meta[K.VAL].element_size()
            ratios.append(6 * k * v / ((v + 2 * k) * b))
        worst = min(ratios)
        if worst < self.flop_per_byte:
            raise Conflict(lay.origins, self.by_name.get(min(lay.origins), at),
                           f"{why}: a column-parallel split plus an all-gather of {arg.name} "
                           f"saves {worst:.0f} FLOP per byte gathered, below the machine "
                           f"balance {self.flop_per_byte:.0f} FLOP/byte, so replicated is "
                           f"cheaper")
        return worst

    def gather_split_input(self, node: fx.Node, arg: fx.Node, why: str) -> bool:
        """All-gather `arg` (split by column-parallel origins) for `node` when that pays
        (_gather_pays), noting it; False when it cannot be priced (the caller demands R)."""
        lay = self.eff(node, arg)
        worst = self._gather_pays(lay, arg, node, why)
        if worst is None:
            return False
        self.notes.append(f"all-gather of {arg.name} {lay} for {node.name} ({why}; "
                          f"{worst:.0f} FLOP saved per byte gathered >= machine balance "
                          f"{self.flop_per_byte:.0f})")
        self.convert.setdefault(node, {})[arg] = R
        return True

    def _resolve_partial(self, node: fx.Node, arg: fx.Node, allow_seq: bool) -> None:
        if not isinstance(self.get(arg), Partial):
            return
        target: Layout = R
        shp = shape(arg)
        # a statistic over the split dim (partial_mean) scales split values: all-reduced whole
        if allow_seq and self.sp and self.role.get(arg) != "partial_mean" and shp \
                and len(shp) >= 3 and self.seq_len \
                and shp[1] == self.seq_len and self.seq_len % self.t == 0:
            target = Shard(1, (self.seq_len,), seq=True)
        self.convert.setdefault(node, {})[arg] = target

    def _keeps_partial(self, node: fx.Node) -> bool:
        args = _tensor_args(node)
        lays = [self.get(a) for a in args]
        if not any(isinstance(l, Partial) for l in lays):
            return False
        op = packet(node)
        if op in _RESHAPES or op in {aten.alias, aten.clone, aten.contiguous, aten.to,
                                     aten._to_copy, aten.type_as}:
            lay = lays[0] if isinstance(lays[0], Partial) else Partial()
            if lay.masked:          # bias·noise has the value's full shape: no reshape
                return shape(node) == shape(args[0])
            return not lay.biases or shape(node)[-1:] == shape(args[0])[-1:]
        if op in {aten.add, aten.add_, aten.sub} and len(args) == 2 \
                and node.kwargs.get("alpha", 1) == 1:
            # Σa + Σb = Σ(a + b): parallel attention / MLP branches (Falcon, GPT-NeoX) sum
            # before one reduction; a subtrahend's bias would need negating, so none there.
            # Only when the sum is each operand's one use: an operand reduced for another
            # user anyway (a sequential block's residual, also read by the next norm) saves
            # nothing, and the residual stream stays replicated as in Megatron.
            return (all(isinstance(l, Partial) for l in lays)
                    and all(len(a.users) == 1 for a in args)
                    and (op is not aten.sub or not lays[1].pending))
        # dropout of probability 0 (GPT-J's and GPT-NeoX's defaults) or not training is the
        # identity: a bias still to be added passes through it as through a view
        if op is aten.dropout and dropout_is_identity(node):
            return True
        # dropout of a biased sum: the biases are masked by the same noise (see Partial),
        # once; the rewriter draws the noise on the replicated stream
        if op is aten.dropout and len(args) == 1 and lays[0].biases and not lays[0].masked:
            return True
        # scaling by a number, or dropout with the replicated stream (every rank the same
        # mask: the sum's mask), is linear: unless a bias is still to be added
        if op in {aten.mul, aten.div, aten.neg, aten.dropout} and len(args) == 1:
            return not lays[0].pending
        # linear in the one Partial operand, the others replicated (no bias pending): each
        # expert's output scaled by its routing weight (mul), the rows picked back in token
        # order (index) and the k experts of a token summed (sum over a dim) — a mixture of
        # experts reduces once, after all of it, as a dense MLP after its row-parallel product.
        # Only for the Partial's one use: one reduced for another user anyway (an RMSNorm's
        # input, also read by its statistic) would be reduced twice.
        if op in {aten.mul, aten.index, aten.sum} and isinstance(lays[0], Partial) \
                and not lays[0].pending and len(args[0].users) == 1 \
                and all(isinstance(l, Replicate) for l in lays[1:]):
            return op is not aten.mul or len(args) == 2
        return False

    def _rule(self, node: fx.Node) -> Any:
        op = packet(node)
        lays = [self.eff(node, a) for a in _tensor_args(node)]
        parts = [l for l in lays if isinstance(l, Partial)]
        if parts and op is aten.dropout and parts[0].biases and not dropout_is_identity(node):
            return Partial(masked=tuple((b, node.name) for b in parts[0].biases))
        if parts:
            return Partial(tuple(b for l in parts for b in l.biases),
                           tuple(m for l in parts for m in l.masked))
        if is_grouped_mm(node):
            return _grouped_mm(self, node)
        handler = _RULES.get(op)
        if handler is not None:
            return handler(self, node)
        if is_pointwise(node):
            return _pointwise(self, node)
        return _replicated(self, node)


def _like(node: fx.Node, lay: Layout) -> Any:
    val = node.meta.get(K.VAL)
    if isinstance(val, (tuple, list)):
        return tuple(lay for _ in val)
    return lay


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    seen: set = set()

    def visit(a: Any) -> None:
        if isinstance(a, fx.Node):
            if a not in seen and (is_tensor(a) or isinstance(a.meta.get(K.VAL), (tuple, list))):
                seen.add(a)
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
    visit(node.args)
    visit(node.kwargs)
    if packet(node) is aten.type_as and len(out) == 2:
        out = out[:1]  # `other` only donates its dtype
    return out


def _singleton_view(node: fx.Node) -> bool:
    """A view or expand of a parameter that only adds, drops or broadcasts size-1 dims (an
    attention sink's (H,) -> (1, H, 1, 1) -> (B, H, T, 1)): its split dim maps through, so a
    per-head parameter is split with the heads its consumer splits."""
    op = packet(node)
    if op not in _RESHAPES and op is not aten.expand or not isinstance(node.args[0], fx.Node):
        return False
    src, dst = shape(node.args[0]), shape(node)
    if src is None or dst is None:
        return False
    if op is aten.expand:
        return len(dst) >= len(src) and all(
            a == b or a == 1 for a, b in zip(src, dst[len(dst) - len(src):]))
    return [d for d in src if d != 1] == [d for d in dst if d != 1]


def _singleton_dim(node: fx.Node, dim: int, forward: bool) -> int:
    """`dim` mapped through a `_singleton_view` (forward: input -> output); a broadcast or
    size-1 dim has no partner: -1."""
    src, dst = shape(node.args[0]), shape(node)
    if packet(node) is aten.expand:
        off = len(dst) - len(src)
        if forward:
            return dim + off
        return dim - off if dim >= off and src[dim - off] == dst[dim] else -1
    a, b = (src, dst) if forward else (dst, src)
    if a[dim] == 1:
        return -1
    k = sum(1 for d in a[:dim] if d != 1)
    return [i for i, d in enumerate(b) if d != 1][k]


def _chain_dim(node: fx.Node, dim: int, forward: bool) -> int:
    op = packet(node)
    if op not in _CHAIN and _singleton_view(node):
        return _singleton_dim(node, dim, forward)
    if op is aten.t:
        return 1 - dim if shape(node) and len(shape(node)) == 2 else dim
    if op is aten.transpose:
        nd = len(shape(node))
        a, b = norm_dim(node.args[1], nd), norm_dim(node.args[2], nd)
        return b if dim == a else a if dim == b else dim
    if op is aten.permute:
        perm = [norm_dim(p, len(shape(node))) for p in node.args[1]]
        return perm.index(dim) if forward else perm[dim]
    if op is aten.numpy_T:
        return len(shape(node)) - 1 - dim
    if op is aten.mT:
        nd = len(shape(node))
        return nd - 1 if dim == nd - 2 else nd - 2 if dim == nd - 1 else dim
    return dim


# ----- rules ------------------------------------------------------------------------------------
# Each rule reads its inputs' layouts with p.eff, may p.demand layouts of inputs (deciding a
# parameter's split, or putting a conversion on the edge), and returns the output's layout.

def _replicated(p: Propagator, node: fx.Node) -> Any:
    """An op with no rule: computed whole on every rank, from replicated inputs."""
    for arg in _tensor_args(node):
        p.demand(node, arg, R)
    return _like(node, R)


def _shards(p: Propagator, node: fx.Node, args: list[fx.Node]) -> list[tuple[fx.Node, Shard]]:
    return [(a, p.eff(node, a)) for a in args if isinstance(p.eff(node, a), Shard)]


def _union(lays: list[Shard]) -> frozenset:
    out: frozenset = frozenset()
    for l in lays:
        out |= l.origins
    return out


def _pointwise(p: Propagator, node: fx.Node) -> Layout:
    """out[i] = f(a[i], b[i], ...) with broadcasting: all split operands must agree on the
    (right-aligned) output dim; replicated operands broadcast along it or are sliced locally."""
    out_shape = shape(node)
    if out_shape is None:
        return _replicated(p, node)
    nd = len(out_shape)
    args = _tensor_args(node)
    shards = _shards(p, node, args)
    if not shards:
        return R
    dims = {l.dim + nd - len(shape(a)) for a, l in shards}
    first = shards[0][1]
    origins = _union([l for _, l in shards])
    if len(dims) > 1 or any(l.blocks != first.blocks or l.padded != first.padded
                            for _, l in shards):
        raise Conflict(origins, node, f"{node.name}: operands split differently "
                       f"({', '.join(f'{a.name}: {l}' for a, l in shards)})")
    od = dims.pop()
    if first.padded and packet(node) not in _TRANSPARENT:
        raise Conflict(origins, node, f"{node.name}: elementwise op on a padded vocab dim")
    target = replace(first, dim=od, origins=origins, seq=any(l.seq for _, l in shards))
    for a in args:
        if isinstance(p.eff(node, a), Shard):
            continue
        i = od - (nd - len(shape(a)))
        if i < 0 or shape(a)[i] == 1:
            if not isinstance(p.eff(node, a), Whole):   # Whole broadcast: a summand gradient
                p.demand(node, a, R)  # broadcast along the split dim: nothing to do
        else:
            p.demand(node, a, replace(target, dim=i))
    return target


def _reshape(p: Propagator, node: fx.Node) -> Layout:
    src = node.args[0]
    lay = p.eff(node, src)
    if not isinstance(lay, Shard):
        return lay
    mapped = map_reshape(shape(src), shape(node), lay, p.t)
    if mapped is None:
        factors = unflattened_sizes(shape(src), shape(node), lay.dim)
        why = (f"; dim {lay.dim} ({shape(src)[lay.dim]}) unflattens into {factors} and a split "
               f"must fall on the leading factor (e.g. the key/value groups of a fused qkv "
               f"projection): t must divide {factors[0]}") if factors else ""
        conflict = Conflict(lay.origins, node,
                            f"{node.name}: reshape {list(shape(src))} -> {list(shape(node))} "
                            f"cannot keep dim {lay.dim} split in {p.t} (blocks {lay.blocks}): "
                            f"sizes do not divide by t={p.t}{why}", indivisible=True)
        _hold_whole_for_reshape(p, node, lay, conflict)
        _refine_for_reshape(p, node, lay, conflict)
        raise conflict
    return mapped


def _hold_whole_for_reshape(p: Propagator, node: fx.Node, lay: Shard,
                            conflict: Conflict) -> None:
    """A fused output viewed into heads whose small blocks cannot be split by t (Falcon-7B's
    multi-query (B, T, (H+2)·d) -> (B, T, H+2, d): the one k and v head): hold those blocks
    whole (tentatively, Propagator.hold_whole) when that makes the view expressible."""
    src, dst = shape(node.args[0]), shape(node)
    for j in range(len(dst)):
        unit = _prod(dst[j + 1:])
        flags = tuple(w or b % (p.t * unit) != 0 for b, w in zip(lay.blocks, lay.flags()))
        if flags == lay.flags():
            continue
        if map_reshape(src, dst, replace(lay, whole=flags), p.t) is not None:
            p.hold_whole(lay, conflict, [i for i, f in enumerate(flags) if f])


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


def _refine_for_reshape(p: Propagator, node: fx.Node, lay: Shard, conflict: Conflict) -> None:
    """A fused output unflattened as (k, size/k) (PyTorch's MultiheadAttention in-projection:
    (…, 3E) → (…, 3, E)) keeps its split only if each of the k parts is split on its own: raise
    a tentative Refine with every block cut into k equal parts when that makes the reshape
    expressible. Tentative, because the same shapes arise where the inner part must stay whole
    (k/v heads fewer than t: (…, kv·d) → (…, kv, d) would split the head dim d): if the refined
    split conflicts later, the driver undoes it and reports `conflict`."""
    src, dst = shape(node.args[0]), shape(node)
    origin = next(iter(lay.origins)) if len(lay.origins) == 1 else None
    seed = p.refine.get(origin) if origin else None
    if origin is None or lay.padded or not (seed is None or seed == lay.blocks):
        return
    for k in sorted({d for d in dst if d > 1}):
        if any(b % (k * p.t) for b in lay.blocks):
            continue
        finer = tuple(b // k for b in lay.blocks for _ in range(k))
        if map_reshape(src, dst, replace(lay, blocks=finer), p.t) is not None:
            raise Refine(origin, finer, fallback=conflict)


def _expand(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return lay
    return replace(lay, dim=lay.dim + len(shape(node)) - len(shape(node.args[0])))


def _transpose(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return lay
    return replace(lay, dim=_chain_dim(node, lay.dim, forward=True))


def _split(p: Propagator, node: fx.Node) -> Any:
    """split/chunk: pieces along the split dim must be unions of whole blocks (refining the
    seed's blocks when they are not: fused qkv)."""
    src = node.args[0]
    lay = p.eff(node, src)
    vals = node.meta[K.VAL]
    if not isinstance(lay, Shard):
        return tuple(lay for _ in vals)
    nd = len(shape(src))
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
    if packet(node) is aten.unbind:
        dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
        if dim == lay.dim:
            raise Conflict(lay.origins, node, f"{node.name}: unbind along the split dim")
        return tuple(replace(lay, dim=lay.dim - (lay.dim > dim)) for _ in vals)
    if dim != lay.dim:
        return tuple(lay for _ in vals)
    sizes = [int(v.shape[dim]) for v in vals]
    cuts = set(_cumsum(sizes))
    bounds = set(_cumsum(list(lay.blocks)))
    if lay.padded or not cuts <= bounds:
        origin = next(iter(lay.origins)) if len(lay.origins) == 1 else None
        seed = p.refine.get(origin) if origin else None
        if origin and not lay.padded and (seed is None or seed == lay.blocks):
            merged = sorted(cuts | bounds)
            raise Refine(origin, tuple(b - a for a, b in zip([0] + merged, merged)))
        raise Conflict(lay.origins, node, f"{node.name}: split {sizes} cuts blocks "
                       f"{lay.blocks} of the split dim")
    pieces, start = [], 0
    offsets = [0] + _cumsum(list(lay.blocks))
    for size in sizes:
        pieces.append(_pick_blocks(lay, [i for i, o in enumerate(offsets[:-1])
                                         if start <= o < start + size]))
        start += size
    return tuple(pieces)


def _pick_blocks(lay: Shard, idx: list[int]) -> Shard | Whole:
    """The blocks `idx` of `lay` (a split piece or a selected range of its split dim): Whole
    when every one is held whole (the replicated part of a mixed projection: k, v)."""
    whole = tuple(lay.flags()[i] for i in idx)
    if all(whole):
        return Whole(origins=lay.origins)
    return replace(lay, blocks=tuple(lay.blocks[i] for i in idx),
                   whole=whole if any(whole) else (),
                   src=tuple(lay.src[i] for i in idx) if lay.src is not None else None)


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def _cat(p: Propagator, node: fx.Node) -> Layout:
    tensors = list(node.args[0])
    nd = len(shape(node))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), nd)
    tensors = [a for a in tensors if shape(a) and shape(a) != (0,)]
    shards = _shards(p, node, tensors)
    if not shards:
        return R
    first = shards[0][1]
    if first.dim == dim:
        if len(shards) != len(tensors):
            raise Conflict(_union([l for _, l in shards]), node,
                           f"{node.name}: cat along the split dim with replicated pieces")
        return replace(first, blocks=sum((l.blocks for _, l in shards), ()),
                       origins=_union([l for _, l in shards]))
    return _pointwise_same_shape(p, node, tensors, first)


def _pointwise_same_shape(p: Propagator, node: fx.Node, args: list, first: Shard) -> Layout:
    origins = _union([l for _, l in _shards(p, node, args)])
    target = replace(first, origins=origins)
    for a in args:
        p.demand(node, a, target)
    return target


def _slice(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return lay
    nd = len(shape(node.args[0]))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    if dim == lay.dim:
        if shape(node) == shape(node.args[0]):
            return lay  # a no-op slice (x[:, :T] with T the full size)
        conflict = Conflict(lay.origins, node, f"{node.name}: slices the split dim {dim}")
        sel = selected_range(p.gm, node)
        if sel is None:
            raise conflict
        return _select_blocks(p, lay, sel, conflict)
    if packet(node) is aten.select:
        return replace(lay, dim=lay.dim - (lay.dim > dim))
    return lay


def selected_range(gm: fx.GraphModule, node: fx.Node) -> tuple[int, int] | None:
    """[start, end) of the rows a slice / narrow (step 1) or an index by one constant tensor
    of consecutive values picks along its dim (global coordinates); None otherwise."""
    op, src = packet(node), shape(node.args[0])
    if op is aten.index:
        indices = list(node.args[1])
        dims = [i for i, ix in enumerate(indices) if ix is not None]
        value = _constant(gm, indices[dims[0]]) if len(dims) == 1 else None
        if value is None or value.dim() != 1 or not value.numel():
            return None
        size = src[dims[0]]
        rows = sorted(int(v) % size for v in value.tolist())
        ok = rows == list(range(rows[0], rows[0] + len(rows)))
        return (rows[0], rows[-1] + 1) if ok else None
    size = src[norm_dim(node.args[1], len(src))]
    if op is aten.narrow:
        start = node.args[2] % size
        return start, start + node.args[3]
    if op is not aten.slice or (len(node.args) > 4 and node.args[4] != 1):
        return None
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else size
    start, end = (v + size if v < 0 else v for v in (start, end))
    return min(start, size), min(end, size)


def _constant(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The value of a constant tensor (a get_attr, possibly through lift_fresh_copy / copies)."""
    while isinstance(node, fx.Node) and node.op == "call_function" \
            and packet(node) in _TRANSPARENT:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) and not value.is_meta else None


def _select_blocks(p: Propagator, lay: Shard, sel: tuple[int, int], conflict: Conflict) -> Any:
    """The rows [a, b) of the split dim: whole blocks are kept (Whole when all are held whole);
    a selection that cuts blocks refines the seed at its bounds (as split does) and runs
    again."""
    a, b = sel
    bounds = [0] + _cumsum(list(lay.blocks))
    if a in bounds and b in bounds and a < b:
        return _pick_blocks(lay, [i for i in range(len(lay.blocks))
                                  if a <= bounds[i] and bounds[i + 1] <= b])
    p.refine_at(lay, {a, b})
    raise conflict


def _repeat_interleave(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return _replicated(p, node)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    reps = node.args[1]
    if dim is None or not isinstance(reps, int):
        raise Conflict(lay.origins, node, f"{node.name}: repeat_interleave without a dim")
    dim = norm_dim(dim, len(shape(node)))
    if dim != lay.dim:
        return lay
    return replace(lay, blocks=tuple(b * reps for b in lay.blocks))


def _norm(p: Propagator, node: fx.Node) -> Any:
    """layer_norm / rms_norm: fine while the split dim is not one of the normalised dims; over
    a plainly split last dim the statistics are distributed (shard.tp_norm, role 'split_norm':
    the mean and the variance for LayerNorm, the mean square for RMSNorm, each one small
    all-reduce) and the weight and bias are split like x's last dim."""
    x = node.args[0]
    lay = p.eff(node, x)
    normalized = node.args[1]
    over_split = isinstance(lay, Shard) and lay.dim >= len(shape(x)) - len(normalized)
    if over_split and _splittable_norm(node, lay) and _fed_by_column(p, x):
        for a in _tensor_args(node)[1:]:
            p.demand(node, a, replace(lay, dim=0))
        p.role[node] = "split_norm"
        return lay
    for a in _tensor_args(node)[1:]:
        p.demand(node, a, R)
    if over_split:
        raise Conflict(lay.origins, node, f"{node.name}: normalises over the split dim")
    return _like(node, lay)


def _fed_by_column(p: Propagator, x: fx.Node) -> bool:
    """x is a column-parallel output through one-input elementwise ops only (BERT's transform:
    dense → gelu → LayerNorm). A norm of anything else split (a residual stream a fallen-back
    projection left split) conflicts instead: distributing it would carry the split on into
    the stream, where a replicated region is cheaper."""
    n = x
    while p.role.get(n) != "column":
        ins = _tensor_args(n) if n.op == "call_function" else []
        if len(ins) != 1 or not (is_pointwise(n) or packet(n) in _TRANSPARENT):
            return False
        n = ins[0]
    return True


def _splittable_norm(node: fx.Node, lay: Shard) -> bool:
    """layer_norm / rms_norm over the last dim only, split plainly (not the sequence, no
    vocab padding) — the norm shard.tp_norm computes with all-reduced statistics."""
    return (packet(node) in {aten.layer_norm, aten.rms_norm} and len(node.args[1]) == 1
            and lay.dim == len(shape(node.args[0])) - 1 and not lay.seq and not lay.padded)


def _softmax(p: Propagator, node: fx.Node) -> Layout:
    lay = p.eff(node, node.args[0])
    if isinstance(lay, Shard) and norm_dim(node.args[1], len(shape(node))) == lay.dim:
        if _feeds_only_nll(node, lay):
            return lay  # log_softmax → nll_loss: one vocab-parallel cross-entropy (see _nll)
        raise Conflict(lay.origins, node, f"{node.name}: softmax over the split dim")
    return lay


NLL_OPS = frozenset({aten.nll_loss, aten.nll_loss_nd})


def _feeds_only_nll(node: fx.Node, lay: Shard) -> bool:
    """log_softmax over the class dim whose every user is an unweighted nll_loss of it."""
    if packet(node) not in {aten.log_softmax, aten._log_softmax} or lay.seq or not node.users:
        return False
    class_dim = 1 if len(shape(node)) >= 2 else 0
    return lay.dim == class_dim and all(
        packet(u) in NLL_OPS and u.args[0] is node and _nll_weight(u) is None for u in node.users)


def _nll_weight(node: fx.Node) -> Any:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")


def _nll(p: Propagator, node: fx.Node) -> Layout:
    """nll_loss(log_softmax(logits split over the vocab)) = cross_entropy(logits): the same
    vocab-parallel cross-entropy; the log_softmax becomes dead code."""
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return _replicated(p, node)
    if not _feeds_only_nll(node.args[0], lay):
        raise Conflict(lay.origins, node, f"{node.name}: nll_loss of a split value that is not "
                       f"a log_softmax over the vocab (or with class weights)")
    p.demand(node, node.args[1], R)
    p.role[node] = "vocab_ce"
    return R


def reduce_dims(node: fx.Node) -> tuple[list[int], bool]:
    """(the non-negative dims a reduction `node` reduces over, keepdim); no dims or an empty
    list means all of them, as in aten."""
    nd = len(shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        dims = list(range(nd))
    dims = [norm_dim(d, nd) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    return dims, keep


def _reduce(p: Propagator, node: fx.Node) -> Any:
    lay = p.eff(node, node.args[0])
    if not isinstance(lay, Shard):
        return _like(node, lay)
    dims, keep = reduce_dims(node)
    if lay.dim in dims:
        if packet(node) is aten.sum and not lay.padded:
            return Partial()
        # only of a column-parallel output (OLMo-2's q/k RMSNorm over all heads): a mean of a
        # residual stream a projection left split (a dense MLP whose up projection fell back
        # making its down projection a column candidate) conflicts, as a norm does there
        if packet(node) is aten.mean and not lay.padded and not lay.seq \
                and _fed_by_column(p, node.args[0]):
            p.role[node] = "partial_mean"  # mean(x_local)/t per rank; summed = the global mean
            return Partial()
        if packet(node) is aten.mean and not lay.padded and not lay.seq:
            raise Conflict(lay.origins, node, f"{node.name}: a mean over the split dim of a "
                           f"value no column-parallel projection produced (a residual stream "
                           f"would stay split)")
        raise Conflict(lay.origins, node, f"{node.name}: reduces over the split dim")
    new_dim = lay.dim if keep else lay.dim - sum(d < lay.dim for d in dims)
    return _like(node, replace(lay, dim=new_dim))


def _matmul(p: Propagator, node: fx.Node) -> Layout:
    """Weight matmuls: column-parallel candidates, row-parallel when the input is split over the
    contraction dim. Activation products (attention): split batch dims must agree."""
    x, w, bias, w_k, w_n = _matmul_operands(node)
    if w is None:
        return _batched_matmul(p, node)
    xl = p.eff(node, x)
    k_dim = len(shape(x)) - 1
    out_nd = len(shape(node))
    wl = p.get(w)
    if isinstance(xl, Shard) and xl.dim == k_dim and not xl.seq and isinstance(wl, Shard) \
            and wl.dim == w_n and node.name not in p.off:
        # the weight is already split along its output (a vocabulary table tied to the
        # vocab-parallel embedding: BERT's MLM decoder after its split transform + LayerNorm):
        # gather the input if that pays, and stay vocab-parallel
        why = f"{node.name} reads a weight split along its output"
        if p.gather_split_input(node, x, why):
            xl = R
        else:
            p.demand(node, x, R)
    if isinstance(xl, Shard) and xl.dim == k_dim and not xl.seq:
        p.demand(node, w, replace(xl, dim=w_k))
        if bias is not None:
            p.demand(node, bias, R)
        p.role[node] = "row"
        return Partial((bias.name,) if bias is not None else ())
    # an output too narrow to split and smaller than one padding quantum (Qwen2-MoE's
    # one-wide shared-expert gate) stays replicated: padding it would cost more, as for a
    # small embedding table
    narrow = shape(w)[w_n] % p.t and shape(w)[w_n] < p.vocab_multiple \
        and node.name not in p.refine
    if node.name not in p.off and not (isinstance(xl, Shard) and not xl.seq) \
            and not is_router(node) and not narrow:
        n_size = shape(w)[w_n]
        blocks = p.refine.get(node.name, (n_size,))
        whole = p.whole.get(node.name, ())
        padded = 0
        if len(blocks) == 1 and n_size % p.t:
            padded = _round_up(n_size, p.vocab_multiple * p.t)
        elif any(b % p.t for b, held in zip(blocks, whole or (False,) * len(blocks))
                 if not held):
            raise Conflict(frozenset({node.name}), node,
                           f"{node.name}: output blocks {blocks} do not divide by t={p.t}",
                           indivisible=True)
        lay = Shard(w_n, blocks, padded, origins=frozenset({node.name}), whole=whole,
                    src=tuple(range(len(blocks))))
        p.demand(node, x, R)
        p.demand(node, w, lay)
        if bias is not None:
            p.demand(node, bias, replace(lay, dim=0))
        p.role[node] = "column"
        return replace(lay, dim=out_nd - 1)
    p.demand(node, w, R)
    if bias is not None:
        p.demand(node, bias, R)
    if isinstance(xl, Shard) and xl.seq:
        # A replicated (fallen-back) weight matmul in a sequence-parallel region reads the
        # all-gathered full sequence, as the column-parallel ones do: its output may feed work
        # that mixes positions (k/v of attention when t > kv_heads), which a sequence split
        # cannot serve. Its weight gradient is then whole on every rank (no all-reduce).
        p.demand(node, x, R)
        return R
    if isinstance(xl, Shard):
        return replace(xl, dim=xl.dim + out_nd - len(shape(x)))
    return R


GROUPED_MM = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})


def is_grouped_mm(node: fx.Node) -> bool:
    """A grouped matmul (x (N, K) rows sorted by group, w (G, K, M), offs): row block g of x
    times w[g] — how transformers runs a mixture of experts (experts.gate_up_proj /
    experts.down_proj, 3-D parameters) on the tokens sorted by expert."""
    name = getattr(node.target, "name", None)
    return node.op == "call_function" and callable(name) and name() in GROUPED_MM


def _group_offs(node: fx.Node) -> Any:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")


def fed_by_grouped_mm(node: fx.Node) -> bool:
    """Whether the nearest matmul upstream of grouped matmul `node`'s rows is a grouped one of
    the same experts (grouping its rows by the same offs: the experts' down projection, fed by
    their gate/up projection). The previous layer's experts, reached through the residual
    stream, do not count: the next layer's gate/up projection reads fresh tokens."""
    seen, todo = set(), [node.args[0]]
    while todo:
        x = todo.pop()
        if not isinstance(x, fx.Node) or x in seen or x.op != "call_function":
            continue
        seen.add(x)
        if is_grouped_mm(x):
            if _group_offs(x) is _group_offs(node):
                return True
            continue
        if packet(x) not in MATMUL_OPS:
            todo.extend(x.all_input_nodes)
    return False


def _grouped_mm(p: Propagator, node: fx.Node) -> Layout:
    """Expert tensor parallelism: every expert's FFN split as a dense MLP is. A grouped matmul
    of replicated rows by a 3-D weight is a column-parallel candidate (w split along its output
    dim, each expert's columns alike; the gate/up halves refined into blocks by the chunk that
    follows); one whose rows are split over the contraction dim is row-parallel (w split along
    its contraction dim) and its output Partial, reduced once after the routing weights and the
    sum over the k chosen experts (Propagator._keeps_partial). The group offsets, the router and
    top-k stay replicated."""
    x, w = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    if not (_param_root(w) and shape(w) and len(shape(w)) == 3 and shape(x)
            and len(shape(x)) == 2) or node.kwargs.get("bias") is not None:
        return _replicated(p, node)
    xl = p.eff(node, x)
    if isinstance(xl, Shard) and xl.dim == 1 and not xl.seq:
        p.demand(node, w, replace(xl, dim=1))
        p.demand(node, offs, R)
        p.role[node] = "row"
        return Partial()
    # the experts' down projection is row-parallel or replicated, never a column candidate
    # (its gate/up fallen back: the experts stay whole, not split along the hidden dim)
    if node.name not in p.off and not isinstance(xl, Shard) and not fed_by_grouped_mm(node):
        blocks = p.refine.get(node.name, (shape(w)[2],))
        if any(b % p.t for b in blocks):
            raise Conflict(frozenset({node.name}), node,
                           f"{node.name}: expert output blocks {blocks} do not divide by "
                           f"t={p.t}", indivisible=True)
        lay = Shard(2, blocks, origins=frozenset({node.name}))
        p.demand(node, x, R)
        p.demand(node, w, lay)
        p.demand(node, offs, R)
        p.role[node] = "column"
        return replace(lay, dim=1)
    return _replicated(p, node)


def is_router(node: fx.Node) -> bool:
    """A mixture-of-experts router: a weight matmul whose scores reach a top-k (through casts
    and a softmax / sigmoid) — replicated, never a column candidate: the top-k reads every
    expert's score (the experts themselves are split, see _grouped_mm)."""
    todo, seen = list(node.users), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        op = packet(n)
        if op is aten.topk:
            return True
        if op in _TRANSPARENT or op in _SOFTMAX or op is aten.sigmoid \
                or n.target is operator.getitem:
            todo.extend(n.users)
    return False


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _matmul_operands(node: fx.Node) -> tuple:
    """(activation, weight, bias, weight's contraction dim, weight's output dim); weight None
    when the second operand is not a parameter (possibly transposed / copied)."""
    op = packet(node)
    if op is aten.linear:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        wk, wn = 1, 0
    elif op is aten.addmm:
        bias, x, w = node.args[0], node.args[1], node.args[2]
        wk, wn = 0, 1
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return x, None, None, 0, 0
    else:
        x, w, bias = node.args[0], node.args[1], None
        wk, wn = 0, 1
    if not (_param_root(w) and shape(w) and len(shape(w)) == 2):
        return x, None, None, 0, 0
    if bias is not None and not _param_root(bias):
        return x, None, None, 0, 0
    return x, w, bias, wk, wn


def _param_root(node: Any) -> fx.Node | None:
    while isinstance(node, fx.Node):
        if node.op == "get_attr":
            return node
        if node.op != "call_function" or packet(node) not in _CHAIN:
            return None
        node = node.args[0]
    return None


def _batched_matmul(p: Propagator, node: fx.Node, a: Any = None, b: Any = None) -> Layout:
    if a is None:
        a, b = node.args[0], node.args[1]
    la, lb = p.eff(node, a), p.eff(node, b)
    na, nb, nd = len(shape(a)), len(shape(b)), len(shape(node))
    if not isinstance(la, Shard) and not isinstance(lb, Shard):
        p.demand(node, a, R); p.demand(node, b, R)
        return R
    if isinstance(la, Shard) and isinstance(lb, Shard) and la.dim == na - 1 \
            and lb.dim == nb - 2 and la.blocks == lb.blocks:
        return Partial()  # contraction over the split dim
    # a split batch dim: the other operand must be split (or broadcast) along the same dim
    for lay, nsrc in ((la, na), (lb, nb)):
        if isinstance(lay, Shard) and nsrc >= 3 and lay.dim < nsrc - 2:
            od = lay.dim + nd - nsrc
            target = replace(lay, dim=od, origins=_union([l for l in (la, lb)
                                                          if isinstance(l, Shard)]))
            for arg, n_arg in ((a, na), (b, nb)):
                i = od - (nd - n_arg)
                if i < 0 or shape(arg)[i] == 1:
                    if not isinstance(p.eff(node, arg), Shard):
                        p.demand(node, arg, R)
                else:
                    p.demand(node, arg, replace(target, dim=i))
            return target
    if isinstance(la, Shard) and la.dim == na - 2:
        p.demand(node, b, R)
        return replace(la, dim=nd - 2)
    if isinstance(lb, Shard) and lb.dim == nb - 1:
        p.demand(node, a, R)
        return replace(lb, dim=nd - 1)
    return _replicated(p, node)


def _baddbmm(p: Propagator, node: fx.Node) -> Layout:
    """baddbmm(input, b1, b2) = beta·input + alpha·(b1 @ b2) (BLOOM's ALiBi attention scores):
    the product as a batched matmul; `input` is added elementwise, so it must follow the
    product's layout (sliced, or broadcast along the split dim)."""
    inp, b1, b2 = node.args[:3]
    lay = _batched_matmul(p, node, b1, b2)
    if isinstance(lay, Partial):
        raise Conflict(_union([l for l in (p.eff(node, b1), p.eff(node, b2))
                               if isinstance(l, Shard)]), node,
                       f"{node.name}: baddbmm contracts over the split dim and adds an input")
    if not isinstance(lay, Shard):
        p.demand(node, inp, R)
        return lay
    i = lay.dim - (len(shape(node)) - len(shape(inp)))
    if i < 0 or shape(inp)[i] == 1:
        p.demand(node, inp, R)
    else:
        p.demand(node, inp, replace(lay, dim=i))
    return lay


def _index(p: Propagator, node: fx.Node) -> Layout:
    """x[..., idx, ...] with one index tensor (Falcon's qkv[:, :, :, [-2]]): the indexed dim
    is replaced by the index's dims; fine while that is not the split dim."""
    x, indices = node.args[0], list(node.args[1])
    lay = p.eff(node, x)
    tensors = [i for i, ix in enumerate(indices) if ix is not None]
    if not isinstance(lay, Shard):
        return _replicated(p, node)
    d = tensors[0] if len(tensors) == 1 else None
    conflict = Conflict(lay.origins, node, f"{node.name}: indexes the split dim {lay.dim} "
                        f"(or several dims at once)")
    if d is not None and d == lay.dim and not lay.padded:
        sel = selected_range(p.gm, node)   # a constant run of rows: whole blocks of a fused
        if sel is not None:                # output (Falcon's multi-query k: [..., [-2], :])
            p.demand(node, indices[d], R)
            return _select_blocks(p, lay, sel, conflict)
    if d is None or d == lay.dim or lay.padded:
        raise conflict
    p.demand(node, indices[d], R)
    extra = len(shape(indices[d])) - 1
    return replace(lay, dim=lay.dim + (extra if lay.dim > d else 0))


def _stack(p: Propagator, node: fx.Node) -> Layout:
    """stack(xs, dim) = cat of xs unsqueezed at dim (GPT-J's rotate_every_two): the pieces
    must share one layout; the split dim shifts past the new one."""
    tensors = list(node.args[0])
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0),
                    len(shape(node)))
    shards = _shards(p, node, tensors)
    if not shards:
        return R
    lay = _pointwise_same_shape(p, node, tensors, shards[0][1])
    return replace(lay, dim=lay.dim + (lay.dim >= dim))


def _embedding(p: Propagator, node: fx.Node) -> Layout:
    """Vocab-parallel embedding: rank r holds rows [r·V/t, (r+1)·V/t), looks up the ids it owns
    (others → 0) and the partial results are summed (Partial).

    A table of per-head attention biases (T5's relative position bias: ids computed from
    positions, not read from the inputs, and the lookup feeds an attention mask) splits by
    columns instead: rank r holds its heads' columns and looks up all ids, Shard(last dim),
    with no reduction; the attention takes the bias split by heads."""
    w, ids = node.args[0], node.args[1]
    if node.name in p.off or not _param_root(w):
        p.demand(node, w, R)
        lay = p.eff(node, ids)
        return lay if isinstance(lay, Shard) else R
    cols = shape(w)[1]
    if cols % p.t == 0 and not _reads_inputs(ids) and _feeds_attention_mask(node):
        origin = frozenset({node.name})
        p.demand(node, ids, R)
        p.demand(node, w, Shard(1, (cols,), origins=origin))
        return Shard(len(shape(node)) - 1, (cols,), origins=origin)
    vocab = shape(w)[0]
    if vocab % p.t and vocab < p.vocab_multiple:
        p.demand(node, w, R)  # a small table (e.g. token types): padding would cost more
        return R
    p.demand(node, ids, R)
    padded = _round_up(vocab, p.vocab_multiple * p.t) if vocab % p.t else 0
    p.demand(node, w, Shard(0, (vocab,), padded, origins=frozenset({node.name})))
    p.role[node] = "vocab_embedding"
    return Partial()


def ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it reads, transitively."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _reads_inputs(node: fx.Node) -> bool:
    """Whether `node` depends on a graph input (token ids do; positions from arange do not)."""
    return any(n.op == "placeholder" for n in ancestors(node))


_MASK_HOPS = 16   # ops between a bias lookup and the attention it masks (T5: permute, add, ...)


def _feeds_attention_mask(node: fx.Node) -> bool:
    """Whether `node`'s value reaches the attn_mask of a scaled-dot-product attention within
    _MASK_HOPS ops (through views and additions: a bias added to the scores)."""
    frontier, seen = [node], {node}
    for _ in range(_MASK_HOPS):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.target is aten.scaled_dot_product_attention.default:
                    mask = u.args[3] if len(u.args) > 3 else u.kwargs.get("attn_mask")
                    if mask is n:
                        return True
                elif u not in seen:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


def _sdpa(p: Propagator, node: fx.Node) -> Layout:
    """Attention is independent per head: q, k, v split along the heads dim (ndim-3); the mask
    broadcasts over heads or is sliced."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    lays = [p.eff(node, a) for a in (q, k, v)]
    shards = [l for l in lays if isinstance(l, Shard)]
    if not shards:
        return _replicated(p, node)
    hd = len(shape(q)) - 3
    origins = _union(shards)
    if any(l.dim != hd or l.seq for l in shards):
        # blame the inputs split wrongly (a separate k projection of fewer heads than t, split
        # along the head dim), not the query split by heads beside them
        wrong = _union([l for l in shards if l.dim != hd or l.seq])
        conflict = Conflict(wrong if wrong and any(l.dim == hd and not l.seq for l in shards)
                            else origins, node,
                            f"{node.name}: attention split along a non-head dim")
        for l in shards:
            if l.dim != hd and not l.seq:   # k/v of fewer heads than t: held whole instead
                p.hold_whole(l, conflict)
        raise conflict
    gqa = bool(node.kwargs.get("enable_gqa", False))
    q_local = shape(q)[hd] // p.t if isinstance(lays[0], Shard) else None
    for arg in (q, k, v):
        if isinstance(p.eff(node, arg), Whole) and q_local and (
                shape(arg)[hd] == 1 or (gqa and q_local % shape(arg)[hd] == 0)):
            continue    # whole k/v heads shared by the local query heads (broadcast / GQA)
        if not isinstance(p.eff(node, arg), Shard):
            heads = shape(arg)[hd]
            if heads % p.t:
                raise Conflict(origins, node, f"{node.name}: {heads} heads of {arg.name} do not "
                               f"divide by t={p.t}", indivisible=True)
            p.demand(node, arg, Shard(hd, (heads,), origins=origins))
    if isinstance(mask, fx.Node):
        i = hd - (len(shape(q)) - len(shape(mask)))
        if i < 0 or shape(mask)[i] == 1:
            p.demand(node, mask, R)
        else:
            p.demand(node, mask, Shard(i, (shape(mask)[i],), origins=origins))
    ql = lays[0] if isinstance(lays[0], Shard) else p.eff(node, q)
    return replace(ql, origins=origins)


def _cross_entropy(p: Propagator, node: fx.Node) -> Layout:
    """cross_entropy(logits split over the vocab) → vocab-parallel cross-entropy (Replicate)."""
    logits = node.args[0]
    lay = p.eff(node, logits)
    if not isinstance(lay, Shard):
        return _replicated(p, node)
    class_dim = 1 if len(shape(logits)) >= 2 else 0
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if lay.dim != class_dim or lay.seq:
        return _replicated(p, node)
    if weight is not None or smoothing:
        raise Conflict(lay.origins, node, f"{node.name}: cross-entropy with "
                       f"{'class weights' if weight is not None else 'label smoothing'} has no "
                       f"vocab-parallel form here; the LM head stays replicated")
    p.demand(node, node.args[1], R)
    p.role[node] = "vocab_ce"
    return R


_RULES = {
    **{op: _reshape for op in (aten.view, aten.reshape, aten._unsafe_view, aten.flatten,
                               aten.unflatten, aten.squeeze, aten.unsqueeze)},
    aten.expand: _expand, aten.broadcast_to: _expand,
    aten.index: _index, aten.stack: _stack, aten.baddbmm: _baddbmm,
    aten.transpose: _transpose, aten.t: _transpose, aten.permute: _transpose,
    aten.numpy_T: _transpose, aten.mT: _transpose,
    **{op: _split for op in SPLIT_OPS},
    aten.cat: _cat,
    aten.slice: _slice, aten.select: _slice, aten.narrow: _slice,
    aten.repeat_interleave: _repeat_interleave,
    aten.layer_norm: _norm, aten.native_layer_norm: _norm, aten.rms_norm: _norm,
    **{op: _softmax for op in _SOFTMAX},
    **{op: _reduce for op in _REDUCE_DIM},
    **{op: _matmul for op in MATMUL_OPS},
    aten.embedding: _embedding,
    aten.scaled_dot_product_attention: _sdpa,
    aten.cross_entropy_loss: _cross_entropy,
    **{op: _nll for op in NLL_OPS},
}


# ----- the context mode: the sequence split as a layout -----------------------------------------
# The same engine over the context "mesh dim" (t := c), on the captured single-device graph:
# the inputs' token dims are seeded Shard(1, (T,), seq=True), no column candidates are offered
# (every weight stays whole), and the rules above carry the split through token-wise ops,
# reshapes (blocks of T per row of a merged (B·T) dim), transposes, split / cat, norms and
# reductions over other dims. Three resolutions differ from the tensor-parallel ones:
#   a whole operand that meets the rank's tokens (a rotary table, a position embedding, a mask
#     built from arange(T)) is selected at the rank's global positions: a convert edge
#     R -> Shard(seq) (context_select), never a communication;
#   attention (sdpa, or written out as q·kᵀ / p·v products) keeps its queries local and reads
#     its keys and values whole: convert edges Shard(seq) -> R recorded in `gathered`
#     (context_gather), the only place the rank needs other ranks' tokens;
#   anything the tensor-parallel engine would gather (an op with no rule, a softmax / norm /
#     cumulative op / sort along the tokens) or reduce (a sum over them) is refused in one line
#     naming the node and the user's source line.
# A token-mean loss over the rank's tokens keeps role "context_loss" (context_loss_mean).

_CONTEXT_FIX = ("the pass splits token-wise ops and attention (scaled_dot_product_attention, "
                "or q·kᵀ / p·v matmuls) only — run this model with c=1")


def context_refusal(node: fx.Node, why: str, fix: str = _CONTEXT_FIX) -> ValueError:
    """The one-line ValueError of a model the sequence split cannot run: the node, its op, the
    user's source line (the last frame of its stack trace and that frame's code) and `fix`."""
    trace = node.meta.get(K.STACK_TRACE) or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    files = [ln for ln in lines if ln.startswith("File ")]
    where = "(no source line recorded)"
    if files:
        i = lines.index(files[-1])
        code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
        where = files[-1] + (f": {code}" if code else "")
    return ValueError(f"context parallelism: node {node.name} ({packet(node)}) at {where}: "
                      f"{why}; {fix}")


_LOSS_OPS = frozenset({aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd})
_ALONG = frozenset({aten.topk, aten.sort, aten.argsort})   # per-token picks along another dim


class ContextPropagator(Propagator):
    """Propagator in the context mode (see above): `layout[node]` is Shard(dim, blocks, seq)
    where the node holds the rank's tokens along `dim`, R where it is whole on every context
    rank; `convert[node][arg]` = Shard(seq) marks a selection at the rank's positions,
    `gathered[node]` the keys / values attention reads whole."""

    def __init__(self, gm: fx.GraphModule, c: int, seq_len: int):
        names = {n.name for n in gm.graph.nodes}
        super().__init__(gm, c, off=names, refine={}, sequence_parallel=False,
                         seq_len=seq_len, vocab_multiple=1)
        self.gathered: dict[fx.Node, list[fx.Node]] = {}

    def visit(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            s = shape(node)
            self.layout[node] = (Shard(1, (self.seq_len,), seq=True)
                                 if s is not None and len(s) >= 2 and s[1] == self.seq_len
                                 else R)
            return
        super().visit(node)
        lay = self.layout.get(node)
        if any(isinstance(x, Partial) for x in (lay if isinstance(lay, tuple) else (lay,))):
            raise context_refusal(node, "a reduction over the sequence inside the model")

    def _rule(self, node: fx.Node) -> Any:
        op = packet(node)
        if not any(isinstance(self.eff(node, a), Shard) for a in _tensor_args(node)):
            return super()._rule(node)
        handler = _CONTEXT_RULES.get(op)
        if handler is not None:
            return handler(self, node)
        return super()._rule(node)

    def demand(self, consumer: fx.Node, arg: Any, want: Layout) -> None:
        """Whole operands meeting the rank's tokens are selected (an edge R -> Shard(seq));
        a split operand demanded whole is refused (attention's gathers do not come here)."""
        if not is_tensor(arg):
            return
        cur = self.get(arg)
        if cur is None:
            self._assign(arg, R)
            cur = R
        cur = self.convert.get(consumer, {}).get(arg, cur)
        if isinstance(cur, Shard) and isinstance(want, Shard) and cur.dim == want.dim:
            return
        if isinstance(cur, Replicate) and isinstance(want, Replicate):
            return
        if isinstance(cur, Replicate) and isinstance(want, Shard):
            if shape(arg)[want.dim] != self.seq_len:
                raise context_refusal(consumer, f"its operand {arg.name} of shape "
                                                f"{shape(arg)} meets the rank's tokens along "
                                                f"dim {want.dim} with a length other than the "
                                                f"sequence's {self.seq_len}")
            self.convert.setdefault(consumer, {})[arg] = replace(want, blocks=(self.seq_len,))
            return
        raise context_refusal(consumer, f"it needs {arg.name} ({cur}) as {want}: an op the "
                                        f"sequence split has no rule for")

    def gather(self, consumer: fx.Node, arg: fx.Node) -> None:
        """Attention reads `arg` (the rank's tokens) whole: context_gather on this edge."""
        self.convert.setdefault(consumer, {})[arg] = R
        self.gathered.setdefault(consumer, []).append(arg)

    def _gather_inputs(self, node: fx.Node, why: Conflict) -> Any:
        """Where the tensor-parallel engine would gather a sequence split and compute whole
        (a softmax, norm or cumulative op over it): refused, the tokens stay where they are."""
        raise context_refusal(node, why.reason.split(": ", 1)[-1].replace("split dim",
                                                                         "sequence"))


def _context_matmul(p: ContextPropagator, node: fx.Node) -> Layout:
    """A weight product is token-wise unless it contracts the tokens; an activation product
    is attention's (`_context_product`)."""
    x, w, bias, _, _ = _matmul_operands(node)
    if w is None:
        return _context_product(p, node, node.args[0], node.args[1])
    p.demand(node, w, R)
    if bias is not None:
        p.demand(node, bias, R)
    xl = p.eff(node, x)
    if xl.dim == len(shape(x)) - 1:
        raise context_refusal(node, "a projection contracting the rank's tokens")
    return replace(xl, dim=xl.dim + len(shape(node)) - len(shape(x)))


def _context_product(p: ContextPropagator, node: fx.Node, a: Any, b: Any) -> Layout:
    """a @ b written out (q·kᵀ, p·v): the queries (a) stay local, split keys / values (b, the
    rank's tokens along one of its last two dims) are read whole."""
    la, lb = p.eff(node, a), p.eff(node, b)
    na, nb, nd = len(shape(a)), len(shape(b)), len(shape(node))
    if isinstance(lb, Shard):
        if not isinstance(la, Shard):
            raise context_refusal(node, "a product whose right operand holds the rank's tokens")
        if lb.dim not in (nb - 1, nb - 2):
            raise context_refusal(node, "a product split along a batch dim of its right "
                                        "operand")
        p.gather(node, b)
    if not isinstance(la, Shard):
        raise context_refusal(node, "a product whose queries are whole but keys split")
    if la.dim == na - 1:
        raise context_refusal(node, "a product contracting the rank's tokens")
    return replace(la, dim=nd - (na - la.dim))


def _context_baddbmm(p: ContextPropagator, node: fx.Node) -> Layout:
    """bias + a @ b (BLOOM's ALiBi): the product as attention's; the bias follows it."""
    bias = node.args[0]
    lay = _context_product(p, node, node.args[1], node.args[2])
    i = lay.dim - (len(shape(node)) - len(shape(bias)))
    p.demand(node, bias, R if i < 0 or shape(bias)[i] == 1 else replace(lay, dim=i))
    return lay


def _context_sdpa(p: ContextPropagator, node: fx.Node) -> Layout:
    """Queries local, keys and values read whole, the mask's query rows selected."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    rows = len(shape(q)) - 2
    for arg in (q, k, v):
        lay = p.eff(node, arg)
        if not isinstance(lay, Shard) or lay.dim != len(shape(arg)) - 2:
            raise context_refusal(node, "attention whose queries, keys and values are not "
                                        "all split along their tokens")
    p.gather(node, k)
    p.gather(node, v)
    if isinstance(mask, fx.Node):
        if isinstance(p.eff(node, mask), Shard):
            raise context_refusal(node, "a mask that depends on the rank's tokens")
        i = rows - (len(shape(q)) - len(shape(mask)))
        p.demand(node, mask, R if i < 0 or shape(mask)[i] == 1
                 else Shard(i, (p.seq_len,), seq=True))
    return p.eff(node, q)


def _context_loss(p: ContextPropagator, node: fx.Node) -> Layout:
    """A token-mean loss over (B·T, V) logits and (B·T,) targets split along their token dim
    0: the rank's share (context_loss_mean), whole."""
    if any(not isinstance(p.eff(node, a), Shard) or p.eff(node, a).dim != 0
           for a in node.args[:2]):
        raise context_refusal(node, "a loss over values not split along their token dim 0")
    p.role[node] = "context_loss"
    return R


def _context_along(p: ContextPropagator, node: fx.Node) -> Any:
    """topk / sort / argsort along another dim than the tokens (a router's pick of experts)."""
    lay = p.eff(node, node.args[0])
    nd = len(shape(node.args[0]))
    at = 2 if packet(node) is aten.topk else 1
    dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", -1)
    if norm_dim(dim, nd) == lay.dim:
        raise context_refusal(node, "a sort along the sequence")
    return _like(node, lay)


def _context_softmax(p: ContextPropagator, node: fx.Node) -> Layout:
    """softmax / cumsum along another dim than the tokens."""
    lay = p.eff(node, node.args[0])
    if norm_dim(node.args[1], len(shape(node))) == lay.dim:
        raise context_refusal(node, "a softmax / cumulative op along the sequence")
    return lay


def _context_cat(p: ContextPropagator, node: fx.Node) -> Layout:
    """An empty key / value cache (transformers' DynamicCache with nothing cached)
    concatenated with the new tokens is the new tokens."""
    pieces = [a for a in node.args[0] if not (shape(a) and 0 in shape(a))]
    if len(pieces) == 1 and isinstance(p.eff(node, pieces[0]), Shard):
        return p.eff(node, pieces[0])
    return _cat(p, node)


_CONTEXT_RULES = {
    **{op: _context_matmul for op in MATMUL_OPS},
    aten.baddbmm: _context_baddbmm,   # (bmm is in MATMUL_OPS)
    aten.scaled_dot_product_attention: _context_sdpa,
    **{op: _context_loss for op in _LOSS_OPS},
    **{op: _context_along for op in _ALONG},
    **{op: _context_softmax for op in _SOFTMAX},
    aten.cat: _context_cat,
}


def context_layouts(gm: fx.GraphModule, c: int, seq_len: int) -> ContextPropagator:
    """The sequence split of the captured single-device graph `gm` over c context ranks, as
    the engine's layouts (ContextPropagator); raises context_refusal's ValueError where the
    split cannot run."""
    return ContextPropagator(gm, c, seq_len).run()
