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
The graph's facts (dims, GEMM classification) come from passes/graph_facts.py, the fusion
model from passes/fusion.py, the activation measurement from passes/activation_meter.py.
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
    one kernel each (`Fusion`, passes/fusion.py), views / casts / p=0 dropout free, lookups
    reading rows, the loss in fp32;
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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopar.cost.profile import (FLASH_TILE, AttentionCall, EagerOps, FusedAttention, Gemm,
                                  LayerKind, ModelProfile, RegionProfile, causal_tile_fraction)
from autopar.passes import meta as K
from autopar.passes.capture import Captured
from autopar.passes.layers import LayerStructure
from autopar.passes.activation_meter import ACTIVATION_RUNS, measure_activations
from autopar.passes.fusion import DROPOUT_OPS, VIEW_OPS
from autopar.passes.graph_facts import (FP32_LOSS_OPS, LOSS_BYTES_PER_ELEM, SDPA_OPS,
                                        TRAIN_BYTES_PER_ELEM, WEIGHT_GEMMS, GraphFacts, bias_of,
                                        gemm_operands, is_gemm, node_val, numel, param_root,
                                        train_bytes, unrepeated, weight_of)
from autopar.passes.sharding import (ancestors, fed_by_grouped_mm, is_expert_bmm, is_grouped_mm,
                                     source_line)

aten = torch.ops.aten
# Largest attention mask (entries) read on the CPU to find the tiles a fused kernel skips:
# 16K × 16K booleans, a few hundred MB while it is evaluated.
MASK_READ_LIMIT = 1 << 28


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
    ops: int = 0       # forward aten ops dispatched one by one (not GEMMs, not attention)
    # a mixture of experts: the experts' 3-D weights (id -> their expert count; the most is the
    # experts per layer), and per expert count the elements one token dispatch moves per
    # sequence (rows · hidden of each expert chain's input)
    expert_params: dict = field(default_factory=dict)
    dispatch: dict = field(default_factory=dict)


def sequence_length(captured: Captured, structure: LayerStructure) -> int:
    """Tokens per sequence: dim 1 of the first example input when it holds token ids (B, T);
    for pixels or features (a floating-point input) the tokens the repeated blocks see,
    dim 1 of the first (B, S, H) value of block 0 (ViT: patches + class token)."""
    first = next(a for a in captured.example_inputs if torch.is_tensor(a))
    if not first.is_floating_point():
        return int(first.shape[1]) if first.dim() > 1 else int(first.shape[0])
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    for name in structure.unit_nodes:
        v = node_val(nodes[name])
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
    _refuse_data_dependent_sizes(gm)
    batch = captured.batch_size
    if seq_len is None:
        seq_len = sequence_length(captured, structure)
    nodes = {n.name: n for n in gm.graph.nodes}
    params = param_identity(captured)
    g = GraphFacts(gm, structure, nodes, params, batch)
    regions = {"embedding": _Region(), "block": _Region(), "head": _Region()}
    for kind, names in (("embedding", structure.embedding_nodes),
                        ("block", structure.unit_nodes), ("head", structure.head_nodes)):
        _gemms_and_params(g, kind, [nodes[x] for x in names], regions[kind])
        _other_bytes(g, [nodes[x] for x in names], regions[kind])
    shared = _shared_block_params(g, structure, regions["block"])
    for run in ACTIVATION_RUNS if any(r.calls for r in regions.values()) else ("materialized",):
        measure_activations(captured, g, regions, run)
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
                if structure.num_blocks != structure.num_layers else "")] + g.mask_notes + list(
        structure.notes)
    if kinds:
        notes.append(f"{len(kinds)} stacks ({', '.join(k.name for k in kinds)}) priced as "
                     f"{units} units of one layer of each: a stage of one stack's layers is "
                     f"priced at the unit's mean; stages are cut where the forward FLOPs of "
                     f"the layers match the solver's split")
    return ModelProfile(name=name, num_layers=units, seq_len=s, hidden=h,
                        heads=dims["heads"], kv_heads=dims["kv_heads"], vocab=dims["vocab"],
                        ffn=dims["ffn"], embedding=out["embedding"], block=out["block"],
                        head=out["head"], tied_embeddings=g.tied,
                        shared_split_elems=sum(e for e, sp in shared.values() if sp),
                        shared_replicated_elems=sum(e for e, sp in shared.values() if not sp),
                        activation_bytes_per_elem=TRAIN_BYTES_PER_ELEM, notes=tuple(notes),
                        layer_kinds=kinds)


def _refuse_data_dependent_sizes(gm: torch.fx.GraphModule) -> None:
    """One line for a graph whose sizes depend on the data (JetMoE splits its tokens into one
    linear per expert by the router's counts: rows u0, u1, ...), which no price can count."""
    for n in gm.graph.nodes:
        for v in _flat(n.meta.get(K.VAL)):
            if isinstance(v, torch.Tensor) and free_unbacked_symbols(v):
                raise ValueError(
                    f"planning: node {n.name} ({n.target}) has a size that depends on the data "
                    f"({list(v.shape)}) at {source_line(n)}: autopar prices and splits layers "
                    f"whose sizes the inputs fix; run the model's layers with fixed sizes (for "
                    f"a mixture of experts, one grouped matmul over 3-D expert weights, as "
                    f"transformers' grouped_mm experts do)")


def _shared_block_params(g: GraphFacts, structure: LayerStructure, r: _Region
                         ) -> dict[int, tuple[int, bool]]:
    """The unit block's parameters of modules called at several depths (`BlockKind.shared`),
    taken out of its per-layer parameters: one set for all the layers that call them
    (`ModelProfile.shared_split_elems`), {identity: (elements, split)}."""
    mods = tuple(m + "." for k in structure.kinds for m in k.shared)
    if not mods:
        return {}
    ids = {g.params[t][0] for t in g.params if t.startswith(mods)}
    return {pid: r.params.pop(pid) for pid in list(r.params) if pid in ids}


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
    sets = _expert_sets(r)
    return RegionProfile(
        kind=kind, name=kind, gemms=tuple(r.gemms), params_split_elems=split,
        params_replicated_elems=repl, act_split_bytes=round(r.act_split),
        act_replicated_bytes=round(r.act_repl), act_attention_bytes=round(r.act_attn),
        input_bytes=input_bytes, other_bytes=round(r.other), other_split_bytes=round(r.other_split),
        tp_allreduce_elems=r.allreduce, fused=fused(r.fused_act), eager=eager,
        expert_params_elems=sum(s[1] for s in sets),
        experts=max(r.expert_params.values(), default=0),
        expert_dispatch_elems=sum(s[2] for s in sets), expert_sets=sets, eager_ops=r.ops,
        param_tensors=len(r.params))


def param_identity(captured: Captured) -> dict[str, tuple[int, int]]:
    """Graph get_attr target -> (identity, elems) for every parameter; tied names share one id."""
    out = {}
    for pname, p in captured.model.named_parameters(remove_duplicate=False):
        out[captured.prefix + pname] = (id(p), p.numel())
    return out


# ----- GEMMs and parameters ------------------------------------------------------------------------

def _gemms_and_params(g: GraphFacts, kind: str, region: list, r: _Region) -> None:
    # a block's GEMMs are named within it ("attn.c_attn"); a unit of several kinds' within
    # the model ("encoder.block.0.layer.0.SelfAttention.q")
    one_kind = len(g.structure.kinds) == 1
    base = g.structure.block_paths[0] + "." if kind == "block" and one_kind else ""
    table = param_root(g.vocab_embedding.args[0]) if g.vocab_embedding is not None else None
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
        if n.target in SDPA_OPS:
            n.meta[K.GEMM_IDX] = (len(r.gemms), len(r.gemms) + 1)
            r.gemms.extend(_sdpa_gemms(n, g.batch, _label(n, base)))
            n.meta[K.GEMM_SPLIT] = "batch"
            r.calls.append(_attention_call(g, n, n.meta[K.GEMM_IDX]))
        elif n.target in WEIGHT_GEMMS or is_grouped_mm(n):
            split = g.split_of(n, kind)
            gemm = _gemm(n, g.batch, _label(n, base), split)
            n.meta[K.GEMM_IDX] = (len(r.gemms),)
            r.gemms.append(gemm)
            n.meta[K.GEMM], n.meta[K.GEMM_SPLIT] = gemm, split
            _charge_params(g, n, split, r, shared)
            if is_grouped_mm(n) or n in g.expert_bmms:
                _charge_experts(g, n, gemm, r)


def _charge_experts(g: GraphFacts, n: torch.fx.Node, gemm: Gemm, r: _Region) -> None:
    """An experts' grouped matmul or batched one (of a chain ep can spread: GraphFacts
    expert_bmms): its weight (E, K, N) holds E experts, which expert parallelism spreads over
    the ranks; the first of a chain (not fed by another experts' product; of a batched chain,
    one entry) reads the rows sorted by expert, gemm.batch · gemm.m rows of gemm.k elements per
    sequence (grouped: tokens · k; batched: E · tokens): what one all-to-all moves to the
    experts' ranks (and the combine moves back)."""
    w = weight_of(n)
    experts = int(node_val(w).shape[0]) if w is not None else 0
    if w is not None and w.target in g.params:
        r.expert_params[g.params[w.target][0]] = experts
    first = (not fed_by_grouped_mm(n)) if is_grouped_mm(n) else n in g.bmm_dispatchers
    if first:
        r.dispatch[experts] = r.dispatch.get(experts, 0) + gemm.batch * gemm.m * gemm.k


def _expert_sets(r: _Region) -> tuple[tuple[int, int, int], ...]:
    """(experts, params elems, dispatch elems) per expert count of the region's experts."""
    counts = sorted(set(r.expert_params.values()) | set(r.dispatch))
    return tuple((e, sum(r.params[pid][0] for pid, k in r.expert_params.items()
                         if k == e and pid in r.params), r.dispatch.get(e, 0))
                 for e in counts)


def _charge_params(g: GraphFacts, n: torch.fx.Node, split: Any, r: _Region,
                   shared: set) -> None:
    """Weights of column/row GEMMs are split; biases of column GEMMs too, of row GEMMs not."""
    for p, is_split in ((weight_of(n), split in ("n", "k")), (bias_of(n), split == "n")):
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
    a, b = (node_val(x) for x in gemm_operands(n))
    out = node_val(n)
    has_w = weight_of(n) is not None
    if n.target is aten.linear.default:
        M, K, N = numel(a.shape[:-1]), int(a.shape[-1]), int(b.shape[0])
        return Gemm(name=name, batch=1, m=M // batch, n=N, k=K, tp_split=split)
    if is_grouped_mm(n):
        # (M, K) rows sorted by expert · (E, K, N): M = tokens · top-k, so the FLOPs are those
        # of the k experts each token is routed to, not of all E; the weights (all E experts)
        # are charged as parameters
        M, K, N = numel(a.shape[:-1]), int(a.shape[-1]), int(b.shape[-1])
        return Gemm(name=name, batch=1, m=M // batch, n=N, k=K, tp_split=split, expert=True)
    if is_expert_bmm(n):
        # (E, rows, K) · (E, K, N): each expert's rows hold every token of the batch (Llama 4
        # weights them by the router's scores), so per sequence E products of tokens rows
        E, rows, K = (int(d) for d in a.shape)
        return Gemm(name=name, batch=E, m=rows // batch, n=int(b.shape[-1]), k=K,
                    tp_split=split)
    if b.dim() == 2:  # (…, M, K) · (K, N): a linear layer written as mm / matmul
        M, K, N = numel(a.shape[:-1]), int(a.shape[-1]), int(b.shape[-1])
        return Gemm(name=name, batch=1, m=M // batch, n=N, k=K, tp_split=split,
                    has_weight_grad=has_w)
    # batched: (…, M, K) · (…, K, N); the leading dims hold the batch (and heads)
    lead = numel(out.shape[:-2])
    M, K, N = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
    per_seq = lead // batch if lead % batch == 0 else lead
    return Gemm(name=name, batch=per_seq, m=M, n=N, k=K, tp_split=split,
                batch_scales=not has_w, has_weight_grad=has_w)


def _sdpa_gemms(n: torch.fx.Node, batch: int, name: str) -> list[Gemm]:
    q, k, v = (node_val(x) for x in n.args[:3])  # (B, H, L, E), (B, Hk, S, E), (B, Hk, S, Ev)
    heads = numel(q.shape[:-2]) // batch
    L, E, S, Ev = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2]), int(v.shape[-1])
    common = dict(batch=heads, tp_split="batch", batch_scales=True, has_weight_grad=False)
    return [Gemm(name=f"{name}.scores", m=L, n=S, k=E, **common),
            Gemm(name=f"{name}.context", m=L, n=Ev, k=S, **common)]


def _attention_call(g: GraphFacts, n: torch.fx.Node, gemms: tuple[int, ...]) -> AttentionCall:
    """The fused-kernel view of one sdpa node (cost/profile.py AttentionCall), per sequence."""
    q, k, v = (node_val(x) for x in n.args[:3])  # (B, H, L, E), (B, Hk, S, E), (B, Hk, S, Ev)
    heads = numel(q.shape[:-2]) // g.batch
    L, E, S, Ev = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2]), int(v.shape[-1])
    kv = numel(node_val(unrepeated(n.args[1])).shape[:-2]) // g.batch
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
            total += 2 * numel(node_val(u).shape) * TRAIN_BYTES_PER_ELEM / batch
        elif u.target in VIEW_OPS:
            todo.extend(u.users)
    return total


def _score_bytes(n: torch.fx.Node, batch: int) -> float:
    """Per sequence: the materialized softmax's scale/mask pass, softmax read and write over the
    scores, 3 · heads · L · S 16-bit elements (the unfused kernels of 2104.04473)."""
    q, k = node_val(n.args[0]), node_val(n.args[1])
    return 3 * numel(q.shape[:-1]) * int(k.shape[-2]) * TRAIN_BYTES_PER_ELEM / batch


# ----- memory traffic of non-GEMM ops ----------------------------------------------------------------

def _other_bytes(g: GraphFacts, region: list, r: _Region) -> None:
    """Bytes read + written by non-GEMM ops (elementwise, norms, softmax), 16-bit floats.

    A chain of elementwise ops runs as one fused kernel (`Fusion`): it reads each outside
    input once and writes only the values used outside it. An index lookup (embedding) reads
    the rows it gathers, not its table. Views and dropout with p = 0 (which returns its input)
    move nothing; dropout with p > 0 also writes its 1-byte mask.
    sdpa's own non-GEMM traffic is the softmax over the s×s scores: scale/mask pass, softmax
    read and write = 3 · heads · L · S elements (as in the unfused kernels of 2104.04473).
    """
    fusion = g.fusion
    for n in region:
        if (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                and not is_gemm(n) and n.target not in SDPA_OPS):
            r.ops += 1   # dispatched eagerly, views too (`RegionProfile.eager_ops`)
        if n.op != "call_function" or fusion.is_view(n) or is_gemm(n):
            continue
        outs = [t for t in _flat(node_val(n)) if isinstance(t, torch.Tensor)]
        if not outs:
            continue
        if n.target in SDPA_OPS:
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


def _op_bytes(g: GraphFacts, n: torch.fx.Node, reads: list, writes: list,
              outs: list) -> tuple[float, list]:
    """Bytes per sequence op n moves reading `reads` and writing `writes` (and the tensors it
    reads): parameters (norm weights, O(h)) are read once per micro-batch, not per sequence;
    an index lookup reads the rows it gathers, not its table; the loss writes fp32
    log-probabilities; dropout writes its 1-byte mask (native_dropout on GPUs)."""
    reads = [a for a in reads if g.fusion.source(a).op != "get_attr"]
    if n.target in _INDEX_OPS:
        reads = [a for a in reads if a is not n.args[0]]
    tensors = [node_val(a) for a in reads if isinstance(node_val(a), torch.Tensor)]
    if n.target in _INDEX_OPS:
        tensors.append(outs[0])
    b = sum(train_bytes(t) for t in tensors + writes) / g.batch
    if n.target in FP32_LOSS_OPS and tensors:
        b += tensors[0].numel() * LOSS_BYTES_PER_ELEM / g.batch
    if n.target in DROPOUT_OPS:
        b += outs[0].numel() / g.batch
    return b, tensors


def _flat(v: Any) -> list:
    return list(v) if isinstance(v, (tuple, list)) else [v]


_INDEX_OPS = frozenset({aten.embedding.default, aten.index_select.default,
                        aten.gather.default})
