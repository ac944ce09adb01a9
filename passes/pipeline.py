"""Cut a captured (possibly tensor-split) training graph into pipeline chunks.

Chunk c holds the blocks [stages[c].first_layer, stages[c].last_layer), the embedding when
c = 0 and the head + loss when c is the last chunk; it runs on pipeline rank c mod p
(interleaved placement, 2104.04473 §2.2.2). Layer counts need not divide p·v.

`split_chunks(gm, plan) -> list[GraphModule]` is the compiler's one splitter: passes before it
run on the whole graph, passes after it on each chunk (passes/manager.py).
Requires: every compute node of the layers carries node.meta[REGION] =
  ("embedding", None) | ("block", i) | ("head", None) (written by passes/layers.py);
  node.meta[VAL] (FakeTensor) on every value; get_attr nodes name the model's parameters and
  buffers; the graph returns the scalar loss (capture with a loss_fn).
Guarantees: `split_chunks` returns p·v GraphModules. Chunk c's forward takes
  (*received, *model_inputs) — the values crossing the cut c-1 → c in graph order, then the
  model inputs / targets it reads directly — and returns the tuple of values crossing the cut
  c → c+1 (the last chunk returns the loss). Values that skip a chunk pass through it.
  Parameters live in every chunk that uses them (a tied embedding gets a copy in the first and
  the last chunk); nodes that depend on buffers and constants only (rotary tables, position
  ids) are recomputed in each chunk that needs them rather than sent.
Reads node.meta (keys of passes/meta.py): REGION, VAL, TP_LAYOUT, STACK_TRACE (in errors).
  Writes gm.meta[CHUNK] (a ChunkSpec) on each chunk; the chunk's class docstring names its
  layers and rank.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from autopar.passes import meta as K
from autopar.plan import Plan, layer_range
from autopar.runtime.context_shard import context_loss_mean
from autopar.runtime.shard import vocab_parallel_cross_entropy


@dataclass(frozen=True)
class Boundary:
    """One tensor crossing a cut: its graph name, shape, dtype and whether it carries a grad."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    replicated: bool = True  # identical on every tensor rank (False: a tensor-parallel shard or
    #                          partial sum, which each tensor rank sends whole to its peer)


@dataclass
class ChunkSpec:
    """What the runtime needs to know about one chunk besides its code."""
    chunk: int
    rank: int
    num_chunks: int
    first_layer: int
    last_layer: int
    embedding: bool
    head: bool
    recv: tuple[Boundary, ...]          # inputs from chunk - 1, in forward-argument order
    send: tuple[Boundary, ...]          # outputs to chunk + 1 (empty for the last chunk)
    model_inputs: tuple[int, ...]       # indices into (*model_inputs, targets) read directly
    params: dict[str, str] = field(default_factory=dict)   # attribute -> qualified graph name
    buffers: dict[str, str] = field(default_factory=dict)  # attribute -> qualified graph name
    objects: dict[str, str] = field(default_factory=dict)  # non-tensor attributes the runtime
    #                                                        binds (tp_group: the tensor group)
    returns_loss: bool = False
    # indices into send of the values the chunk's own nodes also read (a norm of the stream
    # computed before the cut, the stream sent beside it): autograd may have saved them, so
    # the runtime keeps their data after sending (executor.release_data)
    send_kept: tuple[int, ...] = ()
    # the last chunk's loss is a token mean of the targets skipping this index (cross-entropy's
    # ignore_index; `token_mean_ignore_index`): the runtime weighs each micro-batch by the
    # tokens it counts; None: another loss, the micro-batches' losses averaged as they are
    loss_ignore_index: int | None = None

    def describe(self) -> str:
        parts = []
        if self.embedding:
            parts.append("embedding")
        n = self.last_layer - self.first_layer
        if n:
            parts.append(layer_range(self.first_layer, self.last_layer))
        if self.head:
            parts.append("head+loss")
        return " + ".join(parts) or "(no layers: pass-through)"


def count_layers(gm: torch.fx.GraphModule) -> int:
    """Number of blocks, from the ('block', i) regions of the layers pass."""
    blocks = [n.meta[K.REGION][1] for n in gm.graph.nodes
              if n.meta.get(K.REGION, (None,))[0] == "block"]
    return max(blocks) + 1 if blocks else 0


def check_stages(plan: Plan, num_layers: int) -> None:
    """ValueError unless plan.stages cut exactly `num_layers` blocks into p·v chunks, each with
    work: layers, or the embedding (first chunk) / head + loss (last)."""
    chunks = plan.p * plan.v
    # the solver's bound (cost.solver.chunk_minimums): a chunk per layer, plus an
    # embedding-only first chunk and a head-only last chunk (Llama 3's layout)
    if chunks > 1 and chunks > num_layers + 2:
        raise ValueError(
            f"pipeline: p·v = {plan.p}·{plan.v} = {chunks} chunks but the model has only "
            f"{num_layers} layers; a pipeline has at most one chunk per layer plus an "
            f"embedding-only and a head-only chunk — lower v (at most "
            f"{max(1, (num_layers + 2) // plan.p)}) or p")
    end = plan.stages[-1].last_layer if plan.stages else 0
    if end != num_layers:
        raise ValueError(
            f"pipeline: plan.stages cover layers [0, {end}) but the graph has {num_layers} "
            f"layers; re-plan for this model (plan.num_layers={plan.num_layers})")
    for st in plan.stages:
        # the first and last chunks have work without layers (the embedding; the head + loss)
        if chunks > 1 and st.num_layers == 0 and not (st.embedding or st.head):
            raise ValueError(f"pipeline: chunk {st.chunk} has no layers ({st.describe()}); "
                             f"every chunk but the first (embedding) and the last (head + "
                             f"loss) needs at least one layer")


def _region_chunk(plan: Plan, region: tuple) -> int:
    kind, index = region
    last = len(plan.stages) - 1
    if kind == "embedding":
        return 0
    if kind == "head":
        return last
    if kind == "block":
        for st in plan.stages:
            if st.first_layer <= index < st.last_layer:
                return st.chunk
        raise ValueError(f"pipeline: layer {index} is in no stage of the plan "
                         f"(stages end at {plan.stages[-1].last_layer})")
    raise ValueError(f"pipeline: unknown region {region!r} in node meta {K.REGION!r}")


class _Analysis:
    """Chunk assignment of every node of the full graph."""

    def __init__(self, gm: torch.fx.GraphModule, plan: Plan):
        self.gm = gm
        self.plan = plan
        self.params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.free: set[torch.fx.Node] = set()        # depend on buffers/constants only
        self.param_dep: set[torch.fx.Node] = set()   # depend on a parameter (carry grads)
        self.chunk: dict[torch.fx.Node, int] = {}
        self._classify()
        self._assign()

    def _classify(self) -> None:
        for n in self.gm.graph.nodes:
            ins = n.all_input_nodes
            if n.op == "get_attr":
                (self.param_dep if n.target in self.params else self.free).add(n)
            elif n.op in ("call_function", "call_method"):
                if all(i in self.free for i in ins):
                    self.free.add(n)
                if any(i in self.param_dep for i in ins):
                    self.param_dep.add(n)

    def _compute(self, n: torch.fx.Node) -> bool:
        return n.op in ("call_function", "call_method") and n not in self.free

    def _assign(self) -> None:
        nodes = list(self.gm.graph.nodes)
        lower: dict[torch.fx.Node, int] = {}
        for n in nodes:
            if not self._compute(n):
                continue
            lb = max((self.chunk.get(i, lower.get(i, 0)) for i in n.all_input_nodes), default=0)
            lower[n] = lb
            region = n.meta.get(K.REGION)
            if n.target is operator.getitem and n.args[0] in self.chunk:
                self.chunk[n] = self.chunk[n.args[0]]
            elif region is not None:
                c = _region_chunk(self.plan, region)
                if c < lb:
                    raise ValueError(
                        f"pipeline: node {n.name} ({region}) would run in chunk {c} but reads "
                        f"a value computed in chunk {lb}; layers must form a chain "
                        f"(source: {_source_line(n)})")
                self.chunk[n] = c
        last = len(self.plan.stages) - 1
        for n in reversed(nodes):  # unlabelled nodes run as late as their users allow
            if not self._compute(n) or n in self.chunk:
                continue
            users = [self.chunk.get(u, last) for u in n.users if u in self.chunk or u.op == "output"]
            self.chunk[n] = max(lower[n], min(users, default=lower[n]))
        # getitems of an unlabelled multi-output node follow their source.
        for n in nodes:
            if n in self.chunk and n.target is operator.getitem and n.args[0] in self.chunk:
                self.chunk[n] = self.chunk[n.args[0]]

    def crossing(self, c: int) -> list[torch.fx.Node]:
        """Values computed before chunk c and read in chunk c or later (graph order)."""
        out = []
        for n in self.gm.graph.nodes:
            pc = self.chunk.get(n)
            if pc is None or pc >= c:
                continue
            if any(self._user_chunk(u) >= c for u in n.users):
                out.append(n)
        return out

    def _user_chunk(self, u: torch.fx.Node) -> int:
        if u.op == "output":
            return len(self.plan.stages) - 1
        if u in self.chunk:
            return self.chunk[u]
        return -1  # free / attr users never read compute values


def _source_line(n: torch.fx.Node) -> str:
    trace = n.meta.get(K.STACK_TRACE) or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown"


def _boundary(n: torch.fx.Node, analysis: _Analysis) -> Boundary:
    val = n.meta.get(K.VAL)
    if not isinstance(val, torch.Tensor):
        raise ValueError(
            f"pipeline: value {n.name} ({type(val).__name__}) crosses a chunk boundary but is "
            f"not a tensor; only tensors can be sent between stages — move the cut "
            f"(source: {_source_line(n)})")
    grad = n in analysis.param_dep and val.dtype.is_floating_point
    layout = n.meta.get(K.TP_LAYOUT)   # written by passes/tensor_parallel when t > 1
    replicated = layout is None or type(layout).__name__ == "Replicate"
    return Boundary(n.name, tuple(int(s) for s in val.shape), str(val.dtype).replace("torch.", ""),
                    grad, replicated)


# token-wise views between the targets input and the loss (flattening (B, T) to (B·T,))
_TARGET_VIEWS = {torch.ops.aten.view, torch.ops.aten.reshape, torch.ops.aten._unsafe_view,
                 torch.ops.aten.flatten, torch.ops.aten.clone, torch.ops.aten.alias,
                 torch.ops.aten.contiguous, torch.ops.aten.to, torch.ops.aten._to_copy}


def token_mean_ignore_index(loss: Any, targets: torch.fx.Node) -> int | None:
    """The ignore_index of `loss` when it is the mean over the counted tokens of `targets`
    (the graph's targets input, through views): cross-entropy / nll with reduction mean and no
    class weights, the vocabulary-parallel cross-entropy, or the context-parallel token mean
    (their positions: aten (input, target, weight, reduction, ignore_index); vocab-parallel
    (logits, target, group, vocab, ignore_index, reduction); context (sum, target, cp,
    ignore_index)); None for any other loss."""
    if not isinstance(loss, torch.fx.Node) or loss.op != "call_function":
        return None
    op = getattr(loss.target, "overloadpacket", loss.target)
    args = dict(enumerate(loss.args))
    kw = loss.kwargs
    if op is context_loss_mean:
        index = args.get(3, kw.get("ignore_index", -100))
    elif op is vocab_parallel_cross_entropy:
        if args.get(5, kw.get("reduction", 1)) != 1:
            return None
        index = args.get(4, kw.get("ignore_index", -100))
    elif op in (torch.ops.aten.cross_entropy_loss, torch.ops.aten.nll_loss,
                torch.ops.aten.nll_loss_nd, torch.ops.aten.nll_loss2d):
        if args.get(3, kw.get("reduction", 1)) != 1 or args.get(2, kw.get("weight")) is not None:
            return None
        index = args.get(4, kw.get("ignore_index", -100))
    else:
        return None
    target = args.get(1)
    while (isinstance(target, torch.fx.Node) and target.op == "call_function"
           and getattr(target.target, "overloadpacket", target.target) in _TARGET_VIEWS):
        target = target.args[0]
    return int(index) if target is targets else None


def attr_name(qualified: str) -> str:
    """Flat attribute name for a dotted parameter/buffer name: 'h.0.ln.weight' -> 'h_0_ln_weight'."""
    return qualified.replace(".", "_")


def _build_chunk(analysis: _Analysis, c: int, prefix: str) -> torch.fx.GraphModule:
    """Why this size: one chunk's graph built in order (received values, its nodes copied with
    their parameters, buffers and objects, the values it sends, the output); the steps share the
    copy's environment."""
    plan, gm = analysis.plan, analysis.gm
    st = plan.stages[c]
    last = c == len(plan.stages) - 1
    recv = analysis.crossing(c) if c > 0 else []
    send = analysis.crossing(c + 1) if not last else []
    mine = [n for n in gm.graph.nodes if analysis.chunk.get(n) == c]
    used_inputs = sorted({analysis.placeholders.index(i) for n in mine for i in n.all_input_nodes
                          if i.op == "placeholder"})

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    root = torch.nn.Module()
    params: dict[str, str] = {}
    buffers: dict[str, str] = {}
    objects: dict[str, str] = {}
    for n in recv:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for i in used_inputs:
        ph = analysis.placeholders[i]
        env[ph] = graph.placeholder(ph.name)
        env[ph].meta = dict(ph.meta)

    def lookup(n: torch.fx.Node) -> torch.fx.Node:
        if n in env:
            return env[n]
        if n.op == "get_attr":
            qual = n.target[len(prefix):] if n.target.startswith(prefix) else n.target
            name = attr_name(qual)
            value = _fetch_attr(gm, n.target)
            if n.target in analysis.params:
                params[name] = qual
                root.register_parameter(name, value)
            elif isinstance(value, torch.Tensor):
                buffers[name] = qual
                root.register_buffer(name, value)
            else:
                if not isinstance(value, torch.nn.Module):
                    objects[name] = qual
                setattr(root, name, value)
            env[n] = graph.get_attr(name)
        elif n in analysis.free:
            env[n] = graph.node_copy(n, lookup)
        else:
            raise RuntimeError(f"pipeline: internal error: {n.name} is needed in chunk {c} "
                               f"but is computed in chunk {analysis.chunk.get(n)}")
        env[n].meta = dict(n.meta)
        return env[n]

    for n in mine:
        env[n] = graph.node_copy(n, lookup)
    loss_ignore_index = None
    if last:
        outs = [x for x in torch.utils._pytree.tree_leaves(analysis.output.args[0])
                if isinstance(x, torch.fx.Node)]
        out_vals = [lookup(x) for x in outs]
        if len(out_vals) != 1:
            raise ValueError(f"pipeline: the graph returns {len(out_vals)} values; the last chunk "
                             f"must return the scalar loss — capture with loss_fn")
        graph.output(out_vals[0])
        loss_ignore_index = token_mean_ignore_index(outs[0], analysis.placeholders[-1])
    else:
        graph.output(tuple(lookup(n) for n in send))
    graph.eliminate_dead_code()
    graph.lint()
    # weights only dead code read (an encoder's unused pooler) are no part of the chunk:
    # full_state_dict gives them the model's own values, as training leaves them
    alive = {n.target for n in graph.nodes if n.op == "get_attr"}
    params = {a: q for a, q in params.items() if a in alive}
    buffers = {a: q for a, q in buffers.items() if a in alive}

    spec = ChunkSpec(
        chunk=c, rank=st.rank, num_chunks=len(plan.stages), first_layer=st.first_layer,
        last_layer=st.last_layer, embedding=st.embedding, head=st.head,
        recv=tuple(_boundary(n, analysis) for n in recv),
        send=tuple(_boundary(n, analysis) for n in send),
        send_kept=tuple(i for i, n in enumerate(send)
                        if any(u.op != "output" for u in lookup(n).users)),
        model_inputs=tuple(used_inputs), params=params, buffers=buffers, objects=objects,
        returns_loss=last, loss_ignore_index=loss_ignore_index)
    chunk = torch.fx.GraphModule(root, graph, class_name=f"Chunk{c}")
    chunk.meta[K.CHUNK] = spec
    type(chunk).__doc__ = (f"Pipeline chunk {c} of {spec.num_chunks}: {spec.describe()}; "
                           f"runs on pipeline rank {st.rank}.")
    return chunk


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def split_chunks(gm: torch.fx.GraphModule, plan: Plan, *, prefix: str = "model."
                 ) -> list[torch.fx.GraphModule]:
    """Cut `gm` into len(plan.stages) chunk GraphModules (see the module docstring).

    `prefix` is stripped from attribute targets so chunk parameter names are the user's
    state-dict keys (capture wraps the model as `model`).
    """
    num_layers = count_layers(gm)
    if num_layers == 0:
        raise ValueError("pipeline: no ('block', i) regions in the graph; run the layers pass "
                         "(passes.layers.LAYERS_PASS) before split_chunks")
    check_stages(plan, num_layers)
    analysis = _Analysis(gm, plan)
    return [_build_chunk(analysis, c, prefix) for c in range(len(plan.stages))]


def chunk_attr_targets(gm: torch.fx.GraphModule, plan: Plan) -> list[set[str]]:
    """Per chunk, the get_attr targets (parameters, buffers, constants) its nodes read.

    The same assignment split_chunks makes, without building the chunks: the runtime uses it
    to materialise only the weights of its own pipeline rank's chunks (a tied embedding is in
    the first and the last chunk's set). Reads node.meta[REGION].
    """
    check_stages(plan, count_layers(gm))
    analysis = _Analysis(gm, plan)
    out: list[set[str]] = [set() for _ in plan.stages]

    def reach(n: torch.fx.Node, c: int, seen: set[torch.fx.Node]) -> None:
        for i in n.all_input_nodes:
            if i in seen:
                continue
            seen.add(i)
            if i.op == "get_attr":
                out[c].add(i.target)
            elif i in analysis.free:     # recomputed in the chunk: its attrs are read there
                reach(i, c, seen)

    seen: list[set[torch.fx.Node]] = [set() for _ in plan.stages]
    for n in gm.graph.nodes:
        c = analysis.chunk.get(n)
        if c is not None:
            reach(n, c, seen[c])
    return out
