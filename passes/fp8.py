"""The FP8 pass: a chunk's linear GEMMs as scaled FP8 matmuls (autopar/runtime/fp8.py).

Requires: a chunk graph after the tensor-parallel rewrite (and overlap), captured in bf16;
`aten.linear` nodes and `collectives.column_parallel` nodes of layout "linear".
Guarantees: each linear the rule below picks calls `fp8_linear` (a column-parallel group
`fp8_column_parallel`) with the recipe and, at t > 1, the tensor group and whether its forward
(row-parallel: the weight split along its input features) or its input gradient
(column-parallel: split along its output features) is a partial sum over the group, and at
c > 1 the context shard (a get_attr CP_ATTR added at the graph's top: its group holds the
sequence's other tokens, over which the token operands' amaxes are reduced); every other node
is unchanged. Bad GEMM shapes raise one line (value, rule, fix).
Reads node.meta: VAL, REGION, TP_PARAM. Writes: nothing (the replaced nodes keep theirs).

The rule, stated once (FP8_RULE): a linear runs in FP8 iff it lies in a transformer block
(REGION ("block", i): the embedding's and the head's GEMMs — the LM head — stay bf16), its
local weight has at least FP8_MIN_DIM rows and columns (smaller GEMMs, e.g. a router over a
few experts, stay bf16: too small to gain), and its output does not feed a top-k (a router
of any size stays bf16: routing decisions are sensitive to rounding, as torchao's and
Megatron's recipes keep it). A picked GEMM whose dimensions (in, out features, tokens of
the micro-batch) are not multiples of 16 is refused: FP8 tensor cores (and _scaled_mm on
GPU) need them.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx

from autopar.passes import meta as K
from autopar.passes.context_parallel import CP_ATTR
from autopar.passes.manager import Pass
from autopar.runtime import collectives as C
from autopar.runtime.fp8 import RECIPES, fp8_column_parallel, fp8_linear

aten = torch.ops.aten
FP8_MIN_DIM = 16          # torchao's auto filters skip GEMMs with K or N below this scale
FP8_RULE = ("a linear runs in FP8 iff it lies in a transformer block (not the embedding or "
            "the LM head), its weight is at least 16×16 and its output feeds no top-k (a router)")
_TOPK = {aten.topk.default}


def fp8_pass(recipe: str) -> Pass:
    """The pass turning a chunk's picked linears into FP8 ones (module docstring)."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8_pass: recipe={recipe!r}: must be one of {sorted(RECIPES)}")
    return Pass(f"fp8-{recipe}", lambda gm: _rewrite(gm, recipe),
                reads=(K.VAL, K.REGION, K.TP_PARAM))


def _rewrite(gm: torch.fx.GraphModule, recipe: str) -> torch.fx.GraphModule:
    group = next((n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "tp_group"),
                 None)
    context = None
    if hasattr(gm, CP_ATTR):     # c > 1: a fresh get_attr before any linear
        first = next(n for n in gm.graph.nodes if n.op != "placeholder")
        with gm.graph.inserting_before(first), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # a plain attribute, as tp_group
            context = gm.graph.get_attr(CP_ATTR)
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.linear.default and _picked(n, n.args[0], [n.args[1]]):
            x, w, b = n.args[0], n.args[1], n.args[2] if len(n.args) > 2 else None
            split = w.meta.get(K.TP_PARAM)
            n.target = fp8_linear
            n.args = (x, w, b, recipe, group if split is not None else None,
                      split is not None and split.dim == 1, split is not None and split.dim == 0,
                      context)
        elif (n.target is C.column_parallel and len(n.args) == 6
              and all(lay == "linear" for lay in n.args[2])
              and _picked(n, n.args[0], list(n.args[3]))):
            n.target = fp8_column_parallel      # (x, group, layouts, weights, biases, sp_dim)
            n.args = (*n.args, recipe, context)
    if context is not None and not context.users:
        gm.graph.erase_node(context)
    return gm


def _picked(node: torch.fx.Node, x: torch.fx.Node, weights: list) -> bool:
    """FP8_RULE for `node` (a linear or a column-parallel group) with input x; raises on a
    picked GEMM whose dimensions are not multiples of 16."""
    # (the overlap pass's fused column-parallel node carries no REGION: its users' tell)
    region = next((n.meta[K.REGION] for n in [node, *node.users, *weights]
                   if isinstance(n, torch.fx.Node) and n.meta.get(K.REGION)), None)
    if not region or region[0] != "block" or _feeds_topk(node):
        return False
    shapes = []
    for w in weights:
        val = w.meta.get(K.VAL) if isinstance(w, torch.fx.Node) else None
        if val is None or val.dim() != 2 or min(val.shape) < FP8_MIN_DIM:
            return False
        shapes.append(tuple(val.shape))
    xval = x.meta.get(K.VAL)
    tokens = xval.numel() // xval.shape[-1] if isinstance(xval, torch.Tensor) else 16
    for (out_f, in_f) in shapes:
        for what, dim in (("out features", out_f), ("in features", in_f), ("tokens", tokens)):
            if dim % 16:
                raise ValueError(
                    f"precision fp8: {node.name} has {what} = {dim} (weight {out_f}×{in_f} on "
                    f"this tensor rank, {tokens} tokens a micro-batch), not a multiple of 16: "
                    f"FP8 GEMMs need multiples of 16; pad the model's dimensions (or the "
                    f"micro-batch's tokens) to multiples of 16, or train in bf16")
    return True


def _feeds_topk(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether node's value reaches a top-k within `depth` ops (a router's logits)."""
    frontier = [node]
    for _ in range(depth):
        frontier = [u for f in frontier for u in f.users]
        if any(u.op == "call_function" and u.target in _TOPK for u in frontier):
            return True
    return False


def fp8_only_weights(gm: torch.fx.GraphModule) -> set[str]:
    """The attributes of `gm` that only tensorwise FP8 linears read, each as a weight (what a
    ZeRO-3 FP8 all-gather may hand over cast: runtime/zero3_chunks.py Fp8Gather)."""
    uses: dict[str, list[bool]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            uses.setdefault(n.target, []).extend(_as_fp8_weight(u, n) for u in n.users)
    return {target for target, ok in uses.items() if ok and all(ok)}


def _as_fp8_weight(user: torch.fx.Node, w: torch.fx.Node) -> bool:
    """Whether `user` reads `w` only as the weight of a tensorwise FP8 GEMM."""
    if user.op != "call_function":
        return False
    if user.target is fp8_linear:        # (x, w, b, recipe, ...)
        x, weight, b, recipe = user.args[:4]
        return weight is w and w is not x and w is not b and recipe == "tensorwise"
    if user.target is fp8_column_parallel:   # (x, group, layouts, weights, biases, sp, recipe,
        x, _, _, weights, biases, _, recipe = user.args[:7]            # context)
        return (w in weights and w is not x and w not in biases and recipe == "tensorwise")
    return False
