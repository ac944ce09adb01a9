"""The context-parallel pass: each rank computes its 2 of the 2c sequence chunks.

Requires: the full training graph (capture's, after the tensor-parallel pass; loss inside),
meta VAL on every value, static shapes; plan.c > 1 and plan.seq_len the graph's sequence length.
Guarantees: a graph that, run on one context rank with this rank's tokens of every input
(autopar/runtime/context.py `context_cut`; chunks i and 2c−1−i, local order), computes the
rank's share of the single-device program: its tokens' activations and its share of the loss
(c · its token sum / the tokens counted on every context rank, whose mean over the c ranks is
the single device's). Reads meta VAL, STACK_TRACE; writes CP_SEQ_DIM on every value that holds
the rank's tokens and VAL (local shapes) on them; sets the graph attributes `cp` (and `tp_rng`
when a dropout needs it and the tensor-parallel pass made none), stand-ins the runtime rebinds.

How: a sequence-split layout propagates forward from the inputs, op by op, as the
tensor-parallel pass's shards do (passes/sharding.py's op families; the engine's context mode,
`sharding.context_layouts`, finds the same layouts on the captured graph and is tested to agree
with this walk — docs/DESIGN.md §6.1 says how this pass becomes a rewrite reading them): a value
either holds the
rank's tokens along one dim (CP_SEQ_DIM) or is whole. Token-wise ops (projections, norms, MLPs,
embeddings, the loss) keep the split, and so do sequence parallelism's conversions (the
tensor-parallel pass's scatter / gather along the sequence: they cut the rank's tokens again
between its tensor ranks, in local order); shape constants that name the sequence length
(`view(B, T, H, D)`) are rewritten to T/c. A value's sequence dim may hold the tokens merged
with other dims, outer × tokens × inner (`_Propagation.span`: Conv1D's and OPT's (B·T, C),
MultiheadAttention's (T·B, E)), followed through reshapes; the tensor-parallel pass's per-row
blocks of such a dim ((T,) · B) become (T/c,) · B. Where a split value meets a whole one along the
sequence — a rotary table, a position embedding or a mask the model builds from arange(T) —
the whole one is cut at this rank's global positions (`context_select`): positions are found
through propagation, never by name. Attention is the one op that needs the other ranks'
tokens: its keys and values are all-gathered along the sequence in global order
(`context_gather`, Llama 3's method) — under grouped-query attention before the head repeat
that feeds it (repeat_kv's expand / reshape or repeat_interleave, found by walking back
through token-wise data movements to the smallest value), which is re-applied to the
gathered kv heads — its queries stay local, its mask's query rows are this
rank's; is_causal attention becomes `context_causal_attention`: each of the rank's two query
chunks against its key prefix, so the rank computes its share of the causal work. Written-out
attention (q·kᵀ, p·v) gathers the key / value operand the same way. Dropout on the rank's
tokens (attention's and aten.dropout's) draws from the program's DropoutStreams (`tp_rng`,
bound with this rank's tensor and context ranks: another mask on each context rank, the same
on the tensor ranks of a value they all hold, replayed by recompute), as tensor-parallel
regions do: it cannot equal one device bit for bit. Any other op on a split value raises
ValueError naming the node and the user's source line.

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
from autopar.passes.manager import Pass
from autopar.passes.sharding import (_NO_VALUE, _RESHAPES, _SOFTMAX, MATMUL_OPS, SPLIT_OPS,
                                     context_refusal, packet)
from autopar.runtime import collectives as coll
from autopar.runtime import shard as shard_rt
from autopar.runtime.context import (ContextShard, context_causal_attention, context_gather,
                                     context_loss_mean, context_select)

aten = torch.ops.aten
CP_ATTR = "cp"   # the graph attribute the runtime binds to this rank's ContextShard

_REDUCE = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.max, aten.min,
           aten.logsumexp, aten.any, aten.all}
_NORMS = {aten.layer_norm, aten.native_layer_norm, aten.rms_norm}
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
# the tensor-parallel pass's sequence-parallel conversions (x, group, dim): under c they cut /
# regather the context rank's tokens between its tensor ranks, in local order
_SP = {coll.scatter_to_sp, coll.gather_from_sp, coll.reduce_scatter_to_sp, coll.all_gather_sp}
_BLOCKS = {shard_rt.local_blocks, shard_rt.unshuffle_blocks}   # (x, group, dim, blocks, ...)
_PURE = (1, 1, False)   # a sequence dim that holds the tokens alone (_Propagation.span)


_refuse = context_refusal   # the one-line refusal: node, op, the user's source line


def _shape(node: Any) -> tuple[int, ...] | None:
    v = node.meta.get(K.VAL) if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


class _Propagation:
    def __init__(self, gm: fx.GraphModule, c: int, seq_len: int):
        self.gm, self.g, self.c, self.T = gm, gm.graph, c, seq_len
        self.dim: dict[fx.Node, int] = {}            # value -> its sequence dim
        # value -> (outer, inner, cut): its sequence dim is outer × tokens × inner, (1, 1)
        # unless a reshape merged the tokens with other dims: (B, T, C) -> (B·T, C) is (B, 1)
        # (Conv1D, OPT), (T, B, E) -> (T·B, E) is (1, B) (MultiheadAttention); cut: such a
        # merged dim cut by sequence parallelism (contiguous rows: token-wise ops only, until
        # the tensor-parallel pass's gather restores it)
        self.span: dict[fx.Node, tuple[int, int, bool]] = {}
        self.full: dict[fx.Node, tuple[int, ...]] = {n: s for n in gm.graph.nodes
                                                     if (s := _shape(n)) is not None}
        self.cp: fx.Node | None = None

    # ----- helpers --------------------------------------------------------------------
    def cp_node(self) -> fx.Node:
        if self.cp is None:
            first = next(n for n in self.g.nodes if n.op != "placeholder")
            with self.g.inserting_before(first), warnings.catch_warnings():
                warnings.simplefilter("ignore")   # a plain attribute, as tp_group
                self.cp = self.g.get_attr(CP_ATTR)
        return self.cp

    def _new(self, before: fx.Node, fn: Any, args: tuple, like: fx.Node,
             val: torch.Tensor | None) -> fx.Node:
        with self.g.inserting_before(before):
            n = self.g.call_function(fn, args)
        n.meta = {k: v for k, v in like.meta.items() if k != K.CP_SEQ_DIM}
        n.meta[K.VAL] = val
        return n

    def _meta(self, shape: tuple[int, ...], like: Any) -> torch.Tensor:
        dtype = like.dtype if isinstance(like, torch.Tensor) else torch.float32
        return torch.empty(shape, dtype=dtype, device="meta")

    def select(self, x: fx.Node, dim: int, user: fx.Node) -> fx.Node:
        """x (whole along `dim`, of length T) cut at this rank's positions, before `user`."""
        shape = list(self.full[x])
        if shape[dim] != self.T:
            raise _refuse(user, f"its operand {x.name} of shape {tuple(shape)} meets the "
                                f"rank's tokens along dim {dim} with a length other than the "
                                f"sequence's {self.T}")
        shape[dim] = self.T // self.c
        return self._new(user, context_select, (x, self.cp_node(), dim), user,
                         self._meta(tuple(shape), x.meta.get(K.VAL)))

    def gather(self, x: fx.Node, user: fx.Node) -> fx.Node:
        """x (the rank's tokens along its sequence dim) gathered whole, in global order.
        When x is grouped-query attention's head repeat of smaller keys / values (repeat_kv's
        unsqueeze → expand → reshape, or repeat_interleave: `_repeat_chain`), the smaller
        tensor is gathered and the repeat re-applied to it: the exchange moves kv_heads,
        not heads, as cost/context.py prices it."""
        src, chain = self._repeat_chain(x)
        if self.span.get(src, _PURE) != _PURE:
            raise _refuse(user, f"its operand {src.name} holds the rank's tokens merged with "
                                f"other dims")
        g = self._new(user, context_gather, (src, self.cp_node(), self.dim[src]), user,
                      self._meta(self.full[src], src.meta.get(K.VAL)))
        for node in chain:              # the head repeat again, on whole sequences
            args = (g,) + tuple(node.args[1:])
            if packet(node) in _RESIZES:
                args = (g, list(self.full[node])) + tuple(node.args[2:])
            g = self._new(user, node.target, args, node,
                          self._meta(self.full[node], node.meta.get(K.VAL)))
            g.kwargs = dict(node.kwargs)
        return g

    def _repeat_chain(self, x: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
        """(the smallest value x is a token-wise data movement of, the movements from it to x
        in order): back through single-input ops that move or repeat elements within each
        token (_MOVES: never along the sequence dim, which the forward walk refused); (x, [])
        when nothing smaller feeds it."""
        path, cur = [], x
        while (cur.op == "call_function" and packet(cur) in _MOVES
               and [a for a in cur.all_input_nodes] == [cur.args[0]]
               and cur.args[0] in self.dim and self._whole_slice(cur)):
            path.append(cur)
            cur = cur.args[0]
        nodes = path + [cur] if path else [x]
        best = min(nodes, key=lambda n: math.prod(self.full[n]))   # the nearest of the smallest
        return best, nodes[:nodes.index(best)][::-1]

    def _whole_slice(self, n: fx.Node) -> bool:
        """Not a slice, or a slice that keeps its whole dim (export's `x[:, :, None]`)."""
        if packet(n) is not aten.slice:
            return True
        dim = n.args[1] if len(n.args) > 1 else 0
        start = n.args[2] if len(n.args) > 2 else 0
        end = n.args[3] if len(n.args) > 3 else None
        step = n.args[4] if len(n.args) > 4 else 1
        return (start in (0, None) and step == 1
                and (end is None or end >= self.full[n.args[0]][dim]))

    def mark(self, n: fx.Node, d: int, span: tuple[int, int, bool] | None = None) -> None:
        """n holds the rank's tokens along dim d (its VAL made local). `span` (what else dim d
        holds: self.span) defaults to a split input's whose dim has n's size."""
        if span is None:
            size = self.full[n][d] if n in self.full else None
            span = next((self.span.get(a, _PURE) for a in n.all_input_nodes if a in self.dim
                         and a in self.full and self.full[a][self.dim[a]] == size), _PURE)
        self.dim[n] = d
        self.span[n] = span
        n.meta[K.CP_SEQ_DIM] = d
        v = n.meta.get(K.VAL)
        if isinstance(v, torch.Tensor):
            shape = list(v.shape)
            if shape[d] % self.c:
                raise _refuse(n, f"its sequence dim {d} has length {shape[d]}, not divisible "
                                 f"by c={self.c}")
            shape[d] //= self.c
            n.meta[K.VAL] = self._meta(tuple(shape), v)

    # ----- the walk -------------------------------------------------------------------
    def run(self) -> None:
        for n in list(self.g.nodes):
            if n.op == "placeholder":
                s = self.full.get(n)
                if s is not None and len(s) >= 2 and s[1] == self.T:
                    self.mark(n, 1)
            elif n.op == "call_module":
                if any(a in self.dim for a in n.all_input_nodes) and not n.users:
                    self.g.erase_node(n)   # torch.export's input guards: shapes are local now
                elif any(a in self.dim for a in n.all_input_nodes):
                    raise _refuse(n, "a submodule call on the rank's tokens")
            elif n.op == "call_function":
                if any(a in self.dim for a in n.all_input_nodes):
                    self.visit(n)

    def visit(self, n: fx.Node) -> None:
        op = packet(n)
        if op is operator.getitem:
            self.mark(n, self.dim[n.args[0]])
            return
        if op in _NO_VALUE:
            self.g.erase_node(n)
            return
        if op in _SDPA:
            return self.attention(n)
        if op is aten.dropout and n.args[0] in self.dim:
            return self.dropout(n)
        if op in _RESHAPES and op not in (aten.squeeze, aten.unsqueeze):
            return self.reshape(n)
        if op in MATMUL_OPS and op is not aten.linear and op is not aten.addmm:
            return self.matmul(n)
        if op is aten.baddbmm:
            return self.baddbmm(n)
        if op in _LOSSES or op is shard_rt.vocab_parallel_cross_entropy:
            return self.loss(n)
        if op in _SP or op in _BLOCKS:
            return self.sequence_parallel(n)
        if op is aten.type_as:   # its second operand gives a dtype only (whole under SP)
            return self.mark(n, self.dim[n.args[0]]) if n.args[0] in self.dim else None
        x = n.args[1] if op is aten.addmm else n.args[0]    # addmm(bias, x, w): Conv1D's
        d = self.dim.get(x) if isinstance(x, fx.Node) else None
        out = self.full.get(n)
        if op in (aten.linear, aten.addmm) and d is not None and d < len(self.full[x]) - 1:
            if any(a in self.dim for a in n.all_input_nodes if a is not x):
                raise _refuse(n, "a projection whose weight depends on the rank's tokens")
            return self.mark(n, d)
        if op is aten.embedding or op is shard_rt.vocab_parallel_embedding:
            return self.mark(n, self.dim[n.args[1]])
        if op is shard_rt.partial_mean:   # a mean over the tensor-split dims (RMSNorm's)
            dims = [k % len(self.full[x]) for k in n.args[2]]
            if d in dims:
                raise _refuse(n, "a reduction over the sequence inside the model")
            keep = n.args[3] if len(n.args) > 3 else n.kwargs.get("keepdim", False)
            return self.mark(n, d if keep else d - sum(k < d for k in dims))
        if op is aten.transpose:
            a, b = (k % len(self.full[x]) for k in n.args[1:3])
            return self.mark(n, b if d == a else a if d == b else d)
        if op is aten.permute:
            perm = [k % len(self.full[x]) for k in n.args[1]]
            return self.mark(n, perm.index(d))
        if op is aten.unsqueeze:
            k = n.args[1] % (len(self.full[x]) + 1)
            return self.mark(n, d + 1 if k <= d else d)
        if op is aten.squeeze and len(n.args) > 1:
            dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
            dims = [k % len(self.full[x]) for k in dims]
            return self.mark(n, d - sum(k < d for k in dims))
        if op in SPLIT_OPS:
            at = 1 if op is aten.unbind else 2
            k = (n.args[at] if len(n.args) > at else n.kwargs.get("dim", 0)) % len(self.full[x])
            if k == d:
                raise _refuse(n, "a split along the sequence")
            return self.mark(n, d - (op is aten.unbind and k < d))
        if op is aten.select:       # one row of another dim (BLOOM's fused q / k / v)
            k = n.args[1] % len(self.full[x])
            if k == d:
                raise _refuse(n, "a selection along the sequence")
            return self.mark(n, d - (k < d))
        if op is aten.index:
            return self.index(n)
        if op is aten.stack:
            return self.stack(n)
        if op is aten.cat:
            return self.cat(n)
        if op in _NORMS:
            norm = len(n.args[1])
            if d >= len(self.full[x]) - norm:
                raise _refuse(n, "a norm over the sequence")
            return self.mark(n, d)
        if op in _SOFTMAX or op is aten.repeat_interleave:
            k = n.args[-1] if op is aten.repeat_interleave else n.args[1]
            k = (k if isinstance(k, int) else 0) % len(self.full[x])
            if k == d:
                raise _refuse(n, "a softmax / cumulative op along the sequence")
            return self.mark(n, d)
        if op in (aten.topk, aten.sort, aten.argsort):   # a router's pick among experts
            k = n.args[2] if op is aten.topk and len(n.args) > 2 else (
                n.args[1] if op is not aten.topk and len(n.args) > 1 else n.kwargs.get("dim", -1))
            if k % len(self.full[x]) == d:
                raise _refuse(n, "a sort along the sequence")
            return self.mark(n, d)
        if op in _REDUCE and len(n.args) > 1 and isinstance(n.args[1], (list, tuple, int)):
            dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
            dims = [k % len(self.full[x]) for k in dims]
            if d in dims:
                raise _refuse(n, "a reduction over the sequence inside the model")
            keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            return self.mark(n, d if keep else d - sum(k < d for k in dims))
        if op in (aten.expand, aten.broadcast_to):
            sizes = list(n.args[1])
            lead = len(sizes) - len(self.full[x])
            od = d + lead
            if sizes[od] not in (-1,):
                sizes[od] = sizes[od] // self.c
            n.args = (x, sizes) + tuple(n.args[2:])
            return self.mark(n, od)
        if op in (aten.slice, aten.narrow) and d is not None:
            k = n.args[1] % len(self.full[x]) if len(n.args) > 1 else 0
            if k == d:
                raise _refuse(n, "a slice of the sequence")
            return self.mark(n, d)
        if out is not None and self.pointwise(n, out):
            return None
        raise _refuse(n, "an op the sequence split has no rule for")

    def pointwise(self, n: fx.Node, out: tuple[int, ...]) -> bool:
        """Broadcasting elementwise ops (add, mul, dropout, activations, where, masked_fill...):
        the output holds the rank's tokens where a split operand does; whole operands that
        reach the sequence dim with length T are cut at the rank's positions."""
        tensors = [a for a in n.all_input_nodes if a in self.full]
        shapes = [self.full[a] for a in tensors]
        try:
            if tuple(torch.broadcast_shapes(*shapes)) != out:
                return False
        except RuntimeError:
            return False
        od = None
        for a in tensors:
            if a in self.dim:
                k = len(out) - len(self.full[a]) + self.dim[a]
                if od is not None and k != od:
                    raise _refuse(n, "operands split along different dims")
                od = k
        for a in tensors:
            if a in self.dim:
                continue
            k = od - (len(out) - len(self.full[a]))
            if k >= 0 and self.full[a][k] != 1:
                sel = self.select(a, k, n)
                n.replace_input_with(a, sel)
        self.mark(n, od)
        return True

    def sequence_parallel(self, n: fx.Node) -> None:
        """The tensor-parallel pass's cuts and gathers (x, group, dim, ...): along another dim
        they keep the rank's tokens; along the sequence they cut the rank's tokens again
        between its tensor ranks, in local order (scatter / local_blocks) and restore them
        (gather, then unshuffle_blocks when the cut was per block). Blocks along the sequence
        name global token counts per row ((T,) · B on a (B·T, C) dim): each becomes T/c."""
        x, op = n.args[0], packet(n)
        d = self.dim[x]
        outer, inner, cut = self.span.get(x, _PURE)
        if op in _BLOCKS and n.args[2] % len(self.full[x]) != d:
            return self.mark(n, d)
        if op in _BLOCKS:
            blocks = list(n.args[3])
            tokens = self.full[x][d] // (outer * inner) if not cut else None
            if inner != 1 or (op is shard_rt.local_blocks and (len(blocks) != outer
                                                                or {tokens} != set(blocks))):
                raise _refuse(n, f"a tensor-parallel split of the sequence in blocks "
                                 f"{tuple(blocks)} that are not its rows")
            n.args = n.args[:3] + ([b // self.c for b in blocks],) + n.args[4:]
        merged = (outer, inner) != (1, 1)
        if op in (coll.scatter_to_sp, coll.reduce_scatter_to_sp, shard_rt.local_blocks):
            cut = merged
        elif op is not shard_rt.unshuffle_blocks:   # a gather: restored unless per block
            cut = merged and any(packet(u) is shard_rt.unshuffle_blocks for u in n.users)
        else:
            cut = False
        self.mark(n, d, span=(outer, inner, cut))

    def index(self, n: fx.Node) -> None:
        """x[..., idx, ...] with whole index tensors on dims other than the sequence (Falcon's
        k / v heads picked from the fused projection): the sequence dim moves as advanced
        indexing moves it (behind the broadcast index dims when they are not adjacent)."""
        x, idx = n.args[0], list(n.args[1])
        d = self.dim[x]
        at = [k for k, i in enumerate(idx) if i is not None]
        if d in at or any(i in self.dim for i in idx if isinstance(i, fx.Node)):
            raise _refuse(n, "an index along the sequence, or by the rank's tokens")
        nd = len(torch.broadcast_shapes(*(self.full[i] for i in idx if i is not None)))
        if at == list(range(at[0], at[-1] + 1)):        # adjacent: in place of the indexed
            return self.mark(n, d if d < at[0] else d - len(at) + nd)
        self.mark(n, nd + d - sum(k < d for k in at))   # apart: the index dims go first

    def stack(self, n: fx.Node) -> None:
        """torch.stack of values along a new dim (GPT-J's interleaved rotary): split operands
        share their sequence dim, whole ones are cut at the rank's positions."""
        xs = list(n.args[0])
        ndim = len(self.full[n])
        k = (n.args[1] if len(n.args) > 1 else 0) % ndim
        dims = {self.dim[a] for a in xs if a in self.dim}
        if len(dims) != 1:
            raise _refuse(n, "a stack of values split along different dims")
        (d,) = dims
        new = [a if a in self.dim else self.select(a, d, n) for a in xs]
        n.args = (new,) + tuple(n.args[1:])
        self.mark(n, d + (k <= d))

    def cat(self, n: fx.Node) -> None:
        xs = list(n.args[0])
        ndim = len(self.full[n])
        k = (n.args[1] if len(n.args) > 1 else 0) % ndim
        d = next(self.dim[a] for a in xs if a in self.dim)
        if k == d:
            # an empty key/value cache (transformers' DynamicCache.update with nothing cached)
            # concatenated with the new tokens is the new tokens
            rest = [a for a in xs if a in self.dim or math.prod(self.full[a]) != 0]
            if len(rest) != 1:
                raise _refuse(n, "a concatenation along the sequence")
            n.args = (rest,) + tuple(n.args[1:])
            return self.mark(n, d)
        new = [a if a in self.dim else self.select(a, d, n) for a in xs]
        n.args = (new,) + tuple(n.args[1:])
        self.mark(n, d)

    def reshape(self, n: fx.Node) -> None:
        """The output dim whose span (row-major) holds the whole sequence of the input; its
        size constant becomes 1/c. Viewed flat, the input is (outer, T, rest): a merged dim
        such as (B, T, V) -> (B·T, V), or (T, B, E) -> (T·B, E) with B elements after each
        token, holds the rank's tokens like the input (self.span says where)."""
        x = n.args[0]
        ins, outs, d = self.full[x], self.full[n], self.dim[x]
        outer, inner, cut = self.span.get(x, _PURE)
        if cut:
            raise _refuse(n, "a reshape of merged tokens that sequence parallelism cut")
        before = math.prod(ins[:d]) * outer                # the elements' count before a token
        after = before * (ins[d] // (outer * inner))       # ... before the next (T, or T/t: SP)
        acc, j = 1, None
        for k, size in enumerate(outs):
            if acc <= before < acc * size:
                j = k
                break
            acc *= size
        if j is None or before % acc or (acc * outs[j]) % after:
            raise _refuse(n, f"a reshape {ins} -> {outs} that cuts the sequence")
        op = packet(n)
        if op is aten.unflatten:      # (x, dim, sizes): the sizes of the unflattened dims
            at = n.args[1] % len(ins)
            sizes = list(n.args[2])
            if at <= j < at + len(sizes) and sizes[j - at] != -1:
                sizes[j - at] //= self.c
            n.args = (x, at, sizes) + tuple(n.args[3:])
        elif op is not aten.flatten:  # flatten's (start, end) name no size
            sizes = list(n.args[1])
            if sizes[j] != -1:
                sizes[j] = sizes[j] // self.c
            n.args = (x, sizes) + tuple(n.args[2:])
        self.mark(n, j, span=(before // acc, acc * outs[j] // after, False))

    def matmul(self, n: fx.Node, at: int = 0) -> None:
        """a @ b with a = args[at], b = args[at + 1]: queries (a) stay local, keys / values
        (b, split) are gathered whole."""
        a, b = n.args[at], n.args[at + 1]
        ra, rb = len(self.full[a]), len(self.full[b])
        da = self.dim.get(a)
        db = self.dim.get(b)
        out = len(self.full[n])
        if db is not None:
            if da is None and not (ra >= 2 and self.full[a][-1] == self.T and db == rb - 2):
                raise _refuse(n, "a product whose right operand holds the rank's tokens")
            if db not in (rb - 1, rb - 2):
                raise _refuse(n, "a product split along a batch dim of its right operand")
            # keys (n dim: q·kᵀ) or values (k dim: p·v): the whole sequence, in order
            g = self.gather(b, n)
            n.args = n.args[:at + 1] + (g,) + n.args[at + 2:]
        if da is None:
            raise _refuse(n, "a product whose queries are whole but keys split")
        if da == ra - 1:
            raise _refuse(n, "a product contracting the rank's tokens")
        self.mark(n, out - (ra - da))

    def baddbmm(self, n: fx.Node) -> None:
        """bias + a @ b (BLOOM's ALiBi scores): the product as `matmul`; a whole bias that
        reaches the queries' dim with length T is cut at the rank's positions."""
        bias = n.args[0]
        self.matmul(n, at=1)
        od, out = self.dim[n], self.full[n]
        if bias in self.dim:
            if len(out) - len(self.full[bias]) + self.dim[bias] != od:
                raise _refuse(n, "a bias split along another dim than the product")
            return
        k = od - (len(out) - len(self.full[bias]))
        if k >= 0 and self.full[bias][k] != 1:
            n.replace_input_with(bias, self.select(bias, k, n))

    def attention(self, n: fx.Node) -> None:
        """Keys and values gathered, the mask's query rows selected, is_causal run chunk by
        chunk; attention dropout drawn from this context rank's stream (`streams`)."""
        heads_split = n.target is shard_rt.tp_sdpa     # the tensor-parallel pass's, per tp rank
        names = (_SDPA_ARGS[:3] + ("streams", "seed") + _SDPA_ARGS[3:] if heads_split
                 else _SDPA_ARGS)
        a = {**dict(zip(names, n.args)), **n.kwargs}
        q, k, v = a["query"], a["key"], a["value"]
        if any(x not in self.dim for x in (q, k, v)):
            raise _refuse(n, "attention whose queries, keys and values are not all split")
        mask, causal = a.get("attn_mask"), a.get("is_causal", False)
        dropout = a.get("dropout_p", 0.0)
        if not isinstance(dropout, (int, float)):
            raise _refuse(n, "an attention dropout probability computed in the graph")
        streams, seed = a.get("streams"), a.get("seed", _SEED)
        if dropout and streams is None:
            streams = self.streams_node()
        kg, vg = self.gather(k, n), self.gather(v, n)
        extra = {key: a[key] for key in ("scale", "enable_gqa") if key in a}
        if isinstance(mask, fx.Node):
            if mask in self.dim:
                raise _refuse(n, "a mask that depends on the rank's tokens")
            rows = len(self.full[mask]) - 2
            if self.full[mask][rows] != 1:
                mask = self.select(mask, rows, n)
        elif causal:
            # each query chunk against its key prefix (runtime/context.py): the rank computes
            # its share of the causal tiles, not a masked (T/c) × T block
            n.target = context_causal_attention
            n.args = (q, kg, vg, self.cp_node(), extra.get("scale"),
                      extra.get("enable_gqa", False), dropout, streams, seed, heads_split)
            n.kwargs = {}
            return self.mark(n, self.dim[q])
        if dropout or heads_split:
            n.target = shard_rt.tp_sdpa
            n.args = (q, kg, vg, streams, seed, mask, dropout, causal)
            n.kwargs = {**extra, "per_tensor_rank": heads_split}
        else:
            n.args, n.kwargs = (q, kg, vg, mask, dropout, causal), extra
        self.mark(n, self.dim[q])

    def streams_node(self) -> fx.Node:
        """The get_attr of the program's DropoutStreams (`tp_rng`, bound by the runtime with
        this rank's tensor and context ranks)."""
        for node in self.g.nodes:
            if node.op == "get_attr" and node.target == STREAMS_ATTR:
                return node
        if not hasattr(self.gm, STREAMS_ATTR):   # stands in for inspection, as `cp` does
            setattr(self.gm, STREAMS_ATTR, shard_rt.DropoutStreams(0))
        with self.g.inserting_after(self.cp_node()), warnings.catch_warnings():
            warnings.simplefilter("ignore")       # a plain attribute, as tp_group
            return self.g.get_attr(STREAMS_ATTR)

    def dropout(self, n: fx.Node) -> None:
        """aten.dropout on the rank's tokens (whole over the tensor group: split values already
        draw from tp_dropout's per-tensor-rank streams): this context rank's own mask."""
        x, p, train = (list(n.args) + [n.kwargs.get("p", 0.5), n.kwargs.get("train", True)])[:3]
        if isinstance(p, (int, float)) and p and train:
            n.target = shard_rt.tp_dropout
            n.args, n.kwargs = (x, p, train, self.streams_node(), _SEED), {
                "per_tensor_rank": False}
        self.mark(n, self.dim[x])

    def loss(self, n: fx.Node) -> None:
        """A token-mean loss becomes c · (the rank's token sum) / (tokens counted on every
        context rank) (`context_loss_mean`): the runtime's average over the context ranks is
        the mean over every counted token of the whole sequence, however unevenly ignored
        targets (ignore_index) fall between the rank's chunks."""
        x, y = n.args[0], n.args[1]
        if self.dim.get(x) != 0 or self.dim.get(y) != 0:
            raise _refuse(n, "a loss over values not split along their token dim 0")
        vocab = packet(n) is shard_rt.vocab_parallel_cross_entropy
        at, ignore_at, weight_at = (5, 4, None) if vocab else (3, 4, 2)
        reduction = n.args[at] if len(n.args) > at else n.kwargs.get("reduction", 1)
        if reduction != 1:
            raise _refuse(n, "a loss not reduced by its mean")
        weight = None if weight_at is None else (
            n.args[weight_at] if len(n.args) > weight_at else n.kwargs.get("weight"))
        if weight is not None:
            raise _refuse(n, "a class-weighted loss (its mean divides by the targets' weights)")
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
            mean = self.g.call_function(context_loss_mean, (n, y, self.cp_node(), ignore))
        mean.meta = {k: v for k, v in n.meta.items() if k != K.CP_SEQ_DIM}
        for u in users:
            u.replace_input_with(n, mean)


def apply_context_parallel(gm: fx.GraphModule, c: int, seq_len: int) -> fx.GraphModule:
    """Rewrite `gm` (in place) for one of c context ranks; see the module docstring."""
    if c == 1:
        return gm
    if not hasattr(gm, CP_ATTR):
        # bound by the runtime (compile.py) to this rank's ContextShard; this one, on rank 0
        # with no group, stands in for inspection and code generation (set before the rewrite
        # inserts its get_attr, so the graph never references a missing attribute)
        setattr(gm, CP_ATTR, ContextShard(group=None, c=c, cp_rank=0, seq_len=seq_len))
    _Propagation(gm, c, seq_len).run()
    gm.graph.eliminate_dead_code()
    return gm


def context_parallel_pass(plan: Any) -> Pass:
    """The pass of `plan` (c, seq_len) for the pass pipeline (autopar/build.py)."""
    return Pass(name="context_parallel",
                run=lambda gm: apply_context_parallel(gm, plan.c, plan.seq_len),
                reads=(K.VAL, K.STACK_TRACE), writes=(K.CP_SEQ_DIM, K.VAL))
