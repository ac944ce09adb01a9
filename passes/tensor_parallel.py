"""Tensor parallelism as a graph pass (Megatron-LM 1909.08053, sequence parallelism 2205.05198).

Two passes over the captured ATen graph:

`propagate_sharding(gm, t)`  (analysis, passes/tp_layouts.py) gives every node a layout — Replicate, Shard(dim,
    blocks) or Partial — with the rules of `passes/sharding/`, and every parameter its split.
    The Megatron pattern is found, not named: each weight matmul with a replicated input is a
    column-parallel candidate; a candidate stays split only if its output can be carried
    (through elementwise ops, head reshapes, rotary arithmetic, attention, ...) to matmuls that
    contract over the split (row-parallel, Partial) or to a cross-entropy (vocab-parallel)
    without gathering it back. Everything else falls back to replicated, and is reported.

`apply_tensor_parallel(gm, t, tp_rank, group)`  (transformation) rewrites the graph for one
    rank: parameters become local shards, shape constants of view/reshape/expand/split become
    local sizes, and collectives go on the edges where layouts change:

        Replicate ─f─▶ split region     copy_to_tp     (fwd identity, bwd all-reduce)
        Partial  ─g─▶ Replicate         reduce_from_tp (fwd all-reduce, bwd identity)
        Partial  ───▶ Shard(seq)        reduce_scatter_to_sp (per-row blocks: shuffle_blocks first)
        Shard(seq) ─▶ Replicate         all_gather_sp (bwd reduce-scatter) or gather_from_sp
        Replicate ──▶ Shard             scatter_to_sp (local slice, bwd all-gather)
        Whole ─────▶ Shard              local_blocks (a slice; its gradient stays a summand)
        a mixed weight's whole rows     copy_to_tp_parts (bwd all-reduce of those rows)

    The collectives are `call_function` nodes on importable functions whose group argument is
    the GraphModule attribute `tp_group` (a get_attr node), never a global; the rank-dependent
    parts (vocab offsets, RNG streams) are computed from the group at run time, so all ranks
    run the same code with different parameters.

Typical use (one process per tensor rank, torch.distributed initialised):

    gm = capture(model, (ids,), loss_fn, targets).gm
    gm = apply_tensor_parallel(gm, t, tp_rank, group, sequence_parallel=False)
    loss = gm(ids, targets); loss.backward()
    full = gather_full_state_dict(gm, group)      # the single-device state dict, unpadded
"""
from __future__ import annotations

import itertools
import operator
import warnings
from functools import partial
from typing import Any, Callable, Collection

import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes import sharding as S
from autopar.passes.manager import Pass, run_passes
from autopar.passes.sharding import Partial, Replicate, Shard, Whole, is_split, packet, shape
# the analysis (passes/tp_layouts.py); PropagationError and sequence_parallel_fits re-exported
# beside propagate_sharding: the pass's public names in one place
from autopar.passes.tp_layouts import (PropagationError, TPInfo, check_degree,  # noqa: F401
                                       propagate_sharding, sequence_parallel_fits)
from autopar.runtime import collectives as C
from autopar.runtime import shard as shard_rt

aten = torch.ops.aten


# ----- transformation ---------------------------------------------------------------------------

def apply_tensor_parallel(gm: fx.GraphModule, plan_or_t: Any, tp_rank: int, group: Any,
                          sequence_parallel: bool | None = None, **options: Any
                          ) -> fx.GraphModule:
    """Rewrite `gm` in place into tensor rank `tp_rank`'s program: `tensor_parallel_pass` (see
    it for the options and the guarantees) run on gm, linted and recompiled."""
    return run_passes(gm, [tensor_parallel_pass(plan_or_t, tp_rank, group, sequence_parallel,
                                                **options)])


def tensor_parallel_pass(plan_or_t: Any, tp_rank: int, group: Any,
                         sequence_parallel: bool | None = None, *, seed: int = 0,
                         model: torch.nn.Module | None = None,
                         init: Callable[[torch.nn.Module], None] | None = None,
                         prefix: str = "model.", vocab_multiple: int = 128,
                         materialize: Collection[str] | None = None) -> Pass:
    """The pass rewriting a graph in place into tensor rank `tp_rank`'s program (of `t` ranks
    in `group`); the arguments are checked here, before any graph work.

    Requires: gm from capture; `plan_or_t` an int t or a Plan (its t, sequence_parallel);
      `group` the tensor-parallel ProcessGroup (None only for t = 1 or for inspecting the
      rewritten graph without running it). Runs propagate_sharding first unless
      gm.meta[TP_INFO] already holds a decision for this t and mode.
    Guarantees: parameters on gm are this rank's local shards (sliced from real parameters,
      or, for parameters on the meta device, sliced from the global-shape init of their
      owning module of the user's `model` (graph names minus `prefix`) under the seed
      (seed, module path): its reset_parameters(), then `init(module)` (e.g. the model's
      init_weights) — one module's parameters in memory at a time; meta buffers are restored
      from meta_init's record). With `materialize` (a set of get_attr targets, e.g. the
      weights of this pipeline rank's chunks from passes.pipeline.chunk_attr_targets), only
      those become real tensors; every other tensor attribute becomes a meta tensor of its
      local shape (never initialised, never copied). view/reshape/expand/split constants are
      local; collectives are call_function nodes taking the get_attr node `tp_group`
      (gm.tp_group = group).
    Reads (keys of passes/meta.py): TP_INFO, TP_LAYOUT, TP_CONVERT, TP_ROLE, TP_PARAM, VAL,
      CP_SEQ_DIM. Writes: those (propagate_sharding), VAL made local with the global value
      kept in TP_GLOBAL_VAL; a node it makes from an input with CP_SEQ_DIM (the context
      split's layout, recorded before this pass) gets that input's.
    Why this size: the pass's options (rank, group, sequence parallelism, seed, model, init,
    prefix, vocab padding, materialize) are checked here and bound once into the rewrite.
    """
    t = getattr(plan_or_t, "t", plan_or_t)
    if sequence_parallel is None:
        sequence_parallel = bool(getattr(plan_or_t, "sequence_parallel", False))
    check_degree(t)
    if group is not None and C.group_size(group) != t:
        raise ValueError(f"apply_tensor_parallel: the group has {C.group_size(group)} ranks but "
                         f"t={t}; pass the tensor-parallel group of this rank")
    if not 0 <= tp_rank < t:
        raise ValueError(f"apply_tensor_parallel: tp_rank={tp_rank} is outside [0, {t})")
    rewrite = partial(_rewrite_rank, t=t, tp_rank=tp_rank, group=group,
                      sequence_parallel=sequence_parallel, seed=seed, model=model, init=init,
                      prefix=prefix, vocab_multiple=vocab_multiple, materialize=materialize)
    return Pass(f"tensor_parallel[t={t}, rank={tp_rank}]", rewrite,
                reads=(K.VAL, K.TP_INFO, K.TP_LAYOUT, K.TP_CONVERT, K.TP_ROLE, K.TP_PARAM,
                       K.CP_SEQ_DIM),
                writes=(K.VAL, K.TP_INFO, K.TP_LAYOUT, K.TP_CONVERT, K.TP_ROLE, K.TP_PARAM,
                        K.TP_GLOBAL_VAL, K.CP_SEQ_DIM))


def _rewrite_rank(gm: fx.GraphModule, *, t: int, tp_rank: int, group: Any,
                  sequence_parallel: bool, seed: int, model: torch.nn.Module | None,
                  init: Callable | None, prefix: str, vocab_multiple: int,
                  materialize: Collection[str] | None) -> fx.GraphModule:
    """Why this size: the options `tensor_parallel_pass` checked and bound (keyword-only), one
    rank's rewrite."""
    info = gm.meta.get(K.TP_INFO)
    if info is None or info.t != t or info.sequence_parallel != sequence_parallel:
        propagate_sharding(gm, t, sequence_parallel=sequence_parallel,
                           vocab_multiple=vocab_multiple)
        info = gm.meta[K.TP_INFO]
    if _shard_parameters(gm, info, tp_rank, t, model, init, prefix, seed, materialize):
        _real_device_constants(gm, torch.device("cpu"))
    gm.tp_group = group if group is not None or t == 1 else shard_rt.UnboundGroup(t)
    if t > 1:
        gm.tp_rng = shard_rt.DropoutStreams(tp_rank)   # a fresh program, fresh streams
        _Rewriter(gm, t, seed).run()
    gm.tp_rank = tp_rank
    return gm


def _get_owner(gm: torch.nn.Module, target: str) -> tuple[torch.nn.Module, str]:
    *path, name = target.split(".")
    owner = gm
    for p in path:
        owner = getattr(owner, p)
    return owner, name


def _shard_parameters(gm: fx.GraphModule, info: TPInfo, rank: int, t: int,
                      model: torch.nn.Module | None, init: Callable | None, prefix: str,
                      seed: int, materialize: Collection[str] | None = None) -> bool:
    """Replace every split parameter (and its tied aliases) by this rank's shard; materialise
    meta parameters and buffers locally (see autopar.runtime.shard: global-shape init per
    module, buffers recorded by meta_init) — only the targets in `materialize` when given,
    the rest become meta tensors of local shape. Returns whether anything was on the meta
    device.
    Why this size: the parameter sources of a rank's shards (the user's model, its init, the
    graph-name prefix, the seed, the targets to materialize) travel together from the pass's
    options."""
    meta = _MetaSource(model, init, prefix, seed)
    made: set[int] = set()          # ids of the replacements already installed
    saw_meta = False
    targets = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    # by tensor, not by name: a tied weight is real if any of its names is wanted
    wanted = None if materialize is None else {
        id(getattr(*_get_owner(gm, x), None)) for x in targets if x in materialize}
    for target in sorted(targets):
        owner, name = _get_owner(gm, target)
        full = getattr(owner, name, None)
        if not isinstance(full, torch.Tensor) or id(full) in made:
            continue    # not a tensor, or an alias already replaced through a tied name
        saw_meta |= full.is_meta
        split = info.params.get(target) if t > 1 else None
        real = wanted is None or id(full) in wanted
        if split is None and not full.is_meta and real:
            continue
        if real:
            value = meta.value(target, full) if full.is_meta else full.detach()
        else:   # another pipeline rank's weight: its local shape only, no memory
            value = full.detach() if full.is_meta else torch.empty_like(full, device="meta")
        local = shard_rt.local_shard(value, split, rank, t) if split is not None else value
        new = (torch.nn.Parameter(local, requires_grad=full.requires_grad)
               if isinstance(full, torch.nn.Parameter) else local)
        made.add(id(new))
        _replace_everywhere(gm, full, new)   # every alias (tied names) now holds `new`
    return saw_meta


def _real_device_constants(gm: fx.GraphModule, device: torch.device) -> None:
    """A graph captured from a meta model with meta example inputs baked `device=meta` into
    its factory calls (arange for positions, masks): they now make tensors on `device`."""
    for node in gm.graph.nodes:
        dev = node.kwargs.get("device") if node.op == "call_function" else None
        if dev is not None and torch.device(dev).type == "meta":
            node.kwargs = {**node.kwargs, "device": device}


class _MetaSource:
    """Full values of a meta model's tensors, one owning module at a time (the last module's
    values are cached so its other parameters do not re-run its init)."""

    def __init__(self, model: torch.nn.Module | None, init: Callable | None, prefix: str,
                 seed: int):
        self.model, self.init, self.prefix, self.seed = model, init, prefix, seed
        self.owner: dict[int, tuple[str, torch.nn.Module, str]] = {}
        if model is not None:
            for path, module, names in shard_rt.owned_parameters(model):
                for n in names:
                    self.owner[id(module._parameters[n])] = (path, module, n)
        self.cached: tuple[str, dict[str, torch.Tensor]] | None = None
        self.used = False

    def value(self, target: str, full: torch.Tensor) -> torch.Tensor:
        self.used = True
        if self.model is None:
            raise ValueError(f"apply_tensor_parallel: {target} is on the meta device; pass "
                             f"model=<the user's model> (and init=<its per-module init, e.g. "
                             f"GPT.init_weights>) so local shards are initialised by the "
                             f"model's own code")
        user_owner, name = _get_owner(self.model, target[len(self.prefix):]
                                      if target.startswith(self.prefix) else target)
        user = getattr(user_owner, name)
        if id(user) not in self.owner:  # a buffer
            real = shard_rt.real_buffer(user_owner, name)
            if real is None:
                raise ValueError(
                    f"apply_tensor_parallel: buffer {target} is on the meta device and its value "
                    f"was computed by the model's constructor, which a meta model does not "
                    f"keep. Fix: build the model under autopar.runtime.shard.meta_init() "
                    f"(parameters stay meta, buffers are computed for real), or give it real "
                    f"buffers")
            return real
        path, module, n = self.owner[id(user)]
        if self.cached is None or self.cached[0] != path:
            self.cached = (path, shard_rt.init_module_full(module, path, self.seed, self.init))
        return self.cached[1][n]


def _replace_everywhere(gm: torch.nn.Module, old: torch.Tensor, new: torch.Tensor) -> None:
    for module in gm.modules():
        for key, p in list(module._parameters.items()):
            if p is old:
                module._parameters[key] = new
        for key, b in list(module._buffers.items()):
            if b is old:
                module._buffers[key] = new
        for key, v in list(vars(module).items()):
            if v is old and key not in ("_parameters", "_buffers"):
                setattr(module, key, new)


class _Rewriter:
    """Inserts the collectives on layout-changing edges and makes shape constants local."""

    def __init__(self, gm: fx.GraphModule, t: int, seed: int):
        self.gm, self.graph, self.t, self.seed = gm, gm.graph, t, seed
        self.grad = nodes_requiring_grad(gm)
        self.cache: dict[tuple, fx.Node] = {}
        self.made: set[fx.Node] = set()
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a plain attribute, not a parameter: lint accepts it
            self.group = self.graph.get_attr("tp_group")
        self.group.meta[K.TP_LAYOUT] = Replicate()
        self.by_name = {n.name: n for n in self.graph.nodes}
        self.noise: dict[str, fx.Node] = {}   # dropout of a biased Partial -> its noise
        self.streams: fx.Node | None = None   # get_attr `tp_rng`, made at the first dropout

    def _streams(self) -> fx.Node:
        """The get_attr node of the program's DropoutStreams (gm.tp_rng), next to tp_group."""
        if self.streams is None:
            with self.graph.inserting_after(self.group), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a plain attribute, as tp_group
                self.streams = self.graph.get_attr("tp_rng")
            self.streams.meta[K.TP_LAYOUT] = Replicate()
            self.made.add(self.streams)
        return self.streams

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node is self.group or node in self.made:
                continue
            self._convert_inputs(node)
            self._rewrite(node)
        for node in self.graph.nodes:
            _localize_val(node, self.t)

    # -- edges --

    def _call(self, fn: Any, args: tuple, lay: Any, before: fx.Node, grad: bool,
              val_like: fx.Node) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(fn, args)
        node.meta[K.TP_LAYOUT] = lay
        node.meta[K.VAL] = val_like.meta.get(K.VAL)
        node.meta[K.STACK_TRACE] = val_like.meta.get(K.STACK_TRACE)
        node.meta[K.NN_MODULE_STACK] = val_like.meta.get(K.NN_MODULE_STACK, {})
        if K.CP_SEQ_DIM in val_like.meta:   # the context split's layout: its input's tokens
            node.meta[K.CP_SEQ_DIM] = val_like.meta[K.CP_SEQ_DIM]
        self.made.add(node)
        if grad:
            self.grad.add(node)
        return node

    def _convert_inputs(self, node: fx.Node) -> None:
        out_split = is_split(node.meta.get(K.TP_LAYOUT))
        if node.meta.get(K.TP_ROLE) == "row":
            self._drop_bias(node)  # added once after the reduction, not here
        converted = set()
        for name, want in node.meta.get(K.TP_CONVERT, {}).items():
            arg = self.by_name[name]
            new = self._conversion(arg, want, out_split, node)
            node.replace_input_with(arg, new)
            converted.add(new)
        if not out_split or node.meta.get(K.TP_ROLE) == "vocab_ce":
            return
        for arg in list(node.all_input_nodes):
            if arg in converted or arg is self.group or arg not in self.grad:
                continue
            lay = arg.meta.get(K.TP_LAYOUT)
            if isinstance(lay, Replicate) and S.is_tensor(arg):
                node.replace_input_with(arg, self._f(arg, node))
            elif isinstance(lay, Shard) and lay.whole and arg.op == "get_attr":
                node.replace_input_with(arg, self._f_parts(arg, lay, node))

    def _f_parts(self, arg: fx.Node, lay: Shard, before: fx.Node) -> fx.Node:
        """A mixed weight (or bias): the rows of its whole blocks read the same on every rank
        but each rank's gradient of them is a summand (only its query heads read k/v), so
        they are all-reduced in backward; the split rows are this rank's own."""
        key = ("f_parts", arg)
        if key not in self.cache:
            split = shard_rt.ParamSplit(lay.dim, lay.blocks, lay.padded, lay.whole)
            self.cache[key] = self._call(C.copy_to_tp_parts,
                                         (arg, self.group, lay.dim, split.whole_ranges(self.t)),
                                         lay, before, True, arg)
        return self.cache[key]

    def _f(self, arg: fx.Node, before: fx.Node) -> fx.Node:
        key = ("f", arg)
        if key not in self.cache:
            self.cache[key] = self._call(C.copy_to_tp, (arg, self.group), Replicate(), before,
                                         True, arg)
        return self.cache[key]

    def _conversion(self, arg: fx.Node, want: Any, out_split: bool, before: fx.Node) -> fx.Node:
        have = arg.meta[K.TP_LAYOUT]
        grad = arg in self.grad
        key = ("conv", arg, repr(want), out_split and grad)
        if key in self.cache:
            return self.cache[key]
        g = self.group
        if isinstance(have, Partial):
            x = self._reduced(arg, have, want, before, grad)
            if isinstance(want, Shard) and not want.seq:
                x = self._slice(x, want, before, grad)
            elif isinstance(want, Replicate) and out_split and grad:
                x = self._f(x, before)
        elif isinstance(have, Replicate):
            x = self._slice(arg, want, before, grad)
        elif isinstance(have, Whole):   # a plain slice: the gradient stays this rank's summand
            x = self._call(shard_rt.local_blocks, (arg, g, want.dim, list(want.blocks),
                                                   want.padded, want.whole),
                           want, before, grad, arg)
        else:  # a Shard gathered back (sequence parallel, or a reported fallback)
            simple = len(have.blocks) == 1 and not have.padded
            fn = C.all_gather_sp if (out_split and grad) else C.gather_from_sp
            x = self._call(fn, (arg, g, have.dim), Replicate(), before, grad, arg)
            if not simple:
                x = self._call(shard_rt.unshuffle_blocks,
                               (x, g, have.dim, list(have.blocks), have.padded),
                               Replicate(), before, grad, arg)
            if isinstance(want, Shard):
                x = self._slice(x, want, before, grad)
        self.cache[key] = x
        return x

    def _reduced(self, arg: fx.Node, have: Partial, want: Any, before: fx.Node,
                 grad: bool) -> fx.Node:
        """The sum of a Partial `arg` (+ its bias), all-reduced (or reduce-scattered along the
        sequence) once and shared by every consumer: a post-norm block reads the embedding
        both in its column-parallel input and in its residual add."""
        seq = isinstance(want, Shard) and want.seq
        key = ("reduced", arg, seq)
        if key in self.cache:
            return self.cache[key]
        g = self.group
        if seq:
            x = arg
            if len(want.blocks) > 1 or want.padded:
                # per-row blocks ((T,) · B on a (B·T, C) dim): the reduce-scatter hands rank r
                # the r-th contiguous 1/t, so the rows go rank-major first (a (B·T, C) residual
                # under SP, OPT's, holds each row's T/t tokens, not whole rows of the batch)
                x = self._call(shard_rt.shuffle_blocks,
                               (arg, g, want.dim, list(want.blocks), want.padded),
                               Partial(), before, grad, arg)   # the summands, reordered
            x = self._call(C.reduce_scatter_to_sp, (x, g, want.dim), want, before, grad, arg)
        else:
            x = self._call(C.reduce_from_tp, (arg, g), Replicate(), before, grad, arg)
        for name in have.biases:
            bias = self.by_name[name]
            if seq and bias in self.grad:
                bias = self._f(bias, before)
            x = self._call(aten.add.Tensor, (x, bias), x.meta[K.TP_LAYOUT], before, grad, arg)
        for name, drop in have.masked:
            # bias·noise: replicated, full shape (every rank computes all of it, so its
            # gradient is whole on every rank); under SP each rank adds its sequence slice
            bias = self.by_name[name]
            masked = self._call(aten.mul.Tensor, (bias, self.noise[drop]), Replicate(), before,
                                grad or bias in self.grad, arg)
            if seq:   # this rank's rows of it, per-row blocks included
                masked = self._slice(masked, want, before, masked in self.grad)
            x = self._call(aten.add.Tensor, (x, masked), x.meta[K.TP_LAYOUT], before, grad, arg)
        self.cache[key] = x
        return x

    def _masking_dropout(self, node: fx.Node) -> None:
        """dropout(Σa + b) of a biased Partial: draw the noise as the single device does
        (aten.dropout of ones: the same Bernoulli draw of the same shape on the replicated
        stream, scaled by 1/(1-p)), multiply each summand by it here and keep it for the
        bias·noise added after the reduction (_reduced)."""
        x, *rest = node.args
        ones = self._call(aten.ones_like.default, (x,), Replicate(), node, False, x)
        self.noise[node.name] = self._call(aten.dropout.default, (ones, *rest), Replicate(),
                                           node, False, x)
        node.target = aten.mul.Tensor
        node.args, node.kwargs = (x, self.noise[node.name]), {}

    def _slice(self, x: fx.Node, want: Shard, before: fx.Node, grad: bool) -> fx.Node:
        if len(want.blocks) == 1 and not want.padded and grad:
            return self._call(C.scatter_to_sp, (x, self.group, want.dim), want, before, grad, x)
        if grad:
            x = self._f(x, before)
        return self._call(shard_rt.local_blocks,
                          (x, self.group, want.dim, list(want.blocks), want.padded),
                          want, before, grad, x)

    # -- ops --

    def _rewrite(self, node: fx.Node) -> None:
        role = node.meta.get(K.TP_ROLE)
        op = packet(node)
        if role == "vocab_embedding":
            w, ids = node.args[0], node.args[1]
            pad = node.args[2] if len(node.args) > 2 else -1
            node.target = shard_rt.vocab_parallel_embedding
            node.args, node.kwargs = (w, ids, self.group, pad), {}
        elif role == "vocab_ce":
            self._vocab_ce(node)
        elif role == "split_norm":
            self._split_norm(node)
        elif role == "partial_mean":
            dims, keep = S.reduce_dims(node)
            node.target = shard_rt.partial_mean
            node.args = (node.args[0], self.group, dims, keep, node.kwargs.get("dtype"))
            node.kwargs = {}
        elif op in S.SIZE_ARG_OPS:
            self._local_sizes(node)
        elif op in S.SPLIT_OPS:
            self._local_split(node)
        elif op in (aten.slice, aten.narrow, aten.index):
            self._local_select(node)
        elif op is aten.unflatten:
            lay = node.meta[K.TP_LAYOUT]
            if isinstance(lay, Shard):
                sizes = list(_local_shape(shape(node), lay, self.t))
                dim = S.norm_dim(node.args[1], len(shape(node.args[0])))
                node.args = (node.args[0], node.args[1],
                             sizes[dim:dim + len(node.args[2])])
        elif op is aten.scaled_dot_product_attention and _sdpa_dropout(node) \
                and isinstance(node.meta.get(K.TP_LAYOUT), (Shard, Partial)):
            q, k, v, *rest = node.args
            node.target = shard_rt.tp_sdpa
            node.args = (q, k, v, self._streams(), self.seed, *rest)
        elif op is aten.dropout and _masks_biases(node):
            self._masking_dropout(node)
        elif op is aten.dropout and isinstance(node.meta.get(K.TP_LAYOUT), Shard):
            # (a Partial keeps the replicated stream: one mask for every summand is the mask
            # of their sum)
            x, p, train = node.args
            node.target = shard_rt.tp_dropout
            node.args, node.kwargs = (x, p, train, self._streams(), self.seed), {}
        elif op is aten.repeat_interleave and "output_size" in node.kwargs:
            lay = node.meta[K.TP_LAYOUT]
            if isinstance(lay, Shard):
                kw = dict(node.kwargs)
                kw["output_size"] = lay.local(self.t)
                node.kwargs = kw

    def _split_norm(self, node: fx.Node) -> None:
        """layer_norm(x, [H], w, b, eps) / rms_norm(x, [H], w, eps) over the split last dim →
        shard.tp_norm with the global size H."""
        rms = S.packet(node) is aten.rms_norm
        a = list(node.args) + [None] * 5
        weight = a[2] if a[2] is not None else node.kwargs.get("weight")
        bias = None if rms else (a[3] if a[3] is not None else node.kwargs.get("bias"))
        eps = (a[3] if rms else a[4])
        eps = node.kwargs.get("eps") if eps is None else eps
        if eps is None:   # aten's defaults: layer_norm 1e-5, rms_norm the dtype's epsilon
            eps = torch.finfo(node.meta[K.VAL].dtype).eps if rms else 1e-5
        node.target = shard_rt.tp_norm
        node.args = (node.args[0], self.group, int(node.args[1][0]), weight, bias, eps, rms)
        node.kwargs = {}

    def _drop_bias(self, node: fx.Node) -> None:
        op = packet(node)
        if op is aten.linear and (len(node.args) > 2 or "bias" in node.kwargs):
            node.args, node.kwargs = tuple(node.args[:2]), {}
        elif op is aten.addmm:
            node.target = aten.mm.default
            node.args, node.kwargs = (node.args[1], node.args[2]), {}

    def _vocab_ce(self, node: fx.Node) -> None:
        logits, target = node.args[0], node.args[1]
        if packet(node) in S.NLL_OPS:  # nll_loss(log_softmax(x)) = cross_entropy(x)
            log_softmax, logits = logits, logits.args[0]
            node.replace_input_with(log_softmax, logits)
            if not log_softmax.users:
                self.graph.erase_node(log_softmax)
        a = list(node.args) + [None] * (6 - len(node.args))
        reduction = a[3] if a[3] is not None else node.kwargs.get("reduction", 1)
        ignore = a[4] if a[4] is not None else node.kwargs.get("ignore_index", -100)
        vocab = _orig_size(logits, 1)
        node.target = shard_rt.vocab_parallel_cross_entropy
        node.args, node.kwargs = (logits, target, self.group, vocab, ignore, reduction), {}

    def _local_sizes(self, node: fx.Node) -> None:
        lay = node.meta[K.TP_LAYOUT]
        if not isinstance(lay, Shard):
            return
        local = _local_shape(shape(node), lay, self.t)
        sizes = node.args[1]
        new = [s if (isinstance(s, int) and s == -1) else local[i] for i, s in enumerate(sizes)]
        node.args = (node.args[0], new) + tuple(node.args[2:])

    def _local_select(self, node: fx.Node) -> None:
        """A slice / index picking whole blocks of the split dim (sharding._select_blocks)
        becomes a narrow at this rank's local offsets."""
        src = node.args[0]
        lay = src.meta.get(K.TP_LAYOUT)
        if not isinstance(lay, Shard) or lay.padded or shape(node) == shape(src):
            return
        op = packet(node)
        if op is aten.index:
            dims = [i for i, ix in enumerate(node.args[1]) if ix is not None]
            dim = dims[0] if len(dims) == 1 else None
        else:
            dim = S.norm_dim(node.args[1], len(shape(src)))
        sel = S.selected_range(self.gm, node) if dim == lay.dim else None
        if sel is None:
            return
        local = [b if w else b // self.t for b, w in zip(lay.blocks, lay.flags())]
        bounds = list(itertools.accumulate(lay.blocks, initial=0))
        first, last = bounds.index(sel[0]), bounds.index(sel[1])
        index = node.args[1][dim] if op is aten.index else None
        node.target = aten.narrow.default
        node.args, node.kwargs = (src, dim, sum(local[:first]), sum(local[first:last])), {}
        if index is not None and not index.users:
            self.graph.erase_node(index)

    def _local_split(self, node: fx.Node) -> None:
        src = node.args[0]
        lay = src.meta[K.TP_LAYOUT]
        if not isinstance(lay, Shard) or packet(node) is aten.unbind:
            return
        nd = len(shape(src))
        dim = S.norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
        if dim != lay.dim:
            return
        pieces = node.meta[K.TP_LAYOUT]
        sizes = [p.local(self.t) if isinstance(p, Shard) else int(v.shape[dim])
                 for p, v in zip(pieces, node.meta[K.VAL])]   # Whole pieces keep their size
        node.target = aten.split_with_sizes.default
        node.args, node.kwargs = (src, sizes, dim), {}


def _masks_biases(node: fx.Node) -> bool:
    """A dropout of a biased Partial (Partial.masked names it)."""
    lay = node.meta.get(K.TP_LAYOUT)
    return isinstance(lay, Partial) and any(d == node.name for _, d in lay.masked)


def _sdpa_dropout(node: fx.Node) -> bool:
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return not (isinstance(p, (int, float)) and p == 0)


def _orig_size(node: fx.Node, dim: int) -> int:
    return int(node.meta[K.TP_GLOBAL_VAL].shape[dim]) if K.TP_GLOBAL_VAL in node.meta \
        else shape(node)[dim]


def _per_rank_dropout(n: fx.Node) -> bool:
    """Dropout on a per-rank RNG stream: on a split (not partial) value, or attention's."""
    if n.target in (shard_rt.tp_dropout, shard_rt.tp_sdpa):
        return True
    lay = n.meta.get(K.TP_LAYOUT)
    if packet(n) is aten.dropout:
        return not S.dropout_is_identity(n) and isinstance(lay, Shard)
    return (packet(n) is aten.scaled_dot_product_attention
            and isinstance(lay, (Shard, Partial)) and _sdpa_dropout(n))


def _local_shape(global_shape: tuple[int, ...], lay: Any, t: int) -> tuple[int, ...]:
    if not isinstance(lay, Shard):
        return tuple(global_shape)
    out = list(global_shape)
    out[lay.dim] = lay.local(t)
    return tuple(out)


def _localize_val(node: fx.Node, t: int) -> None:
    """meta[K.VAL] becomes the local shape (a meta tensor); the global one is kept in
    meta[K.TP_GLOBAL_VAL]."""
    val, lay = node.meta.get(K.VAL), node.meta.get(K.TP_LAYOUT)
    if K.TP_GLOBAL_VAL in node.meta:
        return
    if isinstance(val, torch.Tensor) and isinstance(lay, Shard):
        node.meta[K.TP_GLOBAL_VAL] = val
        node.meta[K.VAL] = torch.empty(_local_shape(tuple(val.shape), lay, t), dtype=val.dtype,
                                       device="meta")
    elif isinstance(val, (tuple, list)) and isinstance(lay, tuple):
        node.meta[K.TP_GLOBAL_VAL] = val
        node.meta[K.VAL] = type(val)(
            torch.empty(_local_shape(tuple(v.shape), l, t), dtype=v.dtype, device="meta")
            if isinstance(v, torch.Tensor) else v for v, l in zip(val, lay))


def nodes_requiring_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on a trainable parameter (floating point, grad enabled)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        val = node.meta.get(K.VAL)
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        if node.op == "get_attr":
            owner, name = _get_owner(gm, node.target)
            p = getattr(owner, name, None)
            if isinstance(p, torch.nn.Parameter) and p.requires_grad:
                out.add(node)
        elif node.op == "call_function":
            if "set_grad_enabled" in str(node.target) and node.args and node.args[0] is False:
                continue
            if node.target is operator.getitem and node.args[0] in out:
                if floating:
                    out.add(node)
                continue
            if (floating or isinstance(val, (tuple, list))) and \
                    any(a in out for a in node.all_input_nodes):
                out.add(node)
    return out


# ----- gathering the full state dict ------------------------------------------------------------

def param_splits(gm: fx.GraphModule) -> dict[str, tuple[shard_rt.ParamSplit, int]]:
    """get_attr target -> (ParamSplit, full size along its dim) of every parameter the
    tensor-parallel pass split in `gm` (a rewritten graph, or a chunk of one)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and K.TP_PARAM in node.meta:
            split = node.meta[K.TP_PARAM]
            full = node.meta.get(K.TP_GLOBAL_VAL, node.meta[K.VAL])
            out[node.target] = (split, int(full.shape[split.dim]))
    return out


def gather_full_state_dict(gm: fx.GraphModule, group: Any = None,
                           prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The single-device state dict (the user's keys: `prefix` stripped, vocab padding dropped)
    from every tensor rank's shards. Collective: every rank of `group` must call it; every rank
    gets the result. Tied parameters appear under all their names, as in model.state_dict()."""
    group = group if group is not None else getattr(gm, "tp_group", None)
    info: TPInfo | None = gm.meta.get(K.TP_INFO)
    t = C.group_size(group) if not isinstance(group, shard_rt.UnboundGroup) else group.t
    split_of = {id(getattr(*_get_owner(gm, target))): split
                for target, split in param_splits(gm).items()}
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for key, value in gm.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor) or key.startswith("_guards"):
            continue
        if id(value) not in done:
            local = value.detach()
            if id(value) in split_of and t > 1 and info is not None:
                split, full_size = split_of[id(value)]
                done[id(value)] = shard_rt.gather_unshard(local, split, full_size, group)
            else:
                done[id(value)] = local.clone()
        out[key[len(prefix):] if key.startswith(prefix) else key] = done[id(value)]
    return out


# ----- reporting ----------------------------------------------------------------------------------

def tp_report(plan: Any, gm: fx.GraphModule) -> list[str]:
    """Lines for plan.explain(): what the tensor-parallel pass decided for `gm` under `plan`
    (its t and sequence_parallel; a bare int t works too) — counts of split matmuls, every
    candidate kept replicated and why (with the user's source line), inserted gathers, the
    logits / loss decisions, vocab padding and dropout streams. Runs propagate_sharding
    (analysis only, non-strict) when gm has no decision for this t yet."""
    t = getattr(plan, "t", plan)
    sp = bool(getattr(plan, "sequence_parallel", False))
    if not isinstance(t, int) or t <= 1:
        return ["tensor parallel: off (t=1)"]
    info = gm.meta.get(K.TP_INFO)
    if info is None or info.t != t or info.sequence_parallel != sp:
        propagate_sharding(gm, t, sequence_parallel=sp, strict=False)
        info = gm.meta[K.TP_INFO]
    lines = info.summary().splitlines()
    padded = sorted({(k, s.padded) for k, s in info.params.items() if s.padded})
    lines += [f"  vocab padded: {k} to {p} rows (invisible in loss and state dict)"
              for k, p in padded]
    roles = [n.meta.get(K.TP_ROLE) for n in gm.graph.nodes]
    split_dropout = sum(1 for n in gm.graph.nodes if _per_rank_dropout(n))
    if split_dropout:
        lines.append(f"  dropout: {split_dropout} in split regions on per-rank RNG streams; "
                     f"replicated regions share the default stream")
    if "vocab_ce" not in roles:
        lines.append("  loss: no vocab-parallel cross-entropy (none recognised, or replicated: "
                     "see above)")
    return lines
