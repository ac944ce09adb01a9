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
  loss), per sequence (the example batch is divided out), with:
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
  - activations measured, not guessed: the graph runs on the meta device under
    saved_tensors_hooks, each saved tensor is charged to the region of the node that saved it
    (deduplicated by storage), at 2 bytes per floating element, 1 for bool/uint8.
    On meta, sdpa runs its math path, which saves the s×s softmax (as without flash attention,
    the accounting of 2104.04473 / 2205.05198).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from autopar.cost.profile import Gemm, ModelProfile, RegionProfile
from autopar.passes import meta as K
from autopar.passes.capture import Captured
from autopar.passes.layers import LayerStructure

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


def profile_from_graph(captured: Captured, structure: LayerStructure, *,
                       seq_len: int | None = None, name: str = "model") -> ModelProfile:
    """ModelProfile of the captured model: regions per sequence of `seq_len` tokens.

    seq_len defaults to dim 1 of the first example input (token ids (B, T)).
    """
    gm = captured.gm
    batch = captured.batch_size
    if seq_len is None:
        first = next(a for a in captured.example_inputs if torch.is_tensor(a))
        seq_len = int(first.shape[1]) if first.dim() > 1 else int(first.shape[0])
    nodes = {n.name: n for n in gm.graph.nodes}
    params = param_identity(captured)
    g = _GraphFacts(gm, structure, nodes, params, batch)
    regions = {"embedding": _Region(), "block": _Region(), "head": _Region()}
    for kind, names in (("embedding", structure.embedding_nodes),
                        ("block", structure.block_nodes[0]), ("head", structure.head_nodes)):
        _gemms_and_params(g, kind, [nodes[x] for x in names], regions[kind])
        _other_bytes(g, [nodes[x] for x in names], regions[kind])
    _measure_activations(captured, g, regions)
    dims = g.dims()
    s, h = seq_len, dims["hidden"]
    regions["block"].allreduce = g.row_gemms * s * h
    regions["embedding"].allreduce = s * h if g.vocab_embedding is not None else 0
    out = {k: _finish(k, r, g.input_bytes(k)) for k, r in regions.items()}
    gm.meta[K.PARAMS] = {k: dict(r.params) for k, r in regions.items()}
    notes = [f"graph profile: {structure.num_layers} × {structure.block_class}"
             + (f" ({structure.num_blocks} captured)" if structure.num_blocks != structure.num_layers
                else "")]
    return ModelProfile(name=name, num_layers=structure.num_layers, seq_len=s, hidden=h,
                        heads=dims["heads"], kv_heads=dims["kv_heads"], vocab=dims["vocab"],
                        ffn=dims["ffn"], embedding=out["embedding"], block=out["block"],
                        head=out["head"], tied_embeddings=g.tied,
                        activation_bytes_per_elem=TRAIN_BYTES_PER_ELEM, notes=tuple(notes))


def _finish(kind: str, r: _Region, input_bytes: int) -> RegionProfile:
    split = sum(e for e, sp in r.params.values() if sp)
    repl = sum(e for e, sp in r.params.values() if not sp)
    return RegionProfile(
        kind=kind, name=kind, gemms=tuple(r.gemms), params_split_elems=split,
        params_replicated_elems=repl, act_split_bytes=round(r.act_split),
        act_replicated_bytes=round(r.act_repl), act_attention_bytes=round(r.act_attn),
        input_bytes=input_bytes, other_bytes=round(r.other), other_split_bytes=round(r.other_split),
        tp_allreduce_elems=r.allreduce)


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
        self.block0 = set(structure.block_nodes[0])
        self.tp: dict[str, Any] = {}
        self.row_gemms = 0
        self.tied = False
        self.sdpa: list[torch.fx.Node] = []
        self.batched: list[torch.fx.Node] = []  # activation × activation GEMMs (unfused attention)
        self.col_widths: list[tuple[torch.fx.Node, int]] = []
        self.vocab_embedding = self._vocab_embedding()
        self.embedding_param_ids = {params[nodes[x].target][0] for x in structure.embedding_nodes
                                    if nodes[x].op == "get_attr" and nodes[x].target in params}
        self.hidden = self._hidden()
        self._classify_block()

    # -- dims ---------------------------------------------------------------------------------
    def _vocab_embedding(self) -> torch.fx.Node | None:
        """The embedding lookup indexed by an input (the token ids); the largest table wins."""
        embs = [self.nodes[x] for x in self.structure.embedding_nodes
                if self.nodes[x].target is aten.embedding.default]
        by_input = [e for e in embs if getattr(_root(e.args[1]), "op", "") == "placeholder"]
        return max(by_input or embs, key=lambda e: _val(e.args[0]).shape[0], default=None)

    def _hidden(self) -> int:
        for x in self.structure.block_inputs[0]:
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
        block = [self.nodes[x] for x in self.structure.block_nodes[0]]
        gemms = {n for n in block if _is_gemm(n)}
        ins = {self.nodes[x] for x in self.structure.block_inputs[0]}
        outs = {self.nodes[x] for x in self.structure.block_outputs[0]}
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
        return self.structure_seq() * self.hidden * TRAIN_BYTES_PER_ELEM

    def structure_seq(self) -> int:
        x = next(self.nodes[x] for x in self.structure.block_inputs[0]
                 if isinstance(_val(self.nodes[x]), torch.Tensor)
                 and _val(self.nodes[x]).dim() == 3)
        return int(_val(x).shape[1])


def _is_gemm(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target in _WEIGHT_GEMMS


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
    base = g.structure.block_paths[0] + "." if kind == "block" else ""
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
        elif n.target in _WEIGHT_GEMMS:
            split = g.split_of(n, kind)
            gemm = _gemm(n, g.batch, _label(n, base), split)
            n.meta[K.GEMM_IDX] = (len(r.gemms),)
            r.gemms.append(gemm)
            n.meta[K.GEMM], n.meta[K.GEMM_SPLIT] = gemm, split
            _charge_params(g, n, split, r, shared)


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


# ----- memory traffic of non-GEMM ops ----------------------------------------------------------------

def _other_bytes(g: _GraphFacts, region: list, r: _Region) -> None:
    """Bytes read + written by non-GEMM ops (elementwise, norms, softmax), 16-bit floats.

    sdpa's own non-GEMM traffic is the softmax over the s×s scores: scale/mask pass, softmax
    read and write = 3 · heads · L · S elements (as in the unfused kernels of 2104.04473).
    """
    for n in region:
        if n.op != "call_function" or n.target in VIEW_OPS or n.target in _WEIGHT_GEMMS:
            continue
        out = _val(n)
        if not isinstance(out, torch.Tensor):
            continue
        if n.target in _SDPA:
            q, k = _val(n.args[0]), _val(n.args[1])
            b = 3 * _numel(q.shape[:-1]) * int(k.shape[-2]) * TRAIN_BYTES_PER_ELEM / g.batch
            r.other += b
            r.other_split += b
            n.meta[K.OTHER] = (b, True)
            continue
        tensors = [_val(a) for a in n.all_input_nodes if isinstance(_val(a), torch.Tensor)]
        b = sum(_train_bytes(t) for t in tensors + [out]) / g.batch
        r.other += b
        split = bool(out.dim() and int(out.shape[-1]) != g.hidden)
        if split:
            r.other_split += b
        n.meta[K.OTHER] = (b, split)


def _train_bytes(t: torch.Tensor) -> float:
    if t.dtype.is_floating_point:
        return t.numel() * TRAIN_BYTES_PER_ELEM
    return t.numel() * t.element_size()


# ----- activations ----------------------------------------------------------------------------------

def _measure_activations(captured: Captured, g: _GraphFacts, regions: dict) -> None:
    """Run the graph on meta tensors; charge each saved-for-backward storage to its region."""
    gm = g.gm
    seq = g.structure_seq()
    for n in gm.graph.nodes:
        n.meta.pop(K.SAVED, None)  # a second profile of the same graph starts afresh
    run = _SavedTensorMeter(gm, g, seq)
    args = [torch.empty_like(a, device="meta") if torch.is_tensor(a) else a
            for a in captured.example_inputs]
    if captured.has_loss:
        args.append(torch.empty_like(captured.targets, device="meta"))
    with torch.autograd.graph.saved_tensors_hooks(run.pack, lambda t: t):
        run.run(*args)
    for (kind, idx), (split, repl, attn) in run.totals.items():
        if kind == "block" and idx != 0:
            continue
        r = regions[kind]
        r.act_split += split
        r.act_repl += repl
        r.act_attn += attn


class _SavedTensorMeter(torch.fx.Interpreter):
    """Interpreter on meta tensors that records the storages autograd saves, per region.

    attention: saved tensors ending in (s, s) (not counted in split / replicated).
    replicated: a saved tensor (≥2-D) whose last dim is the hidden size, unless a row-parallel
    GEMM saves it (its input is split by the GEMM). split: every other saved tensor.
    """

    def __init__(self, gm: torch.fx.GraphModule, g: _GraphFacts, seq: int):
        super().__init__(gm)
        self.g, self.seq = g, seq
        self.node: torch.fx.Node | None = None
        self.seen: set[int] = set()
        self.totals: dict[tuple, list[float]] = {}
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
        out = super().run_node(n)
        self.keep.append(out)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.producer.setdefault(t.untyped_storage()._cdata, n)
        return out

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        target, args, kwargs = _meta_call(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key in self.seen or self.node is None:
            return t
        self.seen.add(key)
        nbytes = t.untyped_storage().nbytes() / t.element_size() * (
            TRAIN_BYTES_PER_ELEM if t.dtype.is_floating_point else t.element_size())
        made_by = self.producer.get(key)
        if made_by is None or made_by in self.per_batch:
            nbytes /= self.g.batch  # per sequence; batch-independent tensors (positions) stay
        region = self.node.meta.get(K.REGION, ("embedding", None))
        acc = self.totals.setdefault(region, [0.0, 0.0, 0.0])
        if t.dim() >= 2 and int(t.shape[-1]) == self.seq and int(t.shape[-2]) == self.seq:
            acc[2] += nbytes
            cls = "attn"
        elif (t.dim() >= 2 and int(t.shape[-1]) == self.g.hidden
              and self.node.meta.get(K.GEMM_SPLIT) != "k"
              and self.g.tp.get(self.node.name) != "k"):
            acc[1] += nbytes
            cls = "repl"
        else:
            acc[0] += nbytes
            cls = "split"
        self.node.meta.setdefault(K.SAVED, []).append(
            (made_by.name if made_by is not None else None, nbytes, cls))
        return t


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
