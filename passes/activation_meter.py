"""Activations measured, not guessed: the captured graph run on the meta device under
saved_tensors_hooks (`measure_activations`), each storage autograd saves charged to the region
of the node that saved it, in three runs (`ACTIVATION_RUNS`: sdpa on its math path, as a fused
GPU kernel reading k / v un-repeated, as eager PyTorch calls the fused kernel). See
passes/graph_profile.py's docstring for the accounting; it writes node meta[K.SAVED] for
passes/tp_cost.py.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from autopar.passes import meta as K
from autopar.passes.capture import Captured
from autopar.passes.graph_facts import (FP32_LOSS_OPS, LOSS_BYTES_PER_ELEM, SDPA_OPS,
                                        TRAIN_BYTES_PER_ELEM, GraphFacts, unrepeated)

aten = torch.ops.aten


# The meter's runs: sdpa on its math path (materialized), or as a fused kernel reading k and v
# un-repeated (a GPU stack's GQA-native kernel) or as the model passes them (eager PyTorch).
ACTIVATION_RUNS = ("materialized", "flash", "flash-eager")


def measure_activations(captured: Captured, g: GraphFacts, regions: dict, run: str) -> None:
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
    units = set(g.structure.unit_blocks)
    for field_name, fused_kernels, recomputed in kept_by:
        for (kind, idx), bytes3 in meter.totals(fused_kernels, recomputed).items():
            if kind == "block" and idx not in units:   # the unit's blocks: a kind's first
                continue                                # (each of an encoder-decoder's)
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

    def __init__(self, gm: torch.fx.GraphModule, g: GraphFacts, seq: int, fused: bool = False,
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
        if self.fused and n.op == "call_function" and n.target in SDPA_OPS:
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
        elif self.node.op == "call_function" and self.node.target in FP32_LOSS_OPS:
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
        if key in self.lse or self._scores_shaped(t, made_by_batch):
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

    def _scores_shaped(self, t: torch.Tensor, made_by_batch: bool) -> bool:
        """(…, s, s): attention scores, probabilities, masks. Where the hidden width equals
        the sequence (a 2048-wide model at sequence 2048) a token × hidden activation has that
        shape too, (b, s, h) or (b·s, h) and batch-dependent: not attention (it was counted as
        attention, so selective recompute priced the layer norms' and GEMMs' inputs as freed)."""
        if t.dim() < 2 or int(t.shape[-1]) != self.seq or int(t.shape[-2]) != self.seq:
            return False
        if self.g.hidden != self.seq:
            return True
        tokens = t.dim() == 2 or (t.dim() == 3 and int(t.shape[0]) == self.g.batch)
        return not (made_by_batch and tokens)

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
