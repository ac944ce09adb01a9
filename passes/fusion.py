"""The fusion model the profile is measured under: which elementwise ops a GPU stack runs as one
kernel (`Fusion`), and the ops that only re-describe memory (`VIEW_OPS`, no bytes moved).

Read by passes/graph_facts.py (`GraphFacts.fusion`, made once per graph) for
passes/graph_profile.py's non-GEMM bytes and passes/activation_meter.py's saved tensors.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten


# Ops that only re-describe memory (no bytes moved) and are skipped by other_bytes.
VIEW_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                      aten.transpose.int, aten.t.default, aten.permute.default, aten.expand.default,
                      aten.numpy_T.default, aten.mT.default,   # `w.T` / `w.mT` (Falcon's x @ w.T)
                      aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
                      aten.squeeze.default, aten.alias.default, aten.split.Tensor,
                      aten.split_with_sizes.default, aten.detach.default, aten.flatten.using_ints,
                      aten.chunk.default, aten.unflatten.int, aten._assert_tensor_metadata.default,
                      aten.to.dtype, aten.to.dtype_layout, aten.unbind.int})


DROPOUT_OPS = frozenset({aten.dropout.default, aten.native_dropout.default})


_CASTS = frozenset({aten.type_as.default, aten._to_copy.default})


# Normalisations: one kernel each (Apex / Transformer Engine), outputs a pointwise function of
# the input and the statistics the kernel saves
_NORMS = frozenset({aten.layer_norm.default, aten.native_layer_norm.default,
                    aten.rms_norm.default})


def _dropout_is_identity(n: torch.fx.Node) -> bool:
    """aten.dropout with p = 0 or train = False returns its input (no kernel, no mask)."""
    if n.target is not aten.dropout.default:
        return False
    p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
    train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
    return p == 0 or not train


class Fusion:
    """The elementwise chains a GPU stack runs as single kernels, as a fusing compiler (torch
    Inductor) or hand-fused kernels (Megatron-LM's bias-GeLU, bias-SwiGLU, bias-dropout-add;
    Apex / Transformer Engine norms) do: pointwise ops, reductions and dropout joined through
    their edges, unless a non-fusable op (a GEMM, softmax, attention, a norm kernel, a copy)
    lies between them on some path (`stage`: the non-fusable ops on the longest path before a
    node). Views are transparent. A fused kernel reads each outside input once, writes the
    values used outside it (`escapes`), and keeps its intermediates in registers: in backward
    it recomputes them from its inputs, so autograd's saves of intermediates cost no memory
    (`internal`)."""

    def __init__(self, gm: torch.fx.GraphModule):
        parent: dict[torch.fx.Node, torch.fx.Node] = {}

        def find(x: torch.fx.Node) -> torch.fx.Node:
            while parent[x] is not x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        stage: dict[torch.fx.Node, int] = {}
        for n in gm.graph.nodes:
            if self.is_view(n):
                continue
            ins = [self.source(a) for a in n.all_input_nodes]
            stage[n] = max((stage.get(a, 0) + (0 if a in parent else 1) for a in ins), default=0)
            if self._fusable(n):
                parent[n] = n
                for a in ins:
                    if a in parent and stage.get(a) == stage[n]:
                        parent[find(a)] = find(n)
        self.group = {n: find(n) for n in parent}
        self.members: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for n, root in self.group.items():  # in graph order
            self.members.setdefault(root, []).append(n)
        self._users = {n: self._real_users(n) for n in self.group}

    @staticmethod
    def is_view(n: torch.fx.Node) -> bool:
        """Moves no bytes: a view, a tuple item, a cast (16-bit in training: the profile counts
        every float at 2 bytes), dropout that returns its input."""
        return n.op == "call_function" and (n.target in VIEW_OPS or n.target in _CASTS
                                            or n.target is operator.getitem
                                            or _dropout_is_identity(n))

    @staticmethod
    def _fusable(n: torch.fx.Node) -> bool:
        if n.op != "call_function":
            return False
        if n.target in DROPOUT_OPS or n.target is aten.cat.default:  # cat: indexing, pointwise
            return True
        tags = getattr(n.target, "tags", ())
        return torch.Tag.pointwise in tags or torch.Tag.reduction in tags

    def source(self, n: Any) -> Any:
        while isinstance(n, torch.fx.Node) and self.is_view(n) and n.all_input_nodes:
            n = n.args[0]
        return n

    def _real_users(self, n: torch.fx.Node) -> list:
        out, todo = [], list(n.users)
        while todo:
            u = todo.pop()
            if self.is_view(u):
                todo.extend(u.users)
            else:
                out.append(u)
        return out

    def same(self, a: Any, b: Any) -> bool:
        return a in self.group and b in self.group and self.group[a] is self.group[b]

    def escapes(self, n: torch.fx.Node) -> bool:
        """n's value leaves its fused kernel (read by an op outside it, or the output)."""
        return any(not self.same(n, u) for u in self._users[n])

    def internal(self, n: Any) -> bool:
        """n is an intermediate of a fused kernel: computed and consumed inside it."""
        return n in self.group and not self.escapes(n)

    def recomputable(self, n: Any, kept: set, per_batch: set) -> bool:
        """Whether n, a fused kernel's value, can be recomputed in backward from values kept
        anyway: n and the kernel's values it is computed from read, from outside the kernel,
        only kept values, parameters and constants (no dependence on the batch)."""
        if n.op == "call_function" and n.target in _NORMS:  # from its input and statistics
            src = self.source(n.args[0])
            return src in kept or src.op == "get_attr" or src not in per_batch
        if n not in self.group:
            return False
        rec: dict[torch.fx.Node, bool] = {}  # available in backward without n's own save
        for m in self.members[self.group[n]]:  # graph order: inputs before their users
            rec[m] = (m is not n and m in kept) or all(
                rec.get(src, False) if self.same(m, src) else
                (src.op == "get_attr" or src not in per_batch or src in kept)
                for src in (self.source(a) for a in m.all_input_nodes))
            if m is n:
                return rec[m]
        return False

    def reads_from_outside(self, n: torch.fx.Node, a: torch.fx.Node) -> bool:
        """Whether the fused kernel of n reads input a at n: a comes from outside the kernel
        and no earlier member of it reads the same value (read once per kernel)."""
        src = self.source(a)
        if self.same(n, src):
            return False
        for m in self.members[self.group[n]]:
            if m is n:
                return True
            if any(self.source(x) is src for x in m.all_input_nodes):
                return False
        return True
