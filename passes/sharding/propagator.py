"""The propagator: one forward pass of layout propagation over an ATen graph under a fixed set of
disabled column candidates (the driver, passes/tp_layouts.py `propagate_sharding`, reruns
it on Conflict / Refine). It reads and demands layouts, keeps a Partial where the op is linear in
it, gathers what no candidate can be turned off for, and dispatches every other op to the rule
table (passes/sharding/rules.py).
"""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.sharding.layout import (R, Conflict, Layout, Partial, Refine, Shard, Whole,
                                            cumsum, is_split)
from autopar.passes.sharding.ops import (CHAIN_OPS, MATMUL_OPS, NO_VALUE, RESHAPES, SELECT_OPS,
                                         SPLIT_OPS, TRANSPARENT, chain_dim, is_tensor, like,
                                         matmul_operands, packet, shape, singleton_view,
                                         source_line, tensor_args)
from autopar.passes.sharding.partials import keeps_partial, partial_sum
from autopar.passes.sharding.rules import replicated, rule_for


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
        """Why this size: one run's fixed inputs — the driver's state (disabled candidates,
        refined and whole seeds) and the mode (sequence parallelism, its length, vocabulary
        padding, machine balance) — keyword-only, set by tp_layouts._settle or the context mode."""
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
        return node.op == "call_function" and (packet(node) in CHAIN_OPS
                                               or singleton_view(node))

    def _forward_chain(self, node: fx.Node) -> Any:
        """Layout of a param-derived node once its get_attr root has one."""
        if node.op == "get_attr":
            return self.layout.get(node)
        if not self._is_chain(node):
            return None
        src = self._forward_chain(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        if not isinstance(src, Shard):
            return src
        return replace(src, dim=chain_dim(node, src.dim, forward=True))

    def assign(self, node: fx.Node, lay: Layout) -> None:
        self.layout[node] = lay
        if self._is_chain(node) and isinstance(node.args[0], fx.Node) \
                and self.layout.get(node.args[0], R) is None:
            dim = chain_dim(node, lay.dim, forward=False) if isinstance(lay, Shard) else 0
            # a split broadcast dim reads the whole parameter on every rank
            up = (R if dim < 0 else replace(lay, dim=dim)) if isinstance(lay, Shard) else lay
            self.assign(node.args[0], up)

    def demand(self, consumer: fx.Node, arg: Any, want: Layout) -> None:
        """`consumer` needs `arg` in layout `want`: decide a param, or convert on the edge."""
        if not is_tensor(arg):
            return
        cur = self.get(arg)
        if cur is None:
            self.assign(arg, want)
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
        merged = sorted((set(cumsum(list(lay.blocks))) | cuts) - {0})
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
            for arg in tensor_args(node):
                self._resolve_partial(node, arg, allow_seq=False)
                if not self._gather_output(node, arg):
                    self.demand(node, arg, R)
            return
        if node.op != "call_function":
            self.layout[node] = like(node, R)
            return
        args = tensor_args(node)
        if self._is_chain(node) and all(self.get(a) is None for a in args) and args:
            self.layout[node] = None  # a copy / transpose of a parameter: decided by its use
            return
        if packet(node) in NO_VALUE:
            self.layout[node] = R  # metadata assertions: no value, nothing to convert
            return
        if node.target is operator.getitem:
            src = self.get(node.args[0])
            self.layout[node] = src[node.args[1]] if isinstance(src, tuple) else src
            return
        if not keeps_partial(node, [self.get(a) for a in args]):
            for arg in args:
                self._resolve_partial(node, arg, allow_seq=True)
        self._check_mixed(node, args)
        try:
            out = self._whole_only(node, args)
            if out is None:
                out = self.rule(node)
        except Conflict as c:
            if c.origins:
                raise      # the driver turns those candidates off and runs again
            # Nothing to turn off: the split is a sequence-parallel one (or a gathered
            # vocab shard) that this op cannot keep (routing's index/sort/scatter over all
            # tokens). Gather the inputs and compute the op whole, as every rank would on
            # one device, and say so (plan.explain()).
            out = self.gather_inputs(node, c)
        for arg in args:  # parameters no rule claimed are replicated
            if self.get(arg) is None:
                self.assign(arg, R)
        self.layout[node] = out

    def _check_mixed(self, node: fx.Node, args: list[fx.Node]) -> None:
        """A mixed projection's output (split and whole blocks side by side) is only viewed
        and cut into its parts (q / k / v): any other op on it conflicts."""
        op = packet(node)
        for a in args:
            lay = self.eff(node, a)
            if isinstance(lay, Shard) and lay.whole and op not in RESHAPES \
                    and op not in SPLIT_OPS and op not in SELECT_OPS \
                    and not (op in TRANSPARENT and len(args) == 1):
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
        return like(node, out)

    def gather_inputs(self, node: fx.Node, why: Conflict) -> Any:
        """`node` computed replicated from gathered inputs; a decision already taken for it
        in the failed rule (a role, a conversion) is dropped."""
        self.role.pop(node, None)
        self.convert.pop(node, None)
        for arg in tensor_args(node):
            self._resolve_partial(node, arg, allow_seq=False)
        split = [a.name for a in tensor_args(node) if is_split(self.get(a))]
        self.notes.append(f"gathered {', '.join(split) or 'its inputs'} for {node.name}: "
                          f"{why.reason} ({source_line(node)})")
        return replicated(self, node)

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
            x, w, _, w_k, w_n = matmul_operands(origin)
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

    def rule(self, node: fx.Node) -> Any:
        """The layout of `node`: a sum of Partials stays Partial (partials.py), else its op's
        rule (rules.py)."""
        parts = [l for l in (self.eff(node, a) for a in tensor_args(node))
                 if isinstance(l, Partial)]
        if parts:
            return partial_sum(node, parts)
        return rule_for(node)(self, node)
