"""Build the cost model's `ModelProfile` from a captured graph (the real path; shapes, not names).

Requires: a `Captured` and the `LayerStructure` of `find_layers` (nodes tagged with
  meta[K.REGION]). Reads meta[K.VAL], meta[K.NN_MODULE_STACK], meta[K.REGION].
  Writes meta[K.GEMM] (the `Gemm` of each matmul node) and meta[K.GEMM_SPLIT]
  ("n" | "k" | "batch" | None) on the nodes it classifies, and for autopar.passes.tp_cost (which
  prices the tensor-parallel pass's replicated fallbacks against this profile):
  meta[K.GEMM_IDX] (indices of the node's GEMMs in its region's `gemms`),
  meta[K.OTHER] ((bytes per sequence, counted as split)) on nodes of other_bytes,
  meta[K.SAVED] ([(producer node name | None, bytes per sequence, "split" | "repl" |
  "attn")]) on nodes that save tensors for backward, and gm.meta[K.PARAMS]
  ({region: {parameter identity: (elements, split)}}).
Guarantees: one `RegionProfile` per region (embedding, block 0 standing for every block, head +
  loss), per sequence (the example batch is divided out); with several kinds of block (an
  encoder-decoder) the block region is the repeat unit, the first graph block of each kind,
  `ModelProfile.num_layers` counts units (the stacks must be equally deep) and
  `ModelProfile.layer_kinds` gives each kind's layers and forward FLOPs (read back through
  meta[K.GEMM_IDX]); with:
  - GEMMs from aten mm / addmm / bmm / baddbmm / matmul / linear and scaled_dot_product_attention
    (expanded into its two batched GEMMs, scores and context, batch = heads);
  - tp_split from graph structure (Megatron's rule): the residual stream of a block is the set of
    nodes on a GEMM-free path from the block input to the block output; a weight GEMM whose
    input is a GEMM-free function of the block inputs (a norm of the stream) is column-parallel
    "n"; one whose output reaches the stream without another GEMM is row-parallel "k";
    activation·activation products (attention) are "batch"; the LM head (a weight GEMM whose
    output width is the vocabulary) is "n"; anything else is replicated (None);
  - parameters counted once (tied weights deduplicated by identity in the user's model), split or
    replicated following the GEMM they feed; the vocabulary embedding is split;
  - non-GEMM bytes as a GPU stack moves them (`_other_bytes`): elementwise chains fused into
    one kernel each (`_Fusion`), views / casts / p=0 dropout free, lookups reading rows, the
    loss in fp32;
  - activations measured, not guessed: the graph runs on the meta device under
    saved_tensors_hooks, each saved tensor is charged to the region of the node that saved it
    (deduplicated by storage), at 2 bytes per floating element, 1 for bool/uint8, 4 for the
    loss's log-probabilities; a fused elementwise kernel's intermediates are not kept.
    Twice: with sdpa on its math path, which saves the s×s softmax (materialized attention,
    the accounting of 2104.04473 / 2205.05198: the region fields), and with sdpa as the fused
    kernel of a GPU (FlashAttention-2/3, cuDNN): it saves q, k and v as it reads them (grouped
    query attention un-repeated), its output (laid out (B, L, H, E), so the projection after
    it saves the same storage) and an fp32 logsumexp per query row, and nothing s×s
    (`RegionProfile.fused`, with one `AttentionCall` per sdpa: its shapes and the fraction of
    score tiles its mask leaves — is_causal, or a mask that does not depend on the inputs,
    read on the CPU; a mask that does, or one of more than MASK_READ_LIMIT entries, counts as
    dense and is named in the profile's notes). The fused run also leaves out pointwise
    outputs a fused kernel's backward recomputes from values kept anyway (a norm's output,
    SwiGLU's product), as torch.compile's min-cut partitioner does on today's stacks.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from autopar.cost.profile import (FLASH_TILE, AttentionCall, EagerOps, FusedAttention, Gemm,
                                  LayerKind, ModelProfile, RegionProfile, causal_tile_fraction)
from autopar.passes import meta as K
from autopar.passes.capture import Captured
from autopar.passes.layers import LayerStructure
from autopar.passes.loss_precision import LOSS_OPS
from autopar.passes.sharding import ancestors, fed_by_grouped_mm, is_grouped_mm

aten = torch.ops.aten
_WEIGHT_GEMMS = {aten.mm.default, aten.addmm.default, aten.linear.default, aten.matmul.default,
                 aten.bmm.default, aten.baddbmm.default}
_SDPA = {aten.scaled_dot_product_attention.default}
# Ops that only re-describe memory (no bytes moved) and are skipped by other_bytes.
VIEW_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                      aten.transpose.int, aten.t.default, aten.permute.default, aten.expand.default,
                      aten.numpy_T.default, aten.mT.default,   # `w.T` / `w.mT` (Falcon's x @ w.T)
                      aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
                      aten.squeeze.default, aten.alias.default, aten.split.Tensor,
                      aten.split_with_sizes.default, aten.detach.default, aten.flatten.using_ints,
                      aten.chunk.default, aten.unflatten.int, aten._assert_tensor_metadata.default,
                      aten.to.dtype, aten.to.dtype_layout, aten.unbind.int})
TRAIN_BYTES_PER_ELEM = 2  # 16-bit training precision for floating activations
# Largest attention mask (entries) read on the CPU to find the tiles a fused kernel skips:
# 16K × 16K booleans, a few hundred MB while it is evaluated.
MASK_READ_LIMIT = 1 << 28
# Ops that repeat key/value heads for grouped-query attention (transformers' repeat_kv:
# unsqueeze → expand → reshape); a GQA-native fused kernel reads the tensor before them.
_REPEAT_OPS = frozenset({aten.expand.default, aten.unsqueeze.default, aten.slice.Tensor,
                         aten.reshape.default, aten.view.default, aten._unsafe_view.default,
                         aten.clone.default, aten.repeat_interleave.self_int})


@dataclass
class _Region:
    """Mutable accumulator of one region's profile."""
    gemms: list[Gemm] = field(default_factory=list)
    params: dict[int, tuple[int, bool]] = field(default_factory=dict)  # id -> (elems, split)
    act_split: float = 0.0
    act_repl: float = 0.0
    act_attn: float = 0.0
    other: float = 0.0
    other_split: float = 0.0
    allreduce: int = 0
    calls: list[AttentionCall] = field(default_factory=list)
    # (split, replicated, attention) activation bytes of the other accountings
    fused_act: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    eager_act: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    eager_fused_act: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    eager_other: float = 0.0
    eager_other_split: float = 0.0
    # a mixture of experts: the experts' 3-D weights (ids), the experts per layer, and the
    # elements one token dispatch moves per sequence (rows · hidden of each expert chain's input)
    expert_params: set = field(default_factory=set)
    experts: int = 0
    dispatch: int = 0


def sequence_length(captured: Captured, structure: LayerStructure) -> int:
    """Tokens per sequence: dim 1 of the first example input when it holds token ids (B, T);
    for pixels or features (a floating-point input) the tokens the repeated blocks see,
    dim 1 of the first (B, S, H) value of block 0 (ViT: patches + class token)."""
    first = next(a for a in captured.example_inputs if torch.is_tensor(a))
    if not first.is_floating_point():
        return int(first.shape[1]) if first.dim() > 1 else int(first.shape[0])
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    for name in structure.unit_nodes:
        v = _val(nodes[name])
        if isinstance(v, torch.Tensor) and v.dim() == 3 and int(v.shape[0]) == \
                captured.batch_size:
            return int(v.shape[1])
    return int(first.shape[1]) if first.dim() > 1 else 1


def profile_from_graph(captured: Captured, structure: LayerStructure, *,
                       seq_len: int | None = None, name: str = "model") -> ModelProfile:
    """ModelProfile of the captured model: regions per sequence of `seq_len` tokens.

    seq_len defaults to `sequence_length(captured, structure)`.
    """
    gm = captured.gm
    batch = captured.batch_size
    if seq_len is None:
        seq_len = sequence_length(captured, structure)
    nodes = {n.name: n for n in gm.graph.nodes}
    params = param_identity(captured)
    g = _GraphFacts(gm, structure, nodes, params, batch)
    regions = {"embedding": _Region(), "block": _Region(), "head": _Region()}
    for kind, names in (("embedding", structure.embedding_nodes),
                        ("block", structure.unit_nodes), ("head", structure.head_nodes)):
        _gemms_and_params(g, kind, [nodes[x] for x in names], regions[kind])
        _other_bytes(g, [nodes[x] for x in names], regions[kind])
    for run in _RUNS if any(r.calls for r in regions.values()) else ("materialized",):
        _measure_activations(captured, g, regions, run)
    dims = g.dims()
    s, h = seq_len, dims["hidden"]
    # each row-parallel GEMM's output is all-reduced: s·h per GEMM; with several kinds (an
    # encoder-decoder) at its own kind's tokens (sources and targets may differ in length)
    regions["block"].allreduce = g.row_gemms * s * h if len(structure.kinds) == 1 else sum(
        h * g.tokens_of(k) * sum(n.name in set(structure.block_nodes[k.first])
                                 for n in g.row_nodes) for k in structure.kinds)
    regions["embedding"].allreduce = s * h if g.vocab_embedding is not None else 0
    out = {k: _finish(k, r, g.input_bytes(k)) for k, r in regions.items()}
    gm.meta[K.PARAMS] = {k: dict(r.params) for k, r in regions.items()}
    units = structure.num_units
    kinds = _layer_kinds(structure, nodes, out["block"]) if len(structure.kinds) > 1 else ()
    unit = " + ".join(f"{k.block_class.rpartition('.')[2]} ({k.container.removeprefix('model.')})"
                      for k in structure.kinds)
    notes = [f"graph profile: {units} × {f'[{unit}]' if kinds else structure.block_class}"
             + (f" ({structure.num_blocks} blocks captured)"
                if structure.num_blocks != structure.num_layers else "")] + g.mask_notes
    if kinds:
        notes.append(f"{len(kinds)} stacks ({', '.join(k.name for k in kinds)}) priced as "
                     f"{units} units of one layer of each: a stage of one stack's layers is "
                     f"priced at the unit's mean; stages are cut where the forward FLOPs of "
                     f"the layers match the solver's split")
    return ModelProfile(name=name, num_layers=units, seq_len=s, hidden=h,
                        heads=dims["heads"], kv_heads=dims["kv_heads"], vocab=dims["vocab"],
                        ffn=dims["ffn"], embedding=out["embedding"], block=out["block"],
                        head=out["head"], tied_embeddings=g.tied,
                        activation_bytes_per_elem=TRAIN_BYTES_PER_ELEM, notes=tuple(notes),
                        layer_kinds=kinds)


def _layer_kinds(structure: LayerStructure, nodes: dict, block: RegionProfile
                 ) -> tuple[LayerKind, ...]:
    """Each kind's layers and the forward GEMM FLOPs of one of its layers (its unit block's
    GEMMs, by the GEMM_IDX the profile wrote), in execution order."""
    out = []
    for kind in structure.kinds:
        idx = {i for x in structure.block_nodes[kind.first]
               for i in nodes[x].meta.get(K.GEMM_IDX, ())}
        out.append(LayerKind(name=kind.container.removeprefix("model."),
                             num_layers=kind.num_layers,
                             fwd_flops=sum(block.gemms[i].fwd_flops for i in idx)))
    return tuple(out)


def _finish(kind: str, r: _Region, input_bytes: int) -> RegionProfile:
    split = sum(e for e, sp in r.params.values() if sp)
    repl = sum(e for e, sp in r.params.values() if not sp)

    def fused(act: list[float]) -> FusedAttention | None:
        if not r.calls:
            return None
        return FusedAttention(calls=tuple(r.calls), act_split_bytes=round(act[0]),
                              act_replicated_bytes=round(act[1]),
                              act_attention_bytes=round(act[2]))

    eager = EagerOps(other_bytes=round(r.eager_other), other_split_bytes=round(r.eager_other_split),
                     act_split_bytes=round(r.eager_act[0]),
                     act_replicated_bytes=round(r.eager_act[1]),
                     act_attention_bytes=round(r.eager_act[2]), fused=fused(r.eager_fused_act))
    return RegionProfile(
        kind=kind, name=kind, gemms=tuple(r.gemms), params_split_elems=split,
        params_replicated_elems=repl, act_split_bytes=round(r.act_split),
        act_replicated_bytes=round(r.act_repl), act_attention_bytes=round(r.act_attn),
        input_bytes=input_bytes, other_bytes=round(r.other), other_split_bytes=round(r.other_split),
        tp_allreduce_elems=r.allreduce, fused=fused(r.fused_act), eager=eager,
        expert_params_elems=sum(r.params[pid][0] for pid in r.expert_params if pid in r.params),
        experts=r.experts, expert_dispatch_elems=r.dispatch)


def param_identity(captured: Captured) -> dict[str, tuple[int, int]]:
    """Graph get_attr target -> (identity, elems) for every parameter; tied names share one id."""
    out = {}
    for pname, p in captured.model.named_parameters(remove_duplicate=False):
        out[captured.prefix + pname] = (id(p), p.numel())
    return out


# ----- graph facts: GEMMs, residual stream, classification ----------------------------------------

def _val(n: Any) -> Any:
    return n.meta.get(K.VAL) if isinstance(n, torch.fx.Node) else None


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


class _GraphFacts:
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
        self.fusion = _Fusion(gm)
        self.mask_notes: list[str] = []
        self._classify_block()

    # -- dims ---------------------------------------------------------------------------------
    def _vocab_embedding(self) -> torch.fx.Node | None:
        """The embedding lookup indexed by an input (the token ids); the largest table wins."""
        embs = [self.nodes[x] for x in self.structure.embedding_nodes
                if self.nodes[x].target is aten.embedding.default]
        by_input = [e for e in embs if getattr(_root(e.args[1]), "op", "") == "placeholder"]
        return max(by_input or embs, key=lambda e: _val(e.args[0]).shape[0], default=None)

    def _hidden(self) -> int:
        for x in self.structure.unit_inputs:
            v = _val(self.nodes[x])
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
        q, k = _operands(self.batched[0])
        return q, k, _operands(self.batched[1])[1]

    def dims(self) -> dict[str, int]:
        heads, hd = 1, self.hidden
        if self.sdpa:
            q = _val(self.sdpa[0].args[0])
            heads, hd = int(q.shape[-3]), int(q.shape[-1])
        elif (attn := self._attention()) is not None:  # (B·H, L, E) or (B, H, L, E)
            heads = _numel(_val(self.batched[0]).shape[:-2]) // self.batch   # H per sequence
            hd = int(_val(attn[0]).shape[-1])
        kv = self._kv_heads(hd, heads)
        mlp = [w for nd, w in self.col_widths if nd not in self._attn_gemms]
        vocab = (int(_val(self.vocab_embedding.args[0]).shape[0]) if self.vocab_embedding
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
        k = _val(self._attention()[1])
        return int(k.shape[-3]) if k is not None and k.dim() == 4 else heads

    def _kv_heads_from_widths(self, hd: int, heads: int) -> int:
        attn = self._attention()
        if attn is None:
            return heads
        q_g, k_g = self._feeding_gemm(attn[0]), self._feeding_gemm(attn[1])
        if k_g is None:
            return heads
        width = int(_val(k_g).shape[-1])
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
                if x.target in _WEIGHT_GEMMS and _weight_of(x) is not None:
                    return x
                nxt.extend(x.all_input_nodes)
            frontier = nxt
        return None

    # -- block classification -------------------------------------------------------------------
    def _classify_block(self) -> None:
        block = [self.nodes[x] for x in self.structure.unit_nodes]
        gemms = {n for n in block if _is_gemm(n)}
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
            if n.target in _SDPA:
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
            if _weight_of(n) is None:
                self.tp[n.name] = "batch"
                self.batched.append(n)
                continue
            act = _activation_of(n)
            col = act in pure
            row = _reaches(n, stream, gemms)
            self.tp[n.name] = "n" if col and not row else "k" if row and not col else None
            if self.tp[n.name] == "n":
                self.col_widths.append((n, int(_val(n).shape[-1])))
            elif self.tp[n.name] == "k":
                self.row_gemms += 1
                self.row_nodes.append(n)
        if not self.sdpa and (attn := self._attention()) is not None:
            self._attn_gemms.update(self._feeding_gemm(a) for a in attn)
        self.attn_inputs = {a for s in self.sdpa for a in s.args[:3]}

    def split_of(self, n: torch.fx.Node, kind: str) -> Any:
        if kind == "block":
            return self.tp.get(n.name)
        if _weight_of(n) is None:
            return "batch"
        vocab = (int(_val(self.vocab_embedding.args[0]).shape[0]) if self.vocab_embedding
                 is not None else -1)
        return "n" if kind == "head" and int(_val(n).shape[-1]) == vocab else None

    def input_bytes(self, kind: str) -> int:
        if kind == "embedding":
            ph = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
            v = _val(ph[0])
            return _numel(v.shape) * v.element_size() // self.batch
        # several kinds: two (B, T, H) streams cross every cut (the encoder's stream and the
        # decoder's embedded input, then the decoder's stream and the encoder's output)
        return (self.structure_seq() * self.hidden * TRAIN_BYTES_PER_ELEM
                * len(self.structure.kinds))

    def tokens_of(self, kind: Any) -> int:
        """Tokens per sequence a kind's blocks see: dim 1 of its first block's first
        (B, T, H) floating input (the residual stream)."""
        for x in self.structure.block_inputs[kind.first]:
            v = _val(self.nodes[x])
            if isinstance(v, torch.Tensor) and v.dim() == 3 and v.dtype.is_floating_point:
                return int(v.shape[1])
        return self.structure_seq()

    def structure_seq(self) -> int:
        x = next(self.nodes[x] for x in self.structure.unit_inputs
                 if isinstance(_val(self.nodes[x]), torch.Tensor)
                 and _val(self.nodes[x]).dim() == 3)
        return int(_val(x).shape[1])


def _is_gemm(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and (n.target in _WEIGHT_GEMMS or is_grouped_mm(n))


def _root(n: Any) -> Any:
    """Follow view-like single-input ops back to their source."""
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in VIEW_OPS:
        n = n.args[0]
    return n


def _weight_of(n: torch.fx.Node) -> torch.fx.Node | None:
    """The parameter operand (get_attr, through views) of a GEMM node, or None."""
    for a in _operands(n):
        r = _root(a)
        if isinstance(r, torch.fx.Node) and r.op == "get_attr":
            return r
    return None


def _operands(n: torch.fx.Node) -> tuple:
    if n.target in (aten.addmm.default, aten.baddbmm.default):
        return n.args[1], n.args[2]
    return n.args[0], n.args[1]


def _bias_of(n: torch.fx.Node) -> torch.fx.Node | None:
    if n.target is aten.addmm.default:
        b = _root(n.args[0])
    elif n.target is aten.linear.default and len(n.args) > 2:
        b = _root(n.args[2])
    else:
        return None
    return b if isinstance(b, torch.fx.Node) and b.op == "get_attr" else None


def _activation_of(n: torch.fx.Node) -> Any:
    w = _weight_of(n)
    for a in _operands(n):
        if _root(a) is not w:
            return _root(a)
    return None


def _reaches(n: torch.fx.Node, stream: set, gemms: set) -> bool:
    """Does n's output reach a residual-stream node without passing through another GEMM?"""
    frontier, seen = list(n.users), set()
    while frontier:
        u = frontier.pop()
        if u in seen:
            continue
        seen.add(u)
        if u in stream:
            return True
        if u not in gemms:
            frontier.extend(u.users)
    return False


# ----- GEMMs and parameters ------------------------------------------------------------------------

def _gemms_and_params(g: _GraphFacts, kind: str, region: list, r: _Region) -> None:
    # a block's GEMMs are named within it ("attn.c_attn"); a unit of several kinds' within
    # the model ("encoder.block.0.layer.0.SelfAttention.q")
    one_kind = len(g.structure.kinds) == 1
    base = g.structure.block_paths[0] + "." if kind == "block" and one_kind else ""
    table = _root(g.vocab_embedding.args[0]) if g.vocab_embedding is not None else None
    table_id = g.params.get(getattr(table, "target", None), (None,))[0]
    shared = g.embedding_param_ids if kind == "head" else set()
    for n in region:
        if n.op == "get_attr" and n.target in g.params:
            pid, elems = g.params[n.target]
            if pid in shared:
                g.tied = True  # the head reuses the embedding table: counted there only
                continue
            # default: replicated (norms, position tables); the vocabulary table is split
            r.params.setdefault(pid, (elems, pid == table_id))
        if n.op != "call_function":
            continue
        if n.target in _SDPA:
            n.meta[K.GEMM_IDX] = (len(r.gemms), len(r.gemms) + 1)
            r.gemms.extend(_sdpa_gemms(n, g.batch, _label(n, base)))
            n.meta[K.GEMM_SPLIT] = "batch"
            r.calls.append(_attention_call(g, n, n.meta[K.GEMM_IDX]))
        elif n.target in _WEIGHT_GEMMS or is_grouped_mm(n):
            split = g.split_of(n, kind)
            gemm = _gemm(n, g.batch, _label(n, base), split)
            n.meta[K.GEMM_IDX] = (len(r.gemms),)
            r.gemms.append(gemm)
            n.meta[K.GEMM], n.meta[K.GEMM_SPLIT] = gemm, split
            _charge_params(g, n, split, r, shared)
            if is_grouped_mm(n):
                _charge_experts(g, n, gemm, r)


def _charge_experts(g: _GraphFacts, n: torch.fx.Node, gemm: Gemm, r: _Region) -> None:
    """An experts' grouped matmul: its weight (E, K, N) holds E experts, which expert
    parallelism spreads over the ranks; the first of a chain (not fed by another grouped
    matmul) reads the tokens sorted by expert, gemm.m = tokens · k rows of gemm.k elements per
    sequence: what one all-to-all moves to the experts' ranks (and the combine moves back)."""
    w = _weight_of(n)
    if w is not None and w.target in g.params:
        r.expert_params.add(g.params[w.target][0])
        r.experts = max(r.experts, int(_val(w).shape[0]))
    if not fed_by_grouped_mm(n):
        r.dispatch += gemm.m * gemm.k


def _charge_params(g: _GraphFacts, n: torch.fx.Node, split: Any, r: _Region,
                   shared: set) -> None:
    """Weights of column/row GEMMs are split; biases of column GEMMs too, of row GEMMs not."""
    for p, is_split in ((_weight_of(n), split in ("n", "k")), (_bias_of(n), split == "n")):
        if p is None or p.target not in g.params:
            continue
        pid, elems = g.params[p.target]
        if pid in shared:
            g.tied = True  # e.g. the LM head multiplies by the embedding table
            continue
        r.params[pid] = (elems, is_split)


def _label(n: torch.fx.Node, base: str) -> str:
    """The GEMM's module path relative to its block (or the model), e.g. "attn.c_attn"."""
    stack = n.meta.get(K.NN_MODULE_STACK) or {}
    path = list(stack.values())[-1][0] if stack else ""
    for prefix in (base, "model."):
        if prefix and path.startswith(prefix):
            path = path[len(prefix):]
            break
    return path or str(n.target).split(".")[1]


def _gemm(n: torch.fx.Node, batch: int, name: str, split: Any) -> Gemm:
    a, b = (_val(x) for x in _operands(n))
    out = _val(n)
    has_w = _weight_of(n) is not None
    if n.target is aten.linear.default:
        M, K, N = _numel(a.shape[:-1]), int(a.shape[-1]), int(b.shape[0])
        return Gemm(name=name, batch=1, m=M // batch, n=N, k=K, tp_split=split)
    if is_grouped_mm(n):
        # (M, K) rows sorted by expert · (E, K, N): M = tokens · top-k, so the FLOPs are those
        # of the k experts each token is routed to, not of all E; the weights (all E experts)
        # are charged as parameters
        M, K, N = _numel(a.shape[:-1]), int(a.shape[-1]), int(b.shape[-1])
        return Gemm(name=name, batch=1, m=M // batch, n=N, k=K, tp_split=split, expert=True)
    if b.dim() == 2:  # (…, M, K) · (K, N): a linear layer written as mm / matmul
        M, K, N = _numel(a.shape[:-1]), int(a.shape[-1]), int(b.shape[-1])
        return Gemm(name=name, batch=1, m=M // batch, n=N, k=K, tp_split=split,
                    has_weight_grad=has_w)
    # batched: (…, M, K) · (…, K, N); the leading dims hold the batch (and heads)
    lead = _numel(out.shape[:-2])
    M, K, N = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
    per_seq = lead // batch if lead % batch == 0 else lead
    return Gemm(name=name, batch=per_seq, m=M, n=N, k=K, tp_split=split,
                batch_scales=not has_w, has_weight_grad=has_w)


def _sdpa_gemms(n: torch.fx.Node, batch: int, name: str) -> list[Gemm]:
    q, k, v = (_val(x) for x in n.args[:3])  # (B, H, L, E), (B, Hk, S, E), (B, Hk, S, Ev)
    heads = _numel(q.shape[:-2]) // batch
    L, E, S, Ev = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2]), int(v.shape[-1])
    common = dict(batch=heads, tp_split="batch", batch_scales=True, has_weight_grad=False)
    return [Gemm(name=f"{name}.scores", m=L, n=S, k=E, **common),
            Gemm(name=f"{name}.context", m=L, n=Ev, k=S, **common)]


def _attention_call(g: _GraphFacts, n: torch.fx.Node, gemms: tuple[int, ...]) -> AttentionCall:
    """The fused-kernel view of one sdpa node (cost/profile.py AttentionCall), per sequence."""
    q, k, v = (_val(x) for x in n.args[:3])  # (B, H, L, E), (B, Hk, S, E), (B, Hk, S, Ev)
    heads = _numel(q.shape[:-2]) // g.batch
    L, E, S, Ev = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2]), int(v.shape[-1])
    kv = _numel(_val(unrepeated(n.args[1])).shape[:-2]) // g.batch
    call = _sdpa_kwargs(n)
    if call["is_causal"]:
        active = causal_tile_fraction(L, S)
    elif isinstance(call["attn_mask"], torch.fx.Node):
        active = _mask_active_fraction(g.gm, call["attn_mask"], L, S)
        if active is None:
            g.mask_notes.append(f"attention mask {call['attn_mask'].name} of {n.name} cannot be "
                                f"read at planning time (it depends on the inputs, or has more "
                                f"than {MASK_READ_LIMIT} entries): the fused kernel is priced "
                                f"dense")
            active = 1.0
    else:
        active = 1.0
    return AttentionCall(heads=heads, kv_heads=kv, q_len=L, kv_len=S, head_dim=E, v_head_dim=Ev,
                         active_fraction=active, gemms=tuple(gemms),
                         materialized_bytes=round(_score_bytes(n, g.batch)
                                                  + _relayout_bytes(n, g.batch)))


def _sdpa_kwargs(n: torch.fx.Node) -> dict[str, Any]:
    """attn_mask, dropout_p and is_causal of an sdpa node, positional or keyword."""
    names = ("attn_mask", "dropout_p", "is_causal")
    out = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False}
    out.update(zip(names, n.args[3:6]))
    out.update({k: v for k, v in n.kwargs.items() if k in out})
    return out


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


def _mask_active_fraction(gm: torch.fx.GraphModule, mask: torch.fx.Node, L: int,
                          S: int) -> float | None:
    """Fraction of the FLASH_TILE² tiles of an (…, L, S) attention mask that hold an attended
    entry, evaluated on the CPU; None when the mask depends on the inputs, on a parameter or
    buffer (meta, no values), or is larger than MASK_READ_LIMIT."""
    if L * S > MASK_READ_LIMIT:
        return None
    needed = ancestors(mask)
    if any(x.op == "placeholder" for x in needed):
        return None
    env: dict = {}
    cpu = torch.device("cpu")
    try:
        with torch.no_grad():
            for x in gm.graph.nodes:
                if x not in needed:
                    continue
                if x.op == "get_attr":
                    value = getattr(gm, x.target) if hasattr(gm, x.target) else None
                    if not torch.is_tensor(value) or value.is_meta:
                        return None
                    env[x] = value
                    continue
                if x.op != "call_function":
                    return None
                args = torch.fx.node.map_arg(x.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(x.kwargs, env.__getitem__)
                args = tuple(cpu if isinstance(a, torch.device) else a for a in args)
                if "device" in kwargs:
                    kwargs = {**kwargs, "device": cpu}
                target = aten.reshape.default if x.target is aten.view.default else x.target
                env[x] = target(*args, **kwargs)
    except Exception:  # an op that cannot run on the CPU here: price the mask dense
        return None
    m = env[mask]
    if not torch.is_tensor(m):
        return None
    # boolean: True attends; additive float: -inf (or transformers' dtype minimum) masks
    keep = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    keep = keep.expand(*keep.shape[:-2], L, S)
    if keep.dim() > 2:  # a tile runs if any head / sequence attends in it
        keep = keep.reshape(-1, L, S).any(dim=0) if keep[..., 0, 0].numel() > 1 \
            else keep.reshape(L, S)
    T = FLASH_TILE
    if L % T or S % T:
        pad = torch.zeros(-(-L // T) * T, -(-S // T) * T, dtype=torch.bool)
        pad[:L, :S] = keep
        keep = pad
    tiles = keep.contiguous().view(torch.uint8).reshape(
        keep.shape[0] // T, T, keep.shape[1] // T, T).amax(dim=(1, 3))
    return float(tiles.float().mean())


def _relayout_bytes(n: torch.fx.Node, batch: int) -> float:
    """Per sequence: the copy (read + write) that makes sdpa's (B, H, L, E) output contiguous
    as (B, L, H, E) (`.transpose(1, 2).contiguous()`); 0 when the graph has none."""
    todo, total = list(n.users), 0.0
    while todo:
        u = todo.pop()
        if u.op != "call_function":
            continue
        if u.target in (aten.contiguous.default, aten.clone.default):
            total += 2 * _numel(_val(u).shape) * TRAIN_BYTES_PER_ELEM / batch
        elif u.target in VIEW_OPS:
            todo.extend(u.users)
    return total


def _score_bytes(n: torch.fx.Node, batch: int) -> float:
    """Per sequence: the materialized softmax's scale/mask pass, softmax read and write over the
    scores, 3 · heads · L · S 16-bit elements (the unfused kernels of 2104.04473)."""
    q, k = _val(n.args[0]), _val(n.args[1])
    return 3 * _numel(q.shape[:-1]) * int(k.shape[-2]) * TRAIN_BYTES_PER_ELEM / batch


# ----- memory traffic of non-GEMM ops ----------------------------------------------------------------

def _other_bytes(g: _GraphFacts, region: list, r: _Region) -> None:
    """Bytes read + written by non-GEMM ops (elementwise, norms, softmax), 16-bit floats.

    A chain of elementwise ops runs as one fused kernel (`_Fusion`): it reads each outside
    input once and writes only the values used outside it. An index lookup (embedding) reads
    the rows it gathers, not its table. Views and dropout with p = 0 (which returns its input)
    move nothing; dropout with p > 0 also writes its 1-byte mask.
    sdpa's own non-GEMM traffic is the softmax over the s×s scores: scale/mask pass, softmax
    read and write = 3 · heads · L · S elements (as in the unfused kernels of 2104.04473).
    """
    fusion = g.fusion
    for n in region:
        if n.op != "call_function" or fusion.is_view(n) or _is_gemm(n):
            continue
        outs = [t for t in _flat(_val(n)) if isinstance(t, torch.Tensor)]
        if not outs:
            continue
        if n.target in _SDPA:
            b = _score_bytes(n, g.batch)
            r.other += b
            r.other_split += b
            r.eager_other += b
            r.eager_other_split += b
            n.meta[K.OTHER] = (b, True)
            continue
        every = list(n.all_input_nodes)
        if n in fusion.group:
            reads = [a for a in every if fusion.reads_from_outside(n, a)]
            writes = outs if fusion.escapes(n) else []
        else:
            reads, writes = every, outs
        b, tensors = _op_bytes(g, n, reads, writes, outs)
        eager_b, _ = _op_bytes(g, n, every, outs, outs)
        r.other += b
        r.eager_other += eager_b
        # split under tensor parallelism unless its largest operand runs along the hidden dim
        big = max(tensors + outs, key=lambda x: x.numel())
        split = bool(big.dim() and int(big.shape[-1]) != g.hidden)
        if split:
            r.other_split += b
            r.eager_other_split += eager_b
        n.meta[K.OTHER] = (b, split)


def _op_bytes(g: _GraphFacts, n: torch.fx.Node, reads: list, writes: list,
              outs: list) -> tuple[float, list]:
    """Bytes per sequence op n moves reading `reads` and writing `writes` (and the tensors it
    reads): parameters (norm weights, O(h)) are read once per micro-batch, not per sequence;
    an index lookup reads the rows it gathers, not its table; the loss writes fp32
    log-probabilities; dropout writes its 1-byte mask (native_dropout on GPUs)."""
    reads = [a for a in reads if g.fusion.source(a).op != "get_attr"]
    if n.target in _INDEX_OPS:
        reads = [a for a in reads if a is not n.args[0]]
    tensors = [_val(a) for a in reads if isinstance(_val(a), torch.Tensor)]
    if n.target in _INDEX_OPS:
        tensors.append(outs[0])
    b = sum(_train_bytes(t) for t in tensors + writes) / g.batch
    if n.target in _FP32_LOSS_OPS and tensors:
        b += tensors[0].numel() * LOSS_BYTES_PER_ELEM / g.batch
    if n.target in _DROPOUT:
        b += outs[0].numel() / g.batch
    return b, tensors


def _flat(v: Any) -> list:
    return list(v) if isinstance(v, (tuple, list)) else [v]


_INDEX_OPS = frozenset({aten.embedding.default, aten.index_select.default,
                        aten.gather.default})
# The loss runs in fp32 under mixed precision (passes/loss_precision.py: as torch.autocast,
# Megatron-LM and torchtitan, and autopar's runtime): it reads the 16-bit logits, writes and
# saves fp32 log-probs.
_FP32_LOSS_OPS = LOSS_OPS
LOSS_BYTES_PER_ELEM = 4
_DROPOUT = frozenset({aten.dropout.default, aten.native_dropout.default})
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


class _Fusion:
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
        if n.target in _DROPOUT or n.target is aten.cat.default:  # cat: indexing, pointwise
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


def _train_bytes(t: torch.Tensor) -> float:
    if t.dtype.is_floating_point:
        return t.numel() * TRAIN_BYTES_PER_ELEM
    return t.numel() * t.element_size()


# ----- activations ----------------------------------------------------------------------------------

# The meter's runs: sdpa on its math path (materialized), or as a fused kernel reading k and v
# un-repeated (a GPU stack's GQA-native kernel) or as the model passes them (eager PyTorch).
_RUNS = ("materialized", "flash", "flash-eager")


def _measure_activations(captured: Captured, g: _GraphFacts, regions: dict, run: str) -> None:
    """Run the graph on meta tensors; charge each saved-for-backward storage to its region.

    run "materialized": sdpa on its math path: the region's act_* fields (elementwise fused:
    no fused kernel's intermediates) and `eager_act` (every saved tensor), and node
    meta[K.SAVED] for passes/tp_cost.py (fused). "flash": sdpa as a fused kernel saves
    (`_FusedAttention`, k and v un-repeated), elementwise fused and the pointwise outputs a
    fused backward recomputes left out: `fused_act`. "flash-eager": the fused kernel as eager
    PyTorch calls it (k and v as passed), every saved tensor: `eager_fused_act`."""
    gm = g.gm
    seq = g.structure_seq()
    if run == "materialized":
        for n in gm.graph.nodes:
            n.meta.pop(K.SAVED, None)  # a second profile of the same graph starts afresh
    meter = _SavedTensorMeter(gm, g, seq, fused=run != "materialized",
                              gqa_native=run == "flash")
    args = [torch.empty_like(a, device="meta") if torch.is_tensor(a) else a
            for a in captured.example_inputs]
    if captured.has_loss:
        args.append(torch.empty_like(captured.targets, device="meta"))
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        meter.run(*args)
    kept_by = {"materialized": (("act", True, False), ("eager_act", False, False)),
               "flash": (("fused_act", True, True),),
               "flash-eager": (("eager_fused_act", False, False),)}[run]
    for field_name, fused_kernels, recomputed in kept_by:
        for (kind, idx), bytes3 in meter.totals(fused_kernels, recomputed).items():
            if kind == "block" and idx != 0:
                continue
            r = regions[kind]
            if field_name == "act":
                r.act_split += bytes3[0]
                r.act_repl += bytes3[1]
                r.act_attn += bytes3[2]
            else:
                setattr(r, field_name, [a + b for a, b in zip(getattr(r, field_name), bytes3)])


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel saves for backward (FlashAttention-2/3's forward: q, k, v,
    the output and the fp32 logsumexp), on meta tensors. The output is laid out (B, L, H, E) as
    the kernel writes it, so `out.transpose(1, 2).contiguous()` is the same storage."""

    @staticmethod
    def forward(ctx, q, k, v, lse):  # type: ignore[override]
        shape = q.shape[:-1] + (v.shape[-1],)
        if q.dim() >= 3:
            out = torch.empty(shape[:-3] + (shape[-2], shape[-3], shape[-1]), dtype=q.dtype,
                              device=q.device).transpose(-3, -2)
        else:
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]  (never run: meta measurement only)
        raise NotImplementedError


class _SavedTensorMeter(torch.fx.Interpreter):
    """Interpreter on meta tensors that records the storages autograd saves, per region.

    attention: saved tensors ending in (s, s), or a fused kernel's logsumexp (not counted in
    split / replicated). replicated: a saved tensor (≥2-D) whose last dim is the hidden size,
    unless a row-parallel GEMM saves it (its input is split by the GEMM). split: every other
    saved tensor. fused=True runs sdpa as `_FusedAttention` (reading k / v un-repeated when
    gqa_native) and records no node meta. Each record notes whether a fused elementwise
    kernel would keep the tensor (`totals` filters).
    """

    def __init__(self, gm: torch.fx.GraphModule, g: _GraphFacts, seq: int, fused: bool = False,
                 gqa_native: bool = True):
        # values stay in env: a fused kernel reads k / v from before their repeat
        super().__init__(gm, garbage_collect_values=False)
        self.g, self.seq, self.fused, self.gqa_native = g, seq, fused, gqa_native
        self.node: torch.fx.Node | None = None
        self.seen: set[int] = set()
        self.lse: set[int] = set()  # storages of fused kernels' logsumexp
        self.pending: list[tuple[torch.Tensor, int]] = []  # saved by the node running
        self.records: list[tuple] = []  # (region, producer, bytes, class, floating, internal)
        self.producer: dict[int, torch.fx.Node] = {}  # storage -> node that made it
        # Storage addresses identify tensors only while they live: keep every value alive
        # (meta tensors cost no memory) so that no address is reused during the run.
        self.keep: list[Any] = []
        self.per_batch = batch_dependent(gm)

    def fetch_attr(self, target: str) -> Any:
        t = super().fetch_attr(target)
        if isinstance(t, torch.fx.GraphModule):  # body of a higher-order op (e.g. no_grad)
            return _on_meta(t)
        if isinstance(t, torch.Tensor):
            m = torch.empty_like(t, device="meta").requires_grad_(
                isinstance(t, torch.nn.Parameter) and t.requires_grad)
            self.seen.add(m.untyped_storage()._cdata)  # parameters are not activations
            self.keep.append(m)
            return m
        return t

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        if n.op == "call_module":  # the export's input guards: nothing to save
            return None
        self.pending = []
        if self.fused and n.op == "call_function" and n.target in _SDPA:
            out = self._fused_attention(n)
        else:
            out = super().run_node(n)
        self.keep.append(out)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.producer.setdefault(t.untyped_storage()._cdata, n)
        for t, key in self.pending:  # saved while n ran: n's own outputs are known now
            self._charge(t, key)
        return out

    def _fused_attention(self, n: torch.fx.Node) -> torch.Tensor:
        q = self.env[n.args[0]]
        k, v = (self.env[unrepeated(x) if self.gqa_native else x] for x in n.args[1:3])
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device="meta")
        self.lse.add(lse.untyped_storage()._cdata)
        self.keep.append(lse)
        return _FusedAttention.apply(q, k, v, lse)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        target, args, kwargs = _meta_call(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key in self.seen or self.node is None:
            return t
        self.seen.add(key)
        self.pending.append((t, key))
        return t

    def _charge(self, t: torch.Tensor, key: int) -> None:
        """Charge a saved storage to the region of the node that saved it (self.node)."""
        if key in self.lse or not t.dtype.is_floating_point:
            width = t.element_size()
        elif self.node.op == "call_function" and self.node.target in _FP32_LOSS_OPS:
            width = LOSS_BYTES_PER_ELEM
        else:
            width = TRAIN_BYTES_PER_ELEM
        nbytes = t.untyped_storage().nbytes() / t.element_size() * width
        made_by = self.producer.get(key)
        # an intermediate of a fused kernel: recomputed in its backward, not kept (when fused)
        internal = (made_by is not None and t.dtype.is_floating_point
                    and self.g.fusion.internal(made_by))
        made_by_batch = made_by is None or made_by in self.per_batch
        if made_by_batch:
            nbytes /= self.g.batch  # per sequence; batch-independent tensors (positions) stay
        region = self.node.meta.get(K.REGION, ("embedding", None))
        if key in self.lse or (t.dim() >= 2 and int(t.shape[-1]) == self.seq
                               and int(t.shape[-2]) == self.seq):
            cls = 2  # attention
        elif (t.dim() >= 2 and int(t.shape[-1]) == self.g.hidden
              and self.node.meta.get(K.GEMM_SPLIT) != "k"
              and self.g.tp.get(self.node.name) != "k"):
            cls = 1  # replicated
        else:
            cls = 0  # split
        self.records.append((region, made_by, nbytes, cls, t.dtype.is_floating_point, internal))
        if not self.fused and not internal:
            self.node.meta.setdefault(K.SAVED, []).append(
                (made_by.name if made_by is not None else None, nbytes, _CLASSES[cls]))

    def totals(self, fused_kernels: bool, recomputed: bool) -> dict[tuple, list[float]]:
        """(split, replicated, attention) bytes per region. fused_kernels: a fused elementwise
        kernel's intermediates are not kept. recomputed (today's stacks): a fused kernel's
        outputs are not kept either when every value its backward would recompute them from
        is kept anyway (or is a parameter / constant): torch.compile's min-cut partitioner
        recomputes such pointwise chains (a norm's output from its input and statistic,
        SwiGLU's product from gate and up). Neither: every saved tensor (eager PyTorch)."""
        records = [r for r in self.records if not (fused_kernels and r[5])]
        kept = {m for _, m, _, _, _, _ in records if m is not None}
        out: dict[tuple, list[float]] = {}
        for region, made_by, nbytes, cls, floating, _ in records:
            if (recomputed and floating and made_by is not None
                    and self.g.fusion.recomputable(made_by, kept, self.per_batch)):
                continue
            out.setdefault(region, [0.0, 0.0, 0.0])[cls] += nbytes
        return out


_CLASSES = ("split", "repl", "attn")


def batch_dependent(gm: torch.fx.GraphModule) -> set:
    """Nodes whose value depends on the inputs (and so scales with the batch)."""
    dep: set = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _meta_call(target: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """Make a traced call run on meta tensors.

    The graph was traced with CPU kernels whose output strides may differ from the meta (math)
    kernels, so a traced `view` can be illegal here: reshape copies when needed. Traced device
    arguments (tensor factories, .to(device)) are redirected to meta. Dropout saves a 1-byte
    mask as on GPUs (`_fused_dropout`).
    """
    if target is aten.view.default:
        target = aten.reshape.default
    if target is aten.dropout.default:
        target = _fused_dropout
    meta = torch.device("meta")
    args = tuple(meta if isinstance(a, torch.device) else a for a in args)
    if isinstance(kwargs.get("device"), (torch.device, str)):
        kwargs = {**kwargs, "device": meta}
    return target, args, kwargs


def _fused_dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """Dropout as GPU kernels do it (native_dropout: a 1-byte mask is saved for backward);
    ATen's CPU/meta fallback multiplies by a mask of the input's dtype instead."""
    if not train or p == 0:
        return x
    return aten.native_dropout.default(x, p, train)[0]


def _on_meta(sub: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a higher-order op's body graph with `_meta_call` applied to every call."""
    graph = torch.fx.Graph()
    env: dict = {}
    out = graph.graph_copy(sub.graph, env)
    graph.output(out)
    for n in graph.nodes:
        if n.op == "call_function":
            n.target, n.args, n.kwargs = _meta_call(n.target, n.args, dict(n.kwargs))
    return torch.fx.GraphModule(sub, graph)
