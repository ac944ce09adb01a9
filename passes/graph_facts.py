"""What the captured graph says, computed once for the profile (passes/graph_profile.py): the
GEMMs and their weights, the block's residual stream and Megatron's column / row
classification of its GEMMs (`GraphFacts`), the model's dims, and the node helpers the
profile's counting and its activation meter (passes/activation_meter.py) share.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from autopar.passes import meta as K
from autopar.passes.fusion import VIEW_OPS, Fusion
from autopar.passes.loss_precision import LOSS_OPS
from autopar.passes.expert_chains import expert_bmm_chains
from autopar.passes.sharding import fed_by_grouped_mm, is_grouped_mm, reaches

aten = torch.ops.aten


WEIGHT_GEMMS = {aten.mm.default, aten.addmm.default, aten.linear.default, aten.matmul.default,
                 aten.bmm.default, aten.baddbmm.default}


SDPA_OPS = {aten.scaled_dot_product_attention.default}


TRAIN_BYTES_PER_ELEM = 2  # 16-bit training precision for floating activations


# Ops that repeat key/value heads for grouped-query attention (transformers' repeat_kv:
# unsqueeze → expand → reshape); a GQA-native fused kernel reads the tensor before them.
_REPEAT_OPS = frozenset({aten.expand.default, aten.unsqueeze.default, aten.slice.Tensor,
                         aten.reshape.default, aten.view.default, aten._unsafe_view.default,
                         aten.clone.default, aten.repeat_interleave.self_int})


# The loss runs in fp32 under mixed precision (passes/loss_precision.py: as torch.autocast,
# Megatron-LM and torchtitan, and autopar's runtime): it reads the 16-bit logits, writes and
# saves fp32 log-probs.
FP32_LOSS_OPS = LOSS_OPS


LOSS_BYTES_PER_ELEM = 4


def node_val(n: Any) -> Any:
    return n.meta.get(K.VAL) if isinstance(n, torch.fx.Node) else None


def numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def train_bytes(t: torch.Tensor) -> float:
    if t.dtype.is_floating_point:
        return t.numel() * TRAIN_BYTES_PER_ELEM
    return t.numel() * t.element_size()


class GraphFacts:
    """Structural facts shared by the per-region passes (computed once)."""

    def __init__(self, gm, structure, nodes, params, batch):
        self.gm, self.structure, self.nodes, self.params, self.batch = (
            gm, structure, nodes, params, batch)
        self.block0 = set(structure.unit_nodes)
        self.tp: dict[str, Any] = {}
        self.row_gemms = 0
        self.row_nodes: list[torch.fx.Node] = []
        self.tied = False
        self.sdpa: list[torch.fx.Node] = []
        self.batched: list[torch.fx.Node] = []  # activation × activation GEMMs (unfused attention)
        self.col_widths: list[tuple[torch.fx.Node, int]] = []
        self.vocab_embedding = self._vocab_embedding()
        self.embedding_param_ids = {params[nodes[x].target][0] for x in structure.embedding_nodes
                                    if nodes[x].op == "get_attr" and nodes[x].target in params}
        self.hidden = self._hidden()
        self.fusion = Fusion(gm)
        self.mask_notes: list[str] = []
        # experts run as batched matmuls that ep can spread (passes/expert_chains.py): their
        # bmms, and one entry per chain (its rows are dispatched once)
        chains = expert_bmm_chains(gm)
        self.expert_bmms = {n for c in chains for n in c.bmms}
        self.bmm_dispatchers = {c.entries[0] for c in chains}
        self._classify_block()

    # -- dims ---------------------------------------------------------------------------------
    def _vocab_embedding(self) -> torch.fx.Node | None:
        """The embedding lookup indexed by an input (the token ids); the largest table wins."""
        embs = [self.nodes[x] for x in self.structure.embedding_nodes
                if self.nodes[x].target is aten.embedding.default]
        by_input = [e for e in embs if getattr(param_root(e.args[1]), "op", "") == "placeholder"]
        return max(by_input or embs, key=lambda e: node_val(e.args[0]).shape[0], default=None)

    def _hidden(self) -> int:
        for x in self.structure.unit_inputs:
            v = node_val(self.nodes[x])
            if isinstance(v, torch.Tensor) and v.dim() == 3 and v.dtype.is_floating_point:
                return int(v.shape[-1])
        raise ValueError("profile_from_graph: block 0 has no (B, T, hidden) floating input; "
                         "cannot tell the hidden size")

    def _attention(self) -> tuple | None:
        """(q, k, v) as attention reads them: sdpa's operands, or, for attention written out
        (matmul / bmm / baddbmm, e.g. BLOOM's ALiBi), the scores GEMM q·kᵀ (the block's first
        activation × activation GEMM) and the context GEMM's value operand."""
        if self.sdpa:
            return tuple(self.sdpa[0].args[:3])
        if len(self.batched) < 2:
            return None
        q, k = gemm_operands(self.batched[0])
        return q, k, gemm_operands(self.batched[1])[1]

    def dims(self) -> dict[str, int]:
        heads, hd = 1, self.hidden
        if self.sdpa:
            q = node_val(self.sdpa[0].args[0])
            heads, hd = int(q.shape[-3]), int(q.shape[-1])
        elif (attn := self._attention()) is not None:  # (B·H, L, E) or (B, H, L, E)
            heads = numel(node_val(self.batched[0]).shape[:-2]) // self.batch   # H per sequence
            hd = int(node_val(attn[0]).shape[-1])
        kv = self._kv_heads(hd, heads)
        mlp = [w for nd, w in self.col_widths if nd not in self._attn_gemms]
        vocab = (int(node_val(self.vocab_embedding.args[0]).shape[0]) if self.vocab_embedding
                 is not None else 0)
        return {"hidden": self.hidden, "heads": heads, "kv_heads": kv, "vocab": vocab,
                "ffn": max(mlp, default=4 * self.hidden)}

    def _kv_heads(self, hd: int, heads: int) -> int:
        kv = self._kv_heads_from_widths(hd, heads)
        if kv > 0 and heads % kv == 0:
            return kv
        # not a grouping of the heads (multi-head latent attention: a fused k/v projection
        # whose k and v head dims differ, the rotary part of k from another projection):
        # the heads the attention's key holds
        k = node_val(self._attention()[1])
        return int(k.shape[-3]) if k is not None and k.dim() == 4 else heads

    def _kv_heads_from_widths(self, hd: int, heads: int) -> int:
        attn = self._attention()
        if attn is None:
            return heads
        q_g, k_g = self._feeding_gemm(attn[0]), self._feeding_gemm(attn[1])
        if k_g is None:
            return heads
        width = int(node_val(k_g).shape[-1])
        if k_g is q_g:  # fused qkv: width = hd · (heads + 2 · kv)
            return (width // hd - heads) // 2
        v_g = self._feeding_gemm(attn[2])
        if v_g is k_g:  # fused kv
            return width // hd // 2
        return width // hd

    def _feeding_gemm(self, n: torch.fx.Node) -> torch.fx.Node | None:
        """The nearest weight GEMM upstream of n (BFS through non-GEMM ops)."""
        seen, frontier = set(), [n]
        while frontier:
            nxt = []
            for x in frontier:
                if not isinstance(x, torch.fx.Node) or x in seen or x.op != "call_function":
                    continue
                seen.add(x)
                if x.target in WEIGHT_GEMMS and weight_of(x) is not None:
                    return x
                nxt.extend(x.all_input_nodes)
            frontier = nxt
        return None

    # -- block classification -------------------------------------------------------------------
    def _classify_block(self) -> None:
        block = [self.nodes[x] for x in self.structure.unit_nodes]
        gemms = {n for n in block if is_gemm(n)}
        ins = {self.nodes[x] for x in self.structure.unit_inputs}
        outs = {self.nodes[x] for x in self.structure.unit_outputs}
        # The residual stream: nodes on a GEMM-free path from a block input to a block output.
        reach = set(ins)
        for n in block:
            if n not in gemms and any(a in reach for a in n.all_input_nodes):
                reach.add(n)
        to_out = set(outs)
        for n in reversed(block):
            if n not in gemms and any(u in to_out for u in n.users):
                to_out.add(n)
        stream = {n for n in reach if n in to_out}
        # GEMM-free functions of the block inputs and the stream (e.g. a norm of the stream).
        pure = set(ins) | stream
        for n in block:
            if n not in gemms and n.all_input_nodes and all(
                    a in pure or a.op == "get_attr" for a in n.all_input_nodes):
                pure.add(n)
        self._attn_gemms = set()
        for n in block:
            if n.target in SDPA_OPS:
                self.sdpa.append(n)
                self._attn_gemms.update(self._feeding_gemm(a) for a in n.args[:3])
            if n not in gemms:
                continue
            if is_grouped_mm(n):
                # the experts of a mixture: the first grouped product of a chain is column-,
                # the one fed by it row-parallel (one reduction after the k experts are summed)
                row = fed_by_grouped_mm(n)
                self.tp[n.name] = "k" if row else "n"
                self.row_gemms += row
                if row:
                    self.row_nodes.append(n)
                continue
            if weight_of(n) is None:
                self.tp[n.name] = "batch"
                self.batched.append(n)
                continue
            act = _activation_of(n)
            col = act in pure
            row = _reaches(n, stream, gemms)
            self.tp[n.name] = "n" if col and not row else "k" if row and not col else None
            if self.tp[n.name] == "n":
                self.col_widths.append((n, int(node_val(n).shape[-1])))
            elif self.tp[n.name] == "k":
                self.row_gemms += 1
                self.row_nodes.append(n)
        if not self.sdpa and (attn := self._attention()) is not None:
            self._attn_gemms.update(self._feeding_gemm(a) for a in attn)
        self.attn_inputs = {a for s in self.sdpa for a in s.args[:3]}

    def split_of(self, n: torch.fx.Node, kind: str) -> Any:
        if kind == "block":
            return self.tp.get(n.name)
        if weight_of(n) is None:
            return "batch"
        vocab = (int(node_val(self.vocab_embedding.args[0]).shape[0]) if self.vocab_embedding
                 is not None else -1)
        return "n" if kind == "head" and int(node_val(n).shape[-1]) == vocab else None

    def input_bytes(self, kind: str) -> int:
        if kind == "embedding":
            ph = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
            v = node_val(ph[0])
            return numel(v.shape) * v.element_size() // self.batch
        # several kinds: two (B, T, H) streams cross every cut (the encoder's stream and the
        # decoder's embedded input, then the decoder's stream and the encoder's output)
        return (self.structure_seq() * self.hidden * TRAIN_BYTES_PER_ELEM
                * len(self.structure.kinds))

    def tokens_of(self, kind: Any) -> int:
        """Tokens per sequence a kind's blocks see: dim 1 of its first block's first
        (B, T, H) floating input (the residual stream)."""
        for x in self.structure.block_inputs[kind.first]:
            v = node_val(self.nodes[x])
            if isinstance(v, torch.Tensor) and v.dim() == 3 and v.dtype.is_floating_point:
                return int(v.shape[1])
        return self.structure_seq()

    def structure_seq(self) -> int:
        x = next(self.nodes[x] for x in self.structure.unit_inputs
                 if isinstance(node_val(self.nodes[x]), torch.Tensor)
                 and node_val(self.nodes[x]).dim() == 3)
        return int(node_val(x).shape[1])


def is_gemm(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and (n.target in WEIGHT_GEMMS or is_grouped_mm(n))


def param_root(n: Any) -> Any:
    """Follow view-like single-input ops back to their source."""
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in VIEW_OPS:
        n = n.args[0]
    return n


def weight_of(n: torch.fx.Node) -> torch.fx.Node | None:
    """The parameter operand (get_attr, through views) of a GEMM node, or None."""
    for a in gemm_operands(n):
        r = param_root(a)
        if isinstance(r, torch.fx.Node) and r.op == "get_attr":
            return r
    return None


def gemm_operands(n: torch.fx.Node) -> tuple:
    if n.target in (aten.addmm.default, aten.baddbmm.default):
        return n.args[1], n.args[2]
    return n.args[0], n.args[1]


def bias_of(n: torch.fx.Node) -> torch.fx.Node | None:
    if n.target is aten.addmm.default:
        b = param_root(n.args[0])
    elif n.target is aten.linear.default and len(n.args) > 2:
        b = param_root(n.args[2])
    else:
        return None
    return b if isinstance(b, torch.fx.Node) and b.op == "get_attr" else None


def _activation_of(n: torch.fx.Node) -> Any:
    w = weight_of(n)
    for a in gemm_operands(n):
        if param_root(a) is not w:
            return param_root(a)
    return None


def _reaches(n: torch.fx.Node, stream: set, gemms: set) -> bool:
    """Does n's output reach a residual-stream node without passing through another GEMM?"""
    return reaches(n, lambda u: u in stream, lambda u: u not in gemms)


def unrepeated(n: Any) -> Any:
    """k or v as a GQA-native fused kernel reads it: the tensor a repeat_kv-style chain
    (unsqueeze → expand → reshape) repeats, or n itself when no expand repeats it."""
    x = n
    while isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target in _REPEAT_OPS:
        if x.target is aten.repeat_interleave.self_int:
            return x.args[0]
        if x.target is aten.expand.default:
            src = x.args[0]
            while (isinstance(src, torch.fx.Node) and src.op == "call_function"
                   and src.target in (aten.unsqueeze.default, aten.slice.Tensor)):
                src = src.args[0]
            return src
        x = x.args[0]
    return n
