"""The context mode of the engine: the sequence split as a layout (docs/DESIGN.md §6.1).

The same engine over the context "mesh dim" (t := c), on the captured single-device graph:
the inputs' token dims are seeded Shard(1, (T,), seq=True), no column candidates are offered
(every weight stays whole), and the table's rules (rules.py) carry the split through token-wise ops,
reshapes (blocks of T per row of a merged (B·T) dim), transposes, split / cat, norms and
reductions over other dims. Four resolutions differ from the tensor-parallel ones:
  a whole operand that meets the rank's tokens (a rotary table, a position embedding, a mask
    built from arange(T)) is selected at the rank's global positions: a convert edge
    R -> Shard(seq) (context_select), never a communication;
  attention (sdpa, or written out as q·kᵀ / p·v products) keeps its queries local and reads
    its keys and values whole: convert edges Shard(seq) -> R recorded in `gathered`
    (context_gather), the only place the rank needs other ranks' tokens;
  a sum over the tokens is the rank's summand (Partial), kept through linear ops and summed
    over the context ranks where it is read whole: a convert edge Partial -> R (context_sum,
    an all-reduce whose backward sums too);
  anything the tensor-parallel engine would gather (an op with no rule, a softmax / norm /
    cumulative op along the tokens) is refused in one line naming the node and the user's
    source line.
A token-mean loss over the rank's tokens keeps role "context_loss" (context_loss_mean).

A mixture of experts routes token by token, so the rank routes its own tokens: a sort along the
tokens (transformers' sort of the (token, choice) rows by expert) gives `Rows`, the rank's rows
in an order of its own (never selected at global positions); the sort's indices are positions
among the sorted value's rows (`addresses`), and an index along a split dim must be by such
positions of that dim's order (x[perm // k] gathers the rank's tokens in sorted order; the
inverse permutation, index_put_(empty_like(perm), [perm], arange), puts them back in sequence
order). A count of the rank's rows (histc / bincount) is `Counts`: the rank's own, read as a
grouped matmul's offsets over those rows (through casts and a cumsum), and summed over the
context ranks where anything else reads it (a load-balancing statistic: context_sum, as a
Partial); a factory (arange, zeros, a *_like buffer) meeting sorted rows is made the rank's own
size.

The engine states every refusal of the context-parallel pass (passes/context_parallel.py) on
the captured graph: its rules are the pure functions below (`seq_dim_refusal`,
`dropout_refusal`, `method_refusal`, `loss_refusal`), which the pass's rewrite calls again on
the graph after the tensor split. `context_verdict` asks the engine alone, in one walk that
copies and writes nothing, what the split can build (autopar/api.py `context_offer`).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.sharding.elementwise import pointwise_rule
from autopar.passes.sharding.layout import R, Conflict, Layout, Partial, Replicate, Shard
from autopar.passes.sharding.ops import (MATMUL_OPS, NEW_FACTORIES, NO_VALUE, SOFTMAX,
                                         TRANSPARENT, is_grouped_mm, is_inplace, is_pointwise,
                                         is_tensor, like, matmul_operands, norm_dim, packet, shape,
                                         tensor_args)
from autopar.passes.sharding.propagator import Propagator
from autopar.passes.sharding.rules import rule_for
from autopar.passes.sharding.views import cat_rule, repeat_rule
from autopar.runtime.groups import hybrid_heads_rule

aten = torch.ops.aten


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


METHOD_FIX = ("plan cp_attention='all-gather' (parallelize's free choice offers only what "
              "the pass builds)")
# the methods beyond the all-gather (rules.py)
METHODS = ("ring", "all-to-all", "hybrid", "hybrid-ring")
SUBMODULE_CALL = "a submodule call on the rank's tokens"
NO_LAYOUT = "no sequence layout recorded for a value computed from the rank's tokens"


def seq_dim_refusal(length: int, dim: int, c: int) -> str | None:
    """Why a value cannot hold the rank's tokens along `dim` of `length` (c must divide it)."""
    if length % c:
        return f"its sequence dim {dim} has length {length}, not divisible by c={c}"
    return None


def dropout_refusal(dropout: Any) -> str | None:
    """Why an attention's dropout cannot be drawn per context rank: a probability the graph
    computes (the rewrite reads it as a constant)."""
    if not isinstance(dropout, (int, float)):
        return "an attention dropout probability computed in the graph"
    return None


def method_refusal(method: str | None, operands: Sequence[tuple[tuple[int, ...], int]],
                   dropout: float, c: int) -> str | None:
    """Why `method` (plan.cp_attention) cannot replace a scaled-dot-product attention whose q,
    k, v have `operands` (shape, sequence dim) — heads read from q's dim 1 — and constant
    `dropout`: ring draws no dropout; ring and all-to-all need (batch, heads, tokens, head_dim)
    operands; all-to-all gives each rank heads/c heads; the hybrid heads/k, k a divisor
    1 < k < c of c (`hybrid_heads_rule`). None for the all-gather (no rule)."""
    if method not in METHODS:
        return None
    if method in ("ring", "hybrid-ring") and dropout:
        return (f"{method} attention with attention dropout {dropout} (the ring kernel draws no "
                f"dropout)")
    if any(len(s) != 4 or d != 2 for s, d in operands):
        return f"{method} attention needs (batch, heads, tokens, head_dim) operands"
    heads = operands[0][0][1]
    if method == "all-to-all" and heads % c:
        return (f"all-to-all attention with {heads} heads (per tensor rank) over c={c} context "
                f"ranks: each rank takes heads/c of them, so c must divide {heads}")
    if method in ("hybrid", "hybrid-ring") and c > 2:   # c = 2: parallelize's trial (the
        # solver rules per c)
        return hybrid_heads_rule(heads, c)
    return None


def loss_refusal(reduction: Any, weight: Any) -> str | None:
    """Why a token loss cannot become the rank's share of the mean (context_loss_mean): it is
    not reduced by its mean (reduction 1), or its mean divides by class weights."""
    if reduction != 1:
        return "a loss not reduced by its mean"
    if weight is not None:
        return "a class-weighted loss (its mean divides by the targets' weights)"
    return None


_LOSS_OPS = frozenset({aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd})
_ALONG = frozenset({aten.topk})   # per-token picks along another dim
_SORTS = frozenset({aten.sort, aten.argsort})
_COUNTS = frozenset({aten.histc, aten.bincount})
_FACTORIES = frozenset({aten.arange, aten.zeros, aten.ones, aten.full, aten.empty})
_LIKE = frozenset({aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like})
_ORDER_FREE = _FACTORIES | _LIKE   # values that do not depend on their rows' order
COUNTS_FIX = ("the rank counts only its own tokens: such a count may group them (a grouped "
              "matmul's offsets) or be summed over the ranks — run this model with c=1")


@dataclasses.dataclass(frozen=True)
class Rows(Shard):
    """The rank's tokens (or rows made of them) in an order of its own, the one sort `perm`
    (its node's name) gave them: no row is at a global position."""
    perm: str = ""

    def __repr__(self) -> str:
        return f"Rows({self.dim}, {self.blocks}, sorted by {self.perm})"


@dataclasses.dataclass(frozen=True)
class Counts:
    """A value counted from the rank's rows (histc of its routed rows): whole-shaped, the rank's
    own on each context rank."""

    def __repr__(self) -> str:
        return "Counts()"


COUNTS = Counts()


def order(lay: Any) -> str | None:
    """The order of a split value's rows: the sort that made them (Rows), or None (the
    sequence's)."""
    return lay.perm if isinstance(lay, Rows) else None


class ContextPropagator(Propagator):
    """Propagator in the context mode (see above): `layout[node]` is Shard(dim, blocks, seq)
    where the node holds the rank's tokens along `dim`, R where it is whole on every context
    rank; `convert[node][arg]` = Shard(seq) marks a selection at the rank's positions,
    `gathered[node]` the keys / values attention reads whole.

    attention: the method the pass builds (plan.cp_attention); its refusals raise as the
    others do. None: every method — their refusals are collected in `refused` (method -> the
    first one-line refusal, in graph order) and nothing but the split's own refusals raise."""

    def __init__(self, gm: fx.GraphModule, c: int, seq_len: int,
                 attention: str | None = "all-gather"):
        names = {n.name for n in gm.graph.nodes}
        super().__init__(gm, c, off=names, refine={}, sequence_parallel=False,
                         seq_len=seq_len, vocab_multiple=1)
        self.gathered: dict[fx.Node, list[fx.Node]] = {}
        self.attention = attention
        self.refused: dict[str, str] = {}
        # index-valued values: node -> the layout of the rows their values are positions in
        # (a sort's indices, and what follows them); a sort node -> {output index: that}
        self.addresses: dict[fx.Node, Any] = {}

    def visit(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            s = shape(node)
            self.layout[node] = (Shard(1, (self.seq_len,), seq=True)
                                 if s is not None and len(s) >= 2 and s[1] == self.seq_len
                                 else R)
        elif node.op == "call_module" and node.users and any(
                isinstance(self.get(a), Shard) for a in node.all_input_nodes):
            raise context_refusal(node, SUBMODULE_CALL)
        else:
            super().visit(node)
            _follow_addresses(self, node)
            if _writes_converted(self, node):
                raise context_refusal(node, f"it writes {node.args[0].name} in place but reads "
                                            f"it converted (the write would land in a copy)")
        lay = self.layout.get(node)
        if isinstance(lay, Shard):
            s = shape(node)
            if s is not None and (why := seq_dim_refusal(s[lay.dim], lay.dim, self.t)):
                raise context_refusal(node, why)
        elif self._whole_from_tokens(node):
            raise context_refusal(node, NO_LAYOUT)

    def _whole_from_tokens(self, node: fx.Node) -> bool:
        """A value (not a scalar, not a loss) computed whole from the rank's tokens: the rewrite
        would run it on the wrong shapes."""
        return (node.op == "call_function" and bool(shape(node))
                and packet(node) not in NO_VALUE | NEW_FACTORIES   # (a buffer: no values read)
                and node.target is not operator.getitem
                and self.role.get(node) != "context_loss"
                and not isinstance(self.layout.get(node), (Counts, Partial))
                and any(isinstance(self.get(a), Shard) for a in tensor_args(node)))

    def method(self, node: fx.Node, why: str | None, method: str) -> None:
        """A refusal of attention method `method` at `node`: raised when the pass builds that
        method, recorded (the first per method) when every method is asked."""
        if why is None:
            return
        if self.attention is None:
            self.refused.setdefault(method, str(context_refusal(node, why, fix=METHOD_FIX)))
        elif self.attention == method:
            raise context_refusal(node, why, fix=METHOD_FIX)

    def rule(self, node: fx.Node) -> Any:
        op = packet(node)
        lays = [self.eff(node, a) for a in tensor_args(node)]
        if is_grouped_mm(node):
            return _context_grouped_mm(self, node)
        if not any(isinstance(lay, Shard) for lay in lays):
            if any(isinstance(lay, Counts) for lay in lays):
                return _context_counts(self, node)
            return super().rule(node)
        if len({order(lay) for lay in lays if isinstance(lay, Shard)}) > 1 \
                and op not in (aten.index, aten.index_put, aten.index_put_):
            raise context_refusal(node, "it meets the rank's tokens in sorted and in sequence "
                                        "order")
        handler = CONTEXT_RULES.get(op)
        if handler is not None:
            return handler(self, node)
        return super().rule(node)

    def demand(self, consumer: fx.Node, arg: Any, want: Layout) -> None:
        """Whole operands meeting the rank's tokens are selected (an edge R -> Shard(seq));
        a split operand demanded whole is refused (attention's gathers do not come here)."""
        if not is_tensor(arg):
            return
        cur = self.get(arg)
        if cur is None:
            self.assign(arg, R)
            cur = R
        cur = self.convert.get(consumer, {}).get(arg, cur)
        if isinstance(cur, Shard) and isinstance(want, Shard) and cur.dim == want.dim \
                and order(cur) == order(want):
            return
        if isinstance(cur, Replicate) and isinstance(want, Replicate):
            return
        if isinstance(cur, Counts) and isinstance(want, Replicate):
            self.convert.setdefault(consumer, {})[arg] = R   # summed over the ranks
            return
        if isinstance(cur, Counts):
            raise context_refusal(consumer, f"it reads {arg.name}, counted from the rank's "
                                            f"tokens, along the tokens", fix=COUNTS_FIX)
        if isinstance(cur, (Replicate, Shard)) and isinstance(want, Shard) \
                and relayable(self, arg, consumer, want):
            self.layout[arg] = want   # a factory of the rank's own size (module docstring)
            return
        if isinstance(cur, Replicate) and isinstance(want, Rows):
            raise context_refusal(consumer, f"its whole operand {arg.name} meets the rank's "
                                            f"tokens in sorted order (no global positions)")
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

    def gather_inputs(self, node: fx.Node, why: Conflict) -> Any:
        """Where the tensor-parallel engine would gather a sequence split and compute whole
        (a softmax, norm or cumulative op over it): refused, the tokens stay where they are."""
        raise context_refusal(node, why.reason.split(": ", 1)[-1].replace("split dim",
                                                                         "sequence"))


def _context_matmul(p: ContextPropagator, node: fx.Node) -> Layout:
    """A weight product is token-wise unless it contracts the tokens; an activation product
    is attention's (`_context_product`)."""
    x, w, bias, _, _ = matmul_operands(node)
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
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    dropout = {**dict(zip(names, node.args)), **node.kwargs}.get("dropout_p", 0.0)
    if (why := dropout_refusal(dropout)) is not None:
        raise context_refusal(node, why)
    for method in METHODS:
        p.method(node, method_refusal(method, [(shape(x), len(shape(x)) - 2) for x in (q, k, v)],
                                      dropout, p.t), method)
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
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    if (why := loss_refusal(reduction, weight)) is not None:
        raise context_refusal(node, why)
    p.role[node] = "context_loss"
    return R


def _context_along(p: ContextPropagator, node: fx.Node) -> Any:
    """topk along another dim than the tokens (a router's pick of experts); along them it
    would pick among every rank's tokens."""
    lay = p.eff(node, node.args[0])
    nd = len(shape(node.args[0]))
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    if norm_dim(dim, nd) == lay.dim:
        raise context_refusal(node, "a top-k along the sequence")
    return like(node, lay)


def relayable(p: ContextPropagator, arg: Any, consumer: fx.Node, want: Shard) -> bool:
    """Whether `arg`, read only by `consumer`, is a value whose rows' order does not matter (a
    factory: arange(n) from 0 by 1, zeros, ones, full, empty, or a *_like buffer) and may be
    made in `want`'s order at the rank's own size: a whole one meeting sorted rows, or a *_like
    buffer an index_put_ fills in another order."""
    if not isinstance(arg, fx.Node) or arg.op != "call_function" or len(arg.users) != 1:
        return False
    op = packet(arg)
    if shape(arg) is None or len(shape(arg)) <= want.dim or shape(arg)[want.dim] != want.size():
        return False
    if op in _LIKE:
        return isinstance(p.get(arg), Shard)
    if op not in _FACTORIES or not isinstance(want, Rows) or arg.all_input_nodes:
        return False
    if op is aten.arange:
        args = list(arg.args)
        if len(args) > 1 and (args[0] != 0 or (len(args) > 2 and args[2] != 1)):
            return False
    if op is aten.arange:
        p.addresses[arg] = want   # its values: positions among its own rows
    return True


def _writes_converted(p: ContextPropagator, node: fx.Node) -> bool:
    """An in-place op (add_, copy_, scatter_, ...) whose destination the engine put a conversion
    on (a selection, a gather, a sum): it would write into the converted copy, and the buffer
    (or the base a sliced destination views) would never see the write."""
    return (node.op == "call_function" and bool(node.args)
            and is_inplace(node.target)
            and node.args[0] in p.convert.get(node, {}))


def _follow_addresses(p: ContextPropagator, node: fx.Node) -> None:
    """Index-valued values through the ops that keep what their values point at: getitem of a
    sort's indices, casts and copies, and `// k` (positions of the (token, choice) rows over
    the top-k: positions of the tokens, in the same order)."""
    op = packet(node)
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if src is None or src not in p.addresses:
        return
    got = p.addresses[src]
    if node.target is operator.getitem:
        if isinstance(got, dict) and node.args[1] in got:
            p.addresses[node] = got[node.args[1]]
    elif op in TRANSPARENT and not isinstance(got, dict):
        p.addresses[node] = got
    elif op is aten.floor_divide and isinstance(node.args[1], int) and not isinstance(got, dict):
        p.addresses[node] = Rows(got.dim, (), perm=order(got)) if isinstance(got, Rows) \
            else Shard(got.dim, (), seq=True)   # an order, no longer a size


def _context_sort(p: ContextPropagator, node: fx.Node) -> Any:
    """sort / argsort along the rank's tokens: its rows in an order of its own (Rows), the
    indices positions among the input's rows; along another dim, per token (`_context_along`)."""
    lay = p.eff(node, node.args[0])
    nd = len(shape(node.args[0]))
    dim = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) \
        else node.kwargs.get("dim", -1)
    if norm_dim(dim, nd) != lay.dim:
        return like(node, lay)
    rows = Rows(lay.dim, lay.blocks, seq=True, perm=node.name)
    p.addresses[node] = lay if packet(node) is aten.argsort else {1: lay}
    return like(node, rows)


def _index_tensor(node: fx.Node) -> tuple[int, fx.Node] | None:
    """(dim, index) of x[..., idx] with one 1-D index tensor; None otherwise."""
    found = [(i, ix) for i, ix in enumerate(node.args[1]) if ix is not None]
    if len(found) != 1 or not is_tensor(found[0][1]) or len(shape(found[0][1])) != 1:
        return None
    return found[0]


def _context_index(p: ContextPropagator, node: fx.Node) -> Layout:
    """x[idx] along dim d, idx 1-D: the result's rows are idx's. Indexing the rank's tokens
    (x split along d) needs positions of x's order (a sort's indices); a whole x (a per-expert
    table) is read at idx's values, which must not be positions among the rank's rows."""
    x = node.args[0]
    at = _index_tensor(node)
    lx = p.eff(node, x)
    if at is None or not isinstance(p.eff(node, at[1]), Shard):
        if isinstance(lx, Shard) and at is not None and at[0] == lx.dim:
            raise context_refusal(node, "an index into the rank's tokens by whole positions")
        if any(isinstance(p.eff(node, i), Shard) for i in node.args[1] if is_tensor(i)):
            raise context_refusal(node, "an index by the rank's tokens of several dims")
        return rule_for(node)(p, node)
    d, ix = at
    li = p.eff(node, ix)
    pointed = p.addresses.get(ix)
    if isinstance(lx, Shard):
        if lx.dim != d:
            raise context_refusal(node, "the rank's tokens indexed by the rank's tokens along "
                                        "another dim")
        if not isinstance(pointed, Shard) or order(pointed) != order(lx):
            raise context_refusal(node, f"an index into the rank's tokens by {ix.name}, not "
                                        f"positions among them in their order (a sort's "
                                        f"indices)")
    else:
        if isinstance(pointed, Shard):
            raise context_refusal(node, f"positions among the rank's tokens ({ix.name}) index "
                                        f"a whole value")
        p.demand(node, x, R)
    if x in p.addresses and not isinstance(p.addresses[x], dict):
        p.addresses[node] = p.addresses[x]
    return replace(li, dim=d)


def _context_index_put(p: ContextPropagator, node: fx.Node) -> Layout:
    """dest[idx] = values (a scatter by positions, the inverse permutation's): values' rows
    are idx's, dest's rows those idx's values point at, which the result keeps."""
    dest, values = node.args[0], node.args[2]
    at = _index_tensor(node)
    pointed = p.addresses.get(at[1]) if at is not None else None
    if at is None or not isinstance(pointed, Shard) or not pointed.blocks \
            or at[0] != pointed.dim or shape(dest)[at[0]] != pointed.size():
        raise context_refusal(node, "a scatter into the rank's tokens not by positions among "
                                    "them (a sort's indices)")
    li = p.eff(node, at[1])
    p.demand(node, dest, pointed)
    p.demand(node, values, replace(li, dim=at[0]))
    if values in p.addresses and not isinstance(p.addresses[values], dict):
        p.addresses[node] = p.addresses[values]
    return pointed


def _context_histc(p: ContextPropagator, node: fx.Node) -> Counts:
    """histc / bincount of the rank's rows: the rank's own counts."""
    return COUNTS


def _context_counts(p: ContextPropagator, node: fx.Node) -> Any:
    """An op on the rank's counts: a cast, copy or cumsum keeps them the rank's own (a grouped
    matmul's offsets: linear, so a later sum over the ranks is still exact); any other op reads
    them summed over the context ranks (context_sum: a load-balancing statistic's counts)."""
    if packet(node) in (aten.cumsum, *TRANSPARENT) and len(tensor_args(node)) == 1:
        return like(node, COUNTS)
    for a in tensor_args(node):
        if isinstance(p.eff(node, a), Counts):
            p.convert.setdefault(node, {})[a] = R
    return Propagator.rule(p, node)


def _context_grouped_mm(p: ContextPropagator, node: fx.Node) -> Layout:
    """A grouped matmul (an expert chain) over the rank's rows grouped by the rank's counts:
    row-wise, the experts' weights whole."""
    x = node.args[0]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    lx = p.eff(node, x)
    if not isinstance(lx, Shard):
        return rule_for(node)(p, node)
    if lx.dim != 0 or not isinstance(p.eff(node, offs), Counts):
        raise context_refusal(node, "a grouped matmul over the rank's tokens whose groups are "
                                    "not counted from them")
    for a in tensor_args(node):
        if a is not x and a is not offs:
            p.demand(node, a, R)
    return replace(lx, dim=0)


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
    return cat_rule(p, node)


CONTEXT_RULES = {
    **{op: _context_matmul for op in MATMUL_OPS},
    aten.baddbmm: _context_baddbmm,   # (bmm is in MATMUL_OPS)
    aten.scaled_dot_product_attention: _context_sdpa,
    **{op: _context_loss for op in _LOSS_OPS},
    **{op: _context_along for op in _ALONG},
    **{op: _context_sort for op in _SORTS},
    **{op: _context_histc for op in _COUNTS},
    aten.index: _context_index, aten.floor_divide: pointwise_rule,   # (untagged pointwise)
    aten.index_put: _context_index_put, aten.index_put_: _context_index_put,
    **{op: _context_softmax for op in SOFTMAX},
    aten.cat: _context_cat,
    aten.repeat: repeat_rule,   # the rank's rows repeated (Llama 4's once per expert)
}


def context_layouts(gm: fx.GraphModule, c: int, seq_len: int,
                    attention: str = "all-gather") -> ContextPropagator:
    """The sequence split of the captured single-device graph `gm` over c context ranks, as
    the engine's layouts (ContextPropagator); raises context_refusal's ValueError where the
    split (with attention method `attention`, plan.cp_attention) cannot run."""
    return ContextPropagator(gm, c, seq_len, attention).run()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextVerdict:
    """What the sequence split of one graph over c ranks can build: `split`, the one-line
    refusal of the split itself (None: it runs), and `methods`, the first refusal of each
    attention method beyond the all-gather met before it (METHODS; absent: it builds)."""
    split: str | None
    methods: dict[str, str] = dataclasses.field(default_factory=dict)

    def refusal(self, attention: str = "all-gather") -> str | None:
        """The pass's refusal under `attention` (its ValueError's text), or None: the first in
        graph order, as the pass raises it."""
        return self.methods.get(attention) or self.split


def context_verdict(gm: fx.GraphModule, c: int, seq_len: int) -> ContextVerdict:
    """The engine's verdict on splitting `gm`'s sequences over c ranks with every attention
    method, in one walk of the graph: nothing is copied, rewritten or written into meta."""
    engine = ContextPropagator(gm, c, seq_len, attention=None)
    try:
        engine.run()
    except ValueError as exc:
        return ContextVerdict(split=str(exc), methods=dict(engine.refused))
    return ContextVerdict(split=None, methods=dict(engine.refused))
