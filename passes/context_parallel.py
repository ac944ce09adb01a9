"""The context-parallel pass: each rank computes its 2 of the 2c sequence chunks.

Two steps around the tensor-parallel pass. `record_context_layouts` (pass `context_layout`,
before the tensor split) runs the sharding engine in its context mode on the captured graph
(passes/sharding/context.py `context_layouts`, docs/DESIGN.md §6.1) and writes its layouts into node
meta; `apply_context_parallel` (pass `context_parallel`, after the tensor split) is a rewrite
that reads them, as passes/tensor_parallel.py reads the tensor-parallel ones.

Requires: the full training graph (capture's; loss inside), meta VAL on every value, static
shapes; plan.c > 1 and plan.seq_len the graph's sequence length; for the rewrite, CP_SEQ_DIM /
CP_SELECT recorded before the tensor-parallel pass (which copies CP_SEQ_DIM onto the nodes it
makes from their input) — on a graph without them (the captured one) it records them first.
Guarantees: a graph that, run on one context rank with this rank's tokens of every input
(autopar/runtime/context_shard.py `context_cut`; chunks i and 2c−1−i, local order), computes the
rank's share of the single-device program: its tokens' activations and its share of the loss
(c · its token sum / the tokens counted on every context rank, whose mean over the c ranks is
the single device's). Reads meta VAL, STACK_TRACE, CP_SEQ_DIM, CP_SELECT; writes CP_SEQ_DIM
and CP_SELECT (record), VAL (local shapes) on the values that hold the rank's tokens; sets the
graph attributes `cp` (and `tp_rng` when a dropout needs it and the tensor-parallel pass made
none), stand-ins the runtime rebinds.

The layouts (the engine's): a value either holds the rank's tokens along one dim (CP_SEQ_DIM)
or is whole. The inputs' token dims are seeded; token-wise ops (projections, norms, MLPs,
embeddings, reshapes — a merged (B·T, C) dim holds its rows' tokens — the loss) keep the split.
Where a split value meets a whole one along the sequence — a rotary table, a position embedding
or a mask the model builds from arange(T) — the engine marks the edge (CP_SELECT) and the whole
one is cut at this rank's global positions (`context_select`): positions are found through
propagation, never by name. Any op that would need other ranks' tokens outside attention (a
cumulative op, a norm, a sort or reduction along the sequence, an op with no rule) is refused
at recording with ValueError naming the node and the user's source line.

The rewrite: local VALs; shape constants that name the sequence (`view(B, T, H, D)`, expand,
unflatten) become the local value's sizes (T/c), a view so resized a reshape (a view valid on
the whole sequence's strides need not be on the rank's part); the tensor-parallel pass's
sequence-parallel scatter / gather keep the rank's tokens (cut again between its tensor ranks,
in local order) and its per-row blocks along the sequence ((T,) · B on a (B·T, C) dim) become
(T/c,) · B; a whole operand it cut along the sequence for a sequence-parallel region (a rotary
table meeting tokens there) is selected at the rank's positions before that cut.
Attention is the one op that needs the other ranks' tokens: its keys and values are
all-gathered along the sequence in global order (`context_gather`, Llama 3's method) — under
grouped-query attention before the head repeat that feeds it (repeat_kv's expand / reshape or
repeat_interleave, found by walking back through token-wise data movements to the smallest
value), which is re-applied to the gathered kv heads — its queries stay local, its mask's query
rows are this rank's; is_causal attention becomes `context_causal_attention`: each of the
rank's two query chunks against its key prefix, so the rank computes its share of the causal
work. Written-out attention (q·kᵀ, p·v; BLOOM's baddbmm) gathers the key / value operand the
same way. Dropout on the rank's tokens (attention's and aten.dropout's) draws from the
program's DropoutStreams (`tp_rng`, bound with this rank's tensor and context ranks: another
mask on each context rank, the same on the tensor ranks of a value they all hold, replayed by
recompute), as tensor-parallel regions do: it cannot equal one device bit for bit.

Under plan.cp_attention == "ring" a scaled-dot-product attention instead becomes
`context_ring_attention` (autopar/runtime/ring_attention.py) on the local q, k, v: the K/V
blocks travel round the context group at run time, only the kv heads of a grouped-query repeat
(its group found by replaying the repeat on one token), the mask's query rows selected as
above; a ring attention with dropout is refused. Written-out attention is split only by the
all-gather (its softmax between the two products is not the pass's to split into ring steps):
under any other method a product reading the other ranks' tokens is refused in one line (the
solver never offers one there: cost.families.cp_attention_rule; a hand-made plan did, and ran
the all-gather without saying so).

Under plan.cp_attention == "all-to-all" (DeepSpeed-Ulysses) a scaled-dot-product attention
becomes `context_alltoall_attention` (autopar/runtime/ulysses.py) on the local q, k, v: at run
time an all-to-all over the context group gives each rank the whole sequence of heads/c heads
(reordered to global order, so is_causal is the plain causal mask), the output traded back; its
mask is read whole (heads cut to the rank's at run time); the heads (per tensor rank) must
divide by c, refused in one line otherwise; only the kv heads of a grouped-query repeat are
exchanged when they divide by c (repeated up to the query heads otherwise).
Under "hybrid" (Megatron-Core's a2a+p2p, the all-gather across) the same node becomes
`context_hybrid_attention`: the all-to-all over k consecutive context ranks (inside a node;
k from the heads and the node at run time: groups.hybrid_inner_degree), the K/V of the rank's
heads/k heads all-gathered over the other c/k, the inverse all-to-all after. Under
"hybrid-ring" (a2a+p2p with the ring across, as TransformerEngine runs it) it becomes
`context_hybrid_ring_attention`: the same all-to-all, ring attention over the c/k outer ranks.

A token-mean loss becomes c · (the rank's summed loss) / (the tokens counted on all c context
ranks, one all-reduced count per micro-batch: `context_loss_mean`); the runtime averages it,
and the weight gradients, over the c·d ranks that hold the same weights, which is the mean over
every counted token of every context rank even when ignored targets (ignore_index) fall
unevenly between the chunks.
"""
from __future__ import annotations

import math
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.manager import Pass, run_passes
from autopar.passes.sharding import (MATMUL_OPS, METHOD_FIX, NEW_FACTORIES, NO_LAYOUT,
                                     NO_VALUE, SUBMODULE_CALL, Partial, Replicate, Shard,
                                     context_layouts, context_refusal,
                                     dropout_refusal, loss_refusal, method_refusal, packet,
                                     seq_dim_refusal)
from autopar.passes.sharding.context import Counts
from autopar.runtime import shard as shard_rt
from autopar.runtime.context_shard import (ContextShard, context_causal_attention,
                                           context_gather, context_loss_mean, context_select,
                                           context_sum)
from autopar.runtime.ring_attention import context_ring_attention
from autopar.runtime.ulysses import (context_alltoall_attention, context_hybrid_attention,
                                     context_hybrid_ring_attention)

aten = torch.ops.aten
CP_ATTR = "cp"   # the graph attribute the runtime binds to this rank's ContextShard

_LOSSES = {aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d}
_SDPA = {aten.scaled_dot_product_attention, shard_rt.tp_sdpa}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
STREAMS_ATTR = "tp_rng"   # the graph attribute of the program's shard.DropoutStreams
_SEED = 0                 # the streams' seed (tensor_parallel_pass's default)
# token-wise data movements a grouped-query head repeat is made of (`_repeat_chain`); the resized
# ones take the whole sequence's sizes when re-applied after the K/V all-gather
_RESIZES = {aten.view, aten.reshape, aten._unsafe_view, aten.expand}
_MOVES = _RESIZES | {aten.repeat_interleave, aten.unsqueeze, aten.transpose, aten.permute,
                     aten.clone, aten.contiguous, aten.alias, aten.slice}
# positional names of the loss ops' arguments past (input, target), by whether the op is the
# vocab-parallel cross-entropy (logits, target, group, vocab_size, ignore_index, reduction)
_LOSS_KW = {False: {2: "weight", 3: "reduction", 4: "ignore_index"},
            True: {4: "ignore_index", 5: "reduction"}}
_BLOCKS = {shard_rt.local_blocks, shard_rt.shuffle_blocks,   # (x, group, dim, blocks, ...)
           shard_rt.unshuffle_blocks}
# ops whose arguments name sizes: (x, sizes) or unflatten's (x, dim, sizes)
_SIZED = {aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.broadcast_to,
          aten.unflatten, *NEW_FACTORIES}   # (x.new_empty(sizes): a buffer shaped like x)
# factories the engine made the rank's own size (rows in a sorted order: an arange from 0 by 1,
# a buffer): (sizes) or arange's (end) / (0, end[, 1])
_FACTORIES = {aten.zeros, aten.ones, aten.full, aten.empty, aten.arange}


_refuse = context_refusal   # the one-line refusal: node, op, the user's source line


def _refuse_method(node: fx.Node, why: str) -> ValueError:
    return context_refusal(node, why, fix=METHOD_FIX)


def _shape(node: Any) -> tuple[int, ...] | None:
    v = node.meta.get(K.VAL) if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


class _RankGraph:
    """The graph being rewritten for one context rank, and what the rewrite knows of it: the
    sequence dim of each value rewritten so far (`dim`), every value's single-device shape
    (`full`), and the nodes it inserts — the `cp` and `tp_rng` get_attrs, selections at the
    rank's positions, gathers of the rank's tokens."""

    def __init__(self, gm: fx.GraphModule, c: int, seq_len: int):
        self.gm, self.g, self.c, self.T = gm, gm.graph, c, seq_len
        self.dim: dict[fx.Node, int] = {}            # value -> its sequence dim
        self.full: dict[fx.Node, tuple[int, ...]] = {n: s for n in gm.graph.nodes
                                                     if (s := _shape(n)) is not None}
        self.cp: fx.Node | None = None
        self.streams: fx.Node | None = None   # the DropoutStreams get_attr

    def cp_node(self) -> fx.Node:
        """The get_attr of the rank's ContextShard (`cp`), made once, before the first op."""
        if self.cp is None:
            first = next(n for n in self.g.nodes if n.op != "placeholder")
            with self.g.inserting_before(first), warnings.catch_warnings():
                warnings.simplefilter("ignore")   # a plain attribute, as tp_group
                self.cp = self.g.get_attr(CP_ATTR)
        return self.cp

    def streams_node(self) -> fx.Node:
        """The get_attr of the program's DropoutStreams (`tp_rng`, bound by the runtime with
        this rank's tensor and context ranks)."""
        if self.streams is not None:   # found or made once per rewrite (as cp_node)
            return self.streams
        self.streams = next((node for node in self.g.nodes
                             if node.op == "get_attr" and node.target == STREAMS_ATTR), None)
        if self.streams is None:
            if not hasattr(self.gm, STREAMS_ATTR):   # stands in for inspection, as `cp` does
                setattr(self.gm, STREAMS_ATTR, shard_rt.DropoutStreams(0))
            with self.g.inserting_after(self.cp_node()), warnings.catch_warnings():
                warnings.simplefilter("ignore")       # a plain attribute, as tp_group
                self.streams = self.g.get_attr(STREAMS_ATTR)
        return self.streams

    def new(self, before: fx.Node, fn: Any, args: tuple, like: fx.Node,
            val: torch.Tensor | None) -> fx.Node:
        """A call of `fn` before `before`, with `like`'s meta (no sequence dim) and VAL `val`."""
        with self.g.inserting_before(before):
            n = self.g.call_function(fn, args)
        n.meta = {k: v for k, v in like.meta.items() if k != K.CP_SEQ_DIM}
        n.meta[K.VAL] = val
        return n

    @staticmethod
    def meta(shape: tuple[int, ...], like: Any) -> torch.Tensor:
        dtype = like.dtype if isinstance(like, torch.Tensor) else torch.float32
        return torch.empty(shape, dtype=dtype, device="meta")

    def mark(self, n: fx.Node, d: int) -> None:
        """n holds the rank's tokens along dim d: its VAL made local."""
        self.dim[n] = d
        n.meta[K.CP_SEQ_DIM] = d
        v = n.meta.get(K.VAL)
        if isinstance(v, torch.Tensor):
            shape = list(v.shape)
            if (why := seq_dim_refusal(shape[d], d, self.c)) is not None:
                raise _refuse(n, why)
            shape[d] //= self.c
            n.meta[K.VAL] = self.meta(tuple(shape), v)

    def select(self, x: fx.Node, dim: int, user: fx.Node) -> fx.Node:
        """x (whole along `dim`, of length T) cut at this rank's positions, before `user`."""
        shape = list(self.full[x])
        if shape[dim] != self.T:
            raise _refuse(user, f"its operand {x.name} of shape {tuple(shape)} meets the "
                                f"rank's tokens along dim {dim} with a length other than the "
                                f"sequence's {self.T}")
        shape[dim] = self.T // self.c
        return self.new(user, context_select, (x, self.cp_node(), dim), user,
                        self.meta(tuple(shape), x.meta.get(K.VAL)))

    def gather(self, x: fx.Node, user: fx.Node) -> fx.Node:
        """x (the rank's tokens along its sequence dim) gathered whole, in global order.
        When x is grouped-query attention's head repeat of smaller keys / values (repeat_kv's
        unsqueeze → expand → reshape, or repeat_interleave: `_repeat_chain`), the smaller
        tensor is gathered and the repeat re-applied to it: the exchange moves kv_heads,
        not heads, as cost/context.py prices it."""
        src, chain = _repeat_chain(self, x)
        g = self.new(user, context_gather, (src, self.cp_node(), self.dim[src]), user,
                     self.meta(self.full[src], src.meta.get(K.VAL)))
        for node in chain:              # the head repeat again, on whole sequences
            args = (g,) + tuple(node.args[1:])
            if packet(node) in _RESIZES:
                args = (g, list(self.full[node])) + tuple(node.args[2:])
            g = self.new(user, node.target, args, node,
                         self.meta(self.full[node], node.meta.get(K.VAL)))
            g.kwargs = dict(node.kwargs)
        return g

    def mask_rows(self, mask: fx.Node, n: fx.Node) -> fx.Node:
        """An attention mask (whole: a function of positions, not of the rank's tokens) with
        this rank's query rows; its key columns stay whole, in global order."""
        if mask in self.dim:
            raise _refuse(n, "a mask that depends on the rank's tokens")
        rows = len(self.full[mask]) - 2
        return self.select(mask, rows, n) if self.full[mask][rows] != 1 else mask


def _repeat_chain(rg: _RankGraph, x: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the smallest value x is a token-wise data movement of, the movements from it to x
    in order): back through single-input ops that move or repeat elements within each
    token (_MOVES: never along the sequence dim, which the engine refused); (x, [])
    when nothing smaller feeds it."""
    path, cur = [], x
    while (cur.op == "call_function" and packet(cur) in _MOVES
           and [a for a in cur.all_input_nodes] == [cur.args[0]]
           and cur.args[0] in rg.dim and _whole_slice(rg, cur)):
        path.append(cur)
        cur = cur.args[0]
    nodes = path + [cur] if path else [x]
    best = min(nodes, key=lambda n: math.prod(rg.full[n]))   # the nearest of the smallest
    return best, nodes[:nodes.index(best)][::-1]


def _whole_slice(rg: _RankGraph, n: fx.Node) -> bool:
    """Not a slice, or a slice that keeps its whole dim (export's `x[:, :, None]`)."""
    if packet(n) is not aten.slice:
        return True
    dim = n.args[1] if len(n.args) > 1 else 0
    start = n.args[2] if len(n.args) > 2 else 0
    end = n.args[3] if len(n.args) > 3 else None
    step = n.args[4] if len(n.args) > 4 else 1
    return (start in (0, None) and step == 1
            and (end is None or end >= rg.full[n.args[0]][dim]))


def _kv_group(rg: _RankGraph, x: fx.Node) -> int:
    """g > 1 when x (B, H, T, E) is a head repeat in which every head of a smaller tensor
    appears g times consecutively (repeat_kv's expand + reshape, repeat_interleave): the
    repeat (`_repeat_chain`) replayed on one token of distinct numbers shows it; else 1."""
    src, chain = _repeat_chain(rg, x)
    if not chain:
        return 1
    shape = list(rg.full[src])
    shape[rg.dim[src]] = 1
    y = torch.arange(math.prod(shape)).reshape(shape)
    for node in chain:
        args = tuple(node.args[1:])
        if packet(node) in _RESIZES:
            sizes = list(rg.full[node])
            sizes[rg.dim[node]] = 1
            args = (sizes,) + tuple(node.args[2:])
        y = node.target(y, *args, **node.kwargs)
    heads = y.shape[1]
    for g in range(heads, 1, -1):
        grouped = y.unflatten(1, (heads // g, g)) if heads % g == 0 else None
        if grouped is not None and bool((grouped == grouped[:, :, :1]).all()):
            return g
    return 1


class _ContextRewrite:
    """The rewrite of one graph for one context rank, op by op, reading the engine's layouts
    (meta CP_SEQ_DIM / CP_SELECT) and making its nodes through the `_RankGraph`; `method`: how
    scaled-dot-product attention meets the other ranks' tokens (plan.cp_attention:
    "all-gather", "ring", "all-to-all", "hybrid" or "hybrid-ring")."""

    def __init__(self, rg: _RankGraph, method: str = "all-gather"):
        self.rg, self.g, self.method = rg, rg.g, method

    def run(self) -> None:
        """Each node in order, its sequence dim read from CP_SEQ_DIM (the engine's, recorded
        on the captured graph and carried by the tensor-parallel pass onto the nodes it makes
        from their input)."""
        for n in list(self.g.nodes):
            d = n.meta.get(K.CP_SEQ_DIM)
            if n.op == "placeholder":
                if d is not None:
                    self.rg.mark(n, d)
            elif n.op == "call_module":
                if any(a in self.rg.dim for a in n.all_input_nodes):
                    if n.users:
                        raise _refuse(n, SUBMODULE_CALL)
                    self.g.erase_node(n)   # torch.export's input guards: shapes are local now
            elif n.op == "output":
                self.reduce_inputs(n)
            elif n.op == "call_function":
                self.reduce_inputs(n)
                self.select_inputs(n)
                if d is not None or any(a in self.rg.dim for a in n.all_input_nodes):
                    self.visit(n, d)

    def select_inputs(self, n: fx.Node) -> None:
        """The engine's selection edges (CP_SELECT): whole operands that meet the rank's tokens
        cut at its positions. Attention and baddbmm select their mask / bias themselves. An
        operand the tensor-parallel pass converted (a head slice) is selected after it: the
        conversions keep its dims."""
        edges = n.meta.get(K.CP_SELECT) or {}
        if not edges or packet(n) in _SDPA or packet(n) is aten.baddbmm:
            return
        for name, dim in edges.items():
            arg = next((a for a in n.all_input_nodes if self._derives(a, name)), None)
            if arg is None or arg in self.rg.dim:
                continue
            chain = self._conversions(arg, name)
            cut = next((k for k, a in enumerate(chain) if packet(a) in _BLOCKS
                        and a.args[2] % len(self.rg.full[a.args[0]]) == dim), None)
            if cut is None:
                n.replace_input_with(arg, self.rg.select(arg, dim, n))
                continue
            # a sequence-parallel region: the tensor-parallel pass cut the whole operand's
            # tokens between its tensor ranks (DeepSeek's rotary table for the keys' shared
            # rope part); the rank's positions are selected before that cut, which then cuts
            # the rank's T/c tokens in local order, as the scatter of its activations does
            blocks = chain[cut]
            src = blocks.args[0]
            blocks.replace_input_with(src, self.rg.select(src, dim, blocks))
            self._local_blocks(blocks)
            for a in chain[cut:]:
                self.rg.mark(a, dim)

    def reduce_inputs(self, n: fx.Node) -> None:
        """The engine's reduction edges (CP_REDUCE): the rank's summands of a sum over its
        tokens (CP_PARTIAL) read whole, summed over the context ranks (context_sum)."""
        for name in n.meta.get(K.CP_REDUCE) or ():
            arg = next((a for a in n.all_input_nodes if self._derives(a, name)), None)
            if arg is None:
                continue
            summed = self.rg.new(n, context_sum, (arg, self.rg.cp_node()), arg,
                                 arg.meta.get(K.VAL))
            for key in (K.CP_PARTIAL, K.CP_REDUCE, K.CP_SELECT):
                summed.meta.pop(key, None)
            n.replace_input_with(arg, summed)

    def _local_blocks(self, n: fx.Node) -> None:
        """A tensor-parallel cut along the sequence (x, group, dim, blocks, ...) of the rank's
        tokens: its blocks of T become T/c."""
        n.args = n.args[:3] + ([b // self.rg.c for b in n.args[3]],) + n.args[4:]

    @staticmethod
    def _conversions(a: fx.Node, name: str) -> list[fx.Node]:
        """The tensor-parallel pass's conversions between the node `name` and a (which
        `_derives` from it), first to last."""
        chain = []
        while a.name != name:
            chain.append(a)
            a = a.args[0]
        return chain[::-1]

    @staticmethod
    def _derives(a: fx.Node, name: str) -> bool:
        """a is the node `name`, or the tensor-parallel pass's conversion of it."""
        for _ in range(4):
            if a.name == name:
                return True
            if a.op != "call_function" or not a.args or not isinstance(a.args[0], fx.Node):
                return False
            a = a.args[0]
        return False

    def visit(self, n: fx.Node, d: int | None) -> None:
        op = packet(n)
        if op is operator.getitem:
            src = self.rg.dim.get(n.args[0])
            if d is not None or src is not None:
                self.rg.mark(n, d if d is not None else src)
            return
        if op in NO_VALUE:
            self.g.erase_node(n)
            return
        if op in _SDPA:
            return self.attention(n)
        if op is aten.dropout and n.args[0] in self.rg.dim:
            return self.dropout(n)
        if op in _LOSSES or op is shard_rt.vocab_parallel_cross_entropy:
            return self.loss(n)
        if op is aten.baddbmm:
            return self.baddbmm(n)
        if op in MATMUL_OPS and op is not aten.linear and op is not aten.addmm \
                and n.args[1] in self.rg.dim:   # attention written out: keys / values gathered
            return self.matmul(n)
        self.resize(n, d)
        if d is not None:
            self.rg.mark(n, d)
        elif n.meta.get(K.CP_PARTIAL) or op in NEW_FACTORIES:
            return   # the rank's summand of a sum over its tokens (or its counts of them); a
            # whole buffer x.new_zeros(sizes) reads no value of the rank's tokens x
        elif isinstance(n.meta.get(K.VAL), torch.Tensor) and n.meta[K.VAL].dim() > 0:
            # split inputs, a whole output the engine never decided: a node the tensor-parallel
            # pass made from an input without a layout; stop here rather than run it on the
            # wrong shapes
            raise _refuse(n, NO_LAYOUT)

    def resize(self, n: fx.Node, d: int | None) -> None:
        """Shape constants that name the sequence become the rank's: a view / expand's sizes
        are its local value's (T -> T/c at its sequence dim, -1 kept); the tensor-parallel
        pass's per-row blocks along the sequence ((T,) · B on a (B·T, C) dim) become T/c."""
        op = packet(n)
        if op in _BLOCKS:
            x = n.args[0]
            if x in self.rg.dim and n.args[2] % len(self.rg.full[x]) == self.rg.dim[x]:
                self._local_blocks(n)
            return
        if d is None or op not in _SIZED | _FACTORIES:
            return
        local = list(self.rg.full[n])
        local[d] //= self.rg.c
        if op is aten.arange:
            n.args = (local[0],) if len(n.args) == 1 else (n.args[0], local[0]) + n.args[2:]
            return
        if op in _FACTORIES:
            n.args = (local,) + tuple(n.args[1:])
            return
        if op is aten.unflatten:      # (x, dim, sizes): the sizes of the unflattened dims
            at = n.args[1] % len(self.rg.full[n.args[0]])
            sizes = [s if s == -1 else local[at + k] for k, s in enumerate(n.args[2])]
            n.args = (n.args[0], n.args[1], sizes) + tuple(n.args[3:])
            return
        lead = len(local) - len(n.args[1])
        sizes = [s if s == -1 else local[lead + k] for k, s in enumerate(n.args[1])]
        n.args = (n.args[0], sizes) + tuple(n.args[2:])
        if n.target is aten.view.default:
            # a view valid on the whole sequence's strides need not be on the rank's part
            # (torch 2.11's export of nn.MultiheadAttention: a view of a permuted (T, B, E)
            # merging T and B): reshape views where it can and copies where it must
            n.target = aten.reshape.default

    def matmul(self, n: fx.Node, at: int = 0) -> None:
        """a @ b with a = args[at], b = args[at + 1]: queries (a) stay local, keys / values
        (b, split) are gathered whole."""
        a, b = n.args[at], n.args[at + 1]
        ra, rb = len(self.rg.full[a]), len(self.rg.full[b])
        da = self.rg.dim.get(a)
        db = self.rg.dim.get(b)
        out = len(self.rg.full[n])
        if db is not None:
            if da is None and not (ra >= 2 and self.rg.full[a][-1] == self.rg.T
                                   and db == rb - 2):
                raise _refuse(n, "a product whose right operand holds the rank's tokens")
            if db not in (rb - 1, rb - 2):
                raise _refuse(n, "a product split along a batch dim of its right operand")
            if self.method != "all-gather":   # a hand-made plan: the solver offers it no other
                raise _refuse_method(n, f"cp_attention={self.method!r} replaces "
                                     f"scaled_dot_product_attention calls, and this product "
                                     f"reads the other ranks' tokens (attention written out: "
                                     f"q·kᵀ, softmax, p·v), which only the all-gather splits")
            # keys (n dim: q·kᵀ) or values (k dim: p·v): the whole sequence, in order
            g = self.rg.gather(b, n)
            n.args = n.args[:at + 1] + (g,) + n.args[at + 2:]
        if da is None:
            raise _refuse(n, "a product whose queries are whole but keys split")
        if da == ra - 1:
            raise _refuse(n, "a product contracting the rank's tokens")
        self.rg.mark(n, out - (ra - da))

    def baddbmm(self, n: fx.Node) -> None:
        """bias + a @ b (BLOOM's ALiBi scores): the product as `matmul`; a whole bias that
        reaches the queries' dim with length T is cut at the rank's positions."""
        bias = n.args[0]
        self.matmul(n, at=1)
        od, out = self.rg.dim[n], self.rg.full[n]
        if bias in self.rg.dim:
            if len(out) - len(self.rg.full[bias]) + self.rg.dim[bias] != od:
                raise _refuse(n, "a bias split along another dim than the product")
            return
        k = od - (len(out) - len(self.rg.full[bias]))
        if k >= 0 and self.rg.full[bias][k] != 1:
            n.replace_input_with(bias, self.rg.select(bias, k, n))

    def attention(self, n: fx.Node) -> None:
        """Keys and values gathered, the mask's query rows selected, is_causal run chunk by
        chunk; attention dropout drawn from this context rank's stream (`streams`)."""
        heads_split = n.target is shard_rt.tp_sdpa     # the tensor-parallel pass's, per tp rank
        names = (_SDPA_ARGS[:3] + ("streams", "seed") + _SDPA_ARGS[3:] if heads_split
                 else _SDPA_ARGS)
        a = {**dict(zip(names, n.args)), **n.kwargs}
        q, k, v = a["query"], a["key"], a["value"]
        if any(x not in self.rg.dim for x in (q, k, v)):
            raise _refuse(n, "attention whose queries, keys and values are not all split")
        mask, causal = a.get("attn_mask"), a.get("is_causal", False)
        dropout = a.get("dropout_p", 0.0)
        if (why := dropout_refusal(dropout)) is not None:
            raise _refuse(n, why)
        streams, seed = a.get("streams"), a.get("seed", _SEED)
        extra = {key: a[key] for key in ("scale", "enable_gqa") if key in a}
        if self.method == "ring":
            return _ring_attention(self.rg, n, (q, k, v), mask, causal, dropout, extra)
        if self.method in ("all-to-all", "hybrid", "hybrid-ring"):
            return _alltoall_attention(self.rg, n, (q, k, v), mask, causal, dropout, extra,
                                       (streams, seed, heads_split), self.method)
        if dropout and streams is None:
            streams = self.rg.streams_node()
        kg, vg = self.rg.gather(k, n), self.rg.gather(v, n)
        if isinstance(mask, fx.Node):
            mask = self.rg.mask_rows(mask, n)
        elif causal:
            # each query chunk against its key prefix (runtime/context_shard.py): the rank computes
            # its share of the causal tiles, not a masked (T/c) × T block
            n.target = context_causal_attention
            n.args = (q, kg, vg, self.rg.cp_node(), extra.get("scale"),
                      extra.get("enable_gqa", False), dropout, streams, seed, heads_split)
            n.kwargs = {}
            return self.rg.mark(n, self.rg.dim[q])
        if dropout or heads_split:
            n.target = shard_rt.tp_sdpa
            n.args = (q, kg, vg, streams, seed, mask, dropout, causal)
            n.kwargs = {**extra, "per_tensor_rank": heads_split}
        else:
            n.args, n.kwargs = (q, kg, vg, mask, dropout, causal), extra
        self.rg.mark(n, self.rg.dim[q])

    def dropout(self, n: fx.Node) -> None:
        """aten.dropout on the rank's tokens (whole over the tensor group: split values already
        draw from tp_dropout's per-tensor-rank streams): this context rank's own mask."""
        x, p, train = (list(n.args) + [n.kwargs.get("p", 0.5), n.kwargs.get("train", True)])[:3]
        if isinstance(p, (int, float)) and p and train:
            n.target = shard_rt.tp_dropout
            n.args, n.kwargs = (x, p, train, self.rg.streams_node(), _SEED), {
                "per_tensor_rank": False}
        self.rg.mark(n, self.rg.dim[x])

    def loss(self, n: fx.Node) -> None:
        """A token-mean loss becomes c · (the rank's token sum) / (tokens counted on every
        context rank) (`context_loss_mean`): the runtime's average over the context ranks is
        the mean over every counted token of the whole sequence, however unevenly ignored
        targets (ignore_index) fall between the rank's chunks."""
        x, y = n.args[0], n.args[1]
        if self.rg.dim.get(x) != 0 or self.rg.dim.get(y) != 0:
            raise _refuse(n, "a loss over values not split along their token dim 0")
        vocab = packet(n) is shard_rt.vocab_parallel_cross_entropy
        at, ignore_at, weight_at = (5, 4, None) if vocab else (3, 4, 2)
        reduction = n.args[at] if len(n.args) > at else n.kwargs.get("reduction", 1)
        weight = None if weight_at is None else (
            n.args[weight_at] if len(n.args) > weight_at else n.kwargs.get("weight"))
        if (why := loss_refusal(reduction, weight)) is not None:
            raise _refuse(n, why)
        ignore = n.args[ignore_at] if len(n.args) > ignore_at else n.kwargs.get("ignore_index",
                                                                              -100)
        args = list(n.args) + [None] * (at + 1 - len(n.args))
        defaults = {2: None, 3: 1, 4: -100} if not vocab else {4: -100}
        for k in range(len(n.args), at):
            args[k] = n.kwargs.get(_LOSS_KW[vocab][k], defaults.get(k))
        args[at] = 2                                  # sum: divided by the counted tokens
        n.args, n.kwargs = tuple(args), {k: v for k, v in n.kwargs.items()
                                         if k not in _LOSS_KW[vocab].values()}
        users = list(n.users)
        with self.g.inserting_after(n):
            mean = self.g.call_function(context_loss_mean, (n, y, self.rg.cp_node(), ignore))
        mean.meta = {k: v for k, v in n.meta.items() if k != K.CP_SEQ_DIM}
        for u in users:
            u.replace_input_with(n, mean)


def _ring_attention(rg: _RankGraph, n: fx.Node, qkv: tuple, mask: Any, causal: bool,
                    dropout: float, extra: dict) -> None:
    """Attention as `context_ring_attention` (plan.cp_attention == "ring"): q, k, v stay
    local, the runtime passes the K/V blocks round the context group; the mask's query rows
    are this rank's. Under a grouped-query head repeat in the graph (`_kv_group`) only
    the kv heads travel."""
    q, k, v = qkv
    if (why := method_refusal("ring", [(rg.full[x], rg.dim[x]) for x in qkv], dropout,
                              rg.c)) is not None:
        raise _refuse_method(n, why)
    if isinstance(mask, fx.Node):
        mask = rg.mask_rows(mask, n)
    group = _kv_group(rg, k)
    if _kv_group(rg, v) != group:
        group = 1
    n.target = context_ring_attention
    n.args = (q, k, v, rg.cp_node(), mask, bool(causal), extra.get("scale"),
              bool(extra.get("enable_gqa", False)), group)
    n.kwargs = {}
    rg.mark(n, rg.dim[q])


def _alltoall_attention(rg: _RankGraph, n: fx.Node, qkv: tuple, mask: Any, causal: bool,
                        dropout: float, extra: dict, rng: tuple,
                        method: str = "all-to-all") -> None:
    """Attention as `context_alltoall_attention` (plan.cp_attention == "all-to-all",
    DeepSpeed-Ulysses) or `context_hybrid_attention` ("hybrid": all-to-all over an inner
    group, all-gather over the outer): q, k, v stay local, the runtime trades tokens for heads
    around attention; the mask is read whole (every query row, in global order). Under a
    grouped-query head repeat in the graph (`_kv_group`) only the kv heads are exchanged
    when they divide by the all-to-all's degree. The heads (this tensor rank's) must divide
    by c (all-to-all) or by a divisor 1 < k < c of c (hybrid)."""
    q, k, v = qkv
    if (why := method_refusal(method, [(rg.full[x], rg.dim[x]) for x in qkv], dropout,
                              rg.c)) is not None:
        raise _refuse_method(n, why)
    if isinstance(mask, fx.Node) and mask in rg.dim:
        raise _refuse(n, "a mask that depends on the rank's tokens")
    group = _kv_group(rg, k)
    if _kv_group(rg, v) != group:
        group = 1
    streams, seed, heads_split = rng
    if dropout and streams is None:
        streams = rg.streams_node()
    n.target = {"hybrid": context_hybrid_attention, "hybrid-ring": context_hybrid_ring_attention
                }.get(method, context_alltoall_attention)
    n.args = (q, k, v, rg.cp_node(), mask, bool(causal), extra.get("scale"),
              bool(extra.get("enable_gqa", False)), group, float(dropout), streams, seed,
              heads_split)
    n.kwargs = {}
    rg.mark(n, rg.dim[q])


def _record(gm: fx.GraphModule, c: int, seq_len: int, attention: str) -> fx.GraphModule:
    """Pass `context_layout`: the engine's sequence split of the captured graph
    (passes/sharding/context.py `context_layouts`) written into node meta, before the
    tensor-parallel pass: CP_SEQ_DIM on every value that holds the rank's tokens, CP_SELECT on
    every op that reads a whole operand along them. Raises the one-line refusal where the
    split (with `attention`, plan.cp_attention) cannot run: the engine states every refusal
    of the rewrite (autopar/api.py asks the same engine, `context_verdict`)."""
    engine = context_layouts(gm, c, seq_len, attention)
    for n in gm.graph.nodes:
        for key in (K.CP_SEQ_DIM, K.CP_SELECT, K.CP_PARTIAL, K.CP_REDUCE):
            n.meta.pop(key, None)
        lay = engine.layout.get(n)
        if isinstance(lay, Shard):
            n.meta[K.CP_SEQ_DIM] = lay.dim
        if isinstance(lay, (Partial, Counts)):
            n.meta[K.CP_PARTIAL] = True
        edges = {a.name: want.dim for a, want in engine.convert.get(n, {}).items()
                 if isinstance(want, Shard)}
        if edges:
            n.meta[K.CP_SELECT] = edges
        summed = [a.name for a, want in engine.convert.get(n, {}).items()
                  if isinstance(want, Replicate)
                  and isinstance(engine.layout.get(a), (Partial, Counts))]
        if summed:
            n.meta[K.CP_REDUCE] = summed
    return gm


def _rewrite(gm: fx.GraphModule, c: int, seq_len: int, attention: str) -> fx.GraphModule:
    """Pass `context_parallel`: the rewrite for one of c context ranks (the module docstring),
    reading the layouts `_record` wrote."""
    if not hasattr(gm, CP_ATTR):
        # bound by the runtime (compile.py) to this rank's ContextShard; this one, on rank 0
        # with no group, stands in for inspection and code generation (set before the rewrite
        # inserts its get_attr, so the graph never references a missing attribute)
        setattr(gm, CP_ATTR, ContextShard(group=None, c=c, cp_rank=0, seq_len=seq_len))
    _ContextRewrite(_RankGraph(gm, c, seq_len), attention).run()
    gm.graph.eliminate_dead_code()
    return gm


def _layout_pass(c: int, seq_len: int, attention: str) -> Pass:
    return Pass(name="context_layout", run=lambda gm: _record(gm, c, seq_len, attention),
                reads=(K.VAL, K.STACK_TRACE),
                writes=(K.CP_SEQ_DIM, K.CP_SELECT, K.CP_PARTIAL, K.CP_REDUCE))


def _rewrite_pass(c: int, seq_len: int, attention: str) -> Pass:
    return Pass(name="context_parallel", run=lambda gm: _rewrite(gm, c, seq_len, attention),
                reads=(K.VAL, K.STACK_TRACE, K.CP_SEQ_DIM, K.CP_SELECT, K.CP_PARTIAL,
                       K.CP_REDUCE),
                writes=(K.CP_SEQ_DIM, K.VAL))


def record_context_layouts(gm: fx.GraphModule, c: int, seq_len: int,
                           attention: str = "all-gather") -> fx.GraphModule:
    """Pass `context_layout` on `gm` (in place) through run_passes (linted, recompiled); c = 1
    leaves it as it is."""
    return gm if c == 1 else run_passes(gm, [_layout_pass(c, seq_len, attention)])


def apply_context_parallel(gm: fx.GraphModule, c: int, seq_len: int,
                           attention: str = "all-gather") -> fx.GraphModule:
    """Rewrite `gm` (in place) for one of c context ranks; see the module docstring. The
    layouts are read from meta (record_context_layouts, run before the tensor-parallel pass);
    on a graph without them (the captured one) they are recorded first. attention:
    "all-gather" (K/V gathered before attention), "ring" (every scaled-dot-product attention
    a `context_ring_attention`) or "all-to-all" (a `context_alltoall_attention`;
    autopar.plan CP_ATTENTION). Runs through run_passes (linted, recompiled after each)."""
    if c == 1:
        return gm
    recorded = any(K.CP_SEQ_DIM in n.meta for n in gm.graph.nodes if n.op == "placeholder")
    passes = [] if recorded else [_layout_pass(c, seq_len, attention)]
    return run_passes(gm, passes + [_rewrite_pass(c, seq_len, attention)])


def context_layout_pass(plan: Any) -> Pass:
    """The engine's sequence layouts of `plan` (c, seq_len), recorded before the tensor
    split (autopar/build.py)."""
    return _layout_pass(plan.c, plan.seq_len, plan.cp_attention)


def context_parallel_pass(plan: Any) -> Pass:
    """The pass of `plan` (c, seq_len, cp_attention) for the pass pipeline (autopar/build.py)."""
    return _rewrite_pass(plan.c, plan.seq_len, plan.cp_attention)
