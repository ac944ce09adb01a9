"""What the rules ask of a node: its op (`packet`), shape and tensor operands, the op families the
rules dispatch on, and graph queries (a matmul's operands, a parameter's root, a router, a
grouped matmul, a constant selection). No layouts are decided here.
"""
from __future__ import annotations

import operator
import os
from typing import Any

import torch
import torch.fx as fx

from autopar.passes import meta as K

aten = torch.ops.aten

# ----- op families ------------------------------------------------------------------------------

TRANSPARENT = {aten.alias, aten.detach, aten.to, aten._to_copy, aten.clone, aten.contiguous,
                aten.lift_fresh_copy, aten.type_as}
RESHAPES = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten,
             aten.squeeze, aten.unsqueeze}
# x.new_empty(sizes) and its kin: a fresh buffer of x's dtype and device (x's values unread)
NEW_FACTORIES = frozenset({aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full})
SIZE_ARG_OPS = frozenset({aten.view, aten.reshape, aten._unsafe_view, aten.expand,
                          aten.broadcast_to}) | NEW_FACTORIES   # (x, sizes, ...)
_NONPOINTWISE_ELEMENTWISE = {aten.dropout, aten.to, aten._to_copy, aten.type_as, aten.alias,
                             aten.contiguous, aten.detach, aten.lift_fresh_copy, aten.zeros_like,
                             aten.ones_like, aten.empty_like, aten.full_like,
                             aten.native_dropout, aten.where}   # where(c, x, scalar): untagged
REDUCE_DIM = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.max,
               aten.min, aten.argmax, aten.argmin, aten.logsumexp, aten.any, aten.all,
               aten.linalg_vector_norm}
SOFTMAX = {aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.cumsum}
MATMUL_OPS = frozenset({aten.linear, aten.addmm, aten.mm, aten.matmul, aten.bmm})
NO_VALUE = {aten._assert_tensor_metadata, aten._assert_scalar, aten.sym_constrain_range_for_size}
SPLIT_OPS = frozenset({aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
                       aten.tensor_split})
SELECT_OPS = frozenset({aten.slice, aten.narrow, aten.index})   # rows of a dim (selected_range)
NLL_OPS = frozenset({aten.nll_loss, aten.nll_loss_nd})

# numpy_T (`w.T`: all dims reversed) and mT (last two swapped) are how some models
# (transformers' Falcon, `x @ self.weight.T`) transpose a weight.
CHAIN_OPS = TRANSPARENT | {aten.t, aten.transpose, aten.permute, aten.numpy_T, aten.mT}

def packet(node: fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", node.target)

def shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get(K.VAL) if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None

def is_tensor(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get(K.VAL), torch.Tensor)

def is_pointwise(node: fx.Node) -> bool:
    target = node.target
    if packet(node) in _NONPOINTWISE_ELEMENTWISE:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags

def is_inplace(target: Any) -> bool:
    """An in-place aten op (add_, copy_, scatter_, ...). torch.Tag.inplace where this torch
    has it (2.13); torch 2.11 has no such tag, so there its schema says: the first argument
    written and the op's name ending in `_` (which also counts a few list ops the tag leaves
    out: conservative)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    tag = getattr(torch.Tag, "inplace", None)
    if tag is not None:
        return tag in target.tags
    return schema_inplace(target)

def schema_inplace(target: torch._ops.OpOverload) -> bool:
    """`is_inplace` by the op's schema alone (torch without Tag.inplace)."""
    schema = target._schema
    alias = schema.arguments[0].alias_info if schema.arguments else None
    return bool(alias is not None and alias.is_write
                and schema.name.split("::")[-1].endswith("_"))

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

def like(node: fx.Node, lay: Any) -> Any:
    val = node.meta.get(K.VAL)
    if isinstance(val, (tuple, list)):
        return tuple(lay for _ in val)
    return lay

def tensor_args(node: fx.Node) -> list[fx.Node]:
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

def singleton_view(node: fx.Node) -> bool:
    """A view or expand of a parameter that only adds, drops or broadcasts size-1 dims (an
    attention sink's (H,) -> (1, H, 1, 1) -> (B, H, T, 1)): its split dim maps through, so a
    per-head parameter is split with the heads its consumer splits."""
    op = packet(node)
    if op not in RESHAPES and op is not aten.expand or not isinstance(node.args[0], fx.Node):
        return False
    src, dst = shape(node.args[0]), shape(node)
    if src is None or dst is None:
        return False
    if op is aten.expand:
        return len(dst) >= len(src) and all(
            a == b or a == 1 for a, b in zip(src, dst[len(dst) - len(src):]))
    return [d for d in src if d != 1] == [d for d in dst if d != 1]

def _singleton_dim(node: fx.Node, dim: int, forward: bool) -> int:
    """`dim` mapped through a `singleton_view` (forward: input -> output); a broadcast or
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

def chain_dim(node: fx.Node, dim: int, forward: bool) -> int:
    op = packet(node)
    if op not in CHAIN_OPS and singleton_view(node):
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
            and packet(node) in TRANSPARENT:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) and not value.is_meta else None

def reduce_dims(node: fx.Node) -> tuple[list[int], bool]:
    """(the non-negative dims a reduction `node` reduces over, keepdim); no dims or an empty
    list means all of them, as in aten."""
    nd = len(shape(node.args[0]))
    at = 2 if packet(node) is aten.linalg_vector_norm else 1    # (x, ord, dim, keepdim)
    dims = node.args[at] if len(node.args) > at else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        dims = list(range(nd))
    dims = [norm_dim(d, nd) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    keep = bool(node.args[at + 1] if len(node.args) > at + 1 else node.kwargs.get("keepdim",
                                                                                    False))
    return dims, keep

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

def is_expert_bmm(node: fx.Node) -> bool:
    """A batched matmul of activations (E, N, K) by a 3-D parameter (E, K, M), batch i of the
    rows times w[i]: experts run as one bmm, each over its own batch of rows (Llama 4's
    experts: every token, weighted by the router's score for that expert). Exact to spread
    over ranks by whole batches, whatever the rows mean."""
    if not (node.op == "call_function" and packet(node) is aten.bmm
            and isinstance(node.args[0], fx.Node)):
        return False
    w, x = param_root(node.args[1]), node.args[0]
    wv, xv = (w.meta.get(K.VAL) if w is not None else None), x.meta.get(K.VAL)
    return (param_root(x) is None and isinstance(wv, torch.Tensor) and wv.dim() == 3
            and isinstance(xv, torch.Tensor) and xv.dim() == 3
            and int(xv.shape[0]) == int(wv.shape[0]))

def reaches(start: fx.Node, hit: Any, through: Any) -> bool:
    """Whether a node for which hit(node) holds is reached from start's users, walking on
    only past nodes for which through(node) holds (each node looked at once)."""
    todo, seen = list(start.users), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if hit(n):
            return True
        if through(n):
            todo.extend(n.users)
    return False


def is_router(node: fx.Node) -> bool:
    """A mixture-of-experts router: a weight matmul whose scores reach a top-k (through casts
    and a softmax / sigmoid) — replicated, never a column candidate: the top-k reads every
    expert's score (the experts themselves are split, see grouped_mm_rule)."""
    return reaches(node, lambda n: packet(n) is aten.topk,
                   lambda n: (packet(n) in TRANSPARENT or packet(n) in SOFTMAX
                              or packet(n) is aten.sigmoid or n.target is operator.getitem))

def matmul_operands(node: fx.Node) -> tuple:
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
    if not (param_root(w) and shape(w) and len(shape(w)) == 2):
        return x, None, None, 0, 0
    if bias is not None and not param_root(bias):
        return x, None, None, 0, 0
    return x, w, bias, wk, wn

def param_root(node: Any) -> fx.Node | None:
    while isinstance(node, fx.Node):
        if node.op == "get_attr":
            return node
        if node.op != "call_function" or packet(node) not in CHAIN_OPS:
            return None
        node = node.args[0]
    return None

def ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it reads, transitively."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen
