"""Activation recomputation (checkpointing) of a chunk graph, per the plan's recompute mode.

Modes (2205.05198, Korthikanti et al., "Reducing Activation Recomputation"):
  none       the graph is returned unchanged: every activation backward needs is kept.
  full       each transformer block's forward — the nodes labelled ("block", i) that depend on
             an activation — is outlined into a graph submodule `recompute_block_<i>` and called
             through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: forward keeps
             only the block's inputs (its residual stream; parameters are referenced, not
             copied) and backward reruns the block. Cost: one more block forward per backward.
  selective  only the attention core is checkpointed: the fused `scaled_dot_product_attention`
             call, or the unfused matmul → (scale / mask) → softmax → (dropout) → matmul chain.
             Its O(b·h·s²) activations (scores, probabilities, dropout mask) are recomputed; the
             cheap-to-store O(b·s·h) ones stay (the paper's §4.2 choice).
  op         torchtitan's per-op selective checkpointing (its `selective_ac_option = "op"`,
             torchtitan/models/llama3/infra/parallelize.py): each block is outlined as for
             full, and checkpointed under PyTorch's selective-checkpoint policy
             (torch.utils.checkpoint.create_selective_checkpoint_contexts, `op_policy`): the
             outputs of the block's 1st, 3rd, 5th... 2-D GEMM (mm / addmm / _scaled_mm, in
             execution order; a collective matmul's row pieces are one GEMM) and of the fused
             attention kernels are saved, but not its last GEMM's (the backward never reads
             it); everything else — every 2nd GEMM, norms, activations, rotary, dropout, the
             unfused attention core and the collectives — is recomputed in backward.
             torchtitan also saves its functional reduce-scatter outputs; autopar's
             collectives write into buffers they allocate (c10d's in-place ops, whose results
             a policy cannot hand back), so they run again in the recomputation, but for an
             all-reduce made in place on a kept output, which is kept with it (op_policy).
             Not with interleaved-zb (autopar/rules.py recompute_refusal).

RNG: checkpoint(preserve_rng_state=True) snapshots the default generator when the block runs
forward and replays it during recomputation, so dropout masks are identical. Tensor-parallel
dropout (autopar.runtime.shard.tp_dropout / tp_sdpa) draws from the program's per-rank
DropoutStreams (the graph attribute `tp_rng`), which the default snapshot does not cover; a
region that contains it calls `checkpoint_tp_rng(streams, fn, *args)`, which passes the
streams' `recompute_context` as checkpoint's context_fn to replay them the same way (a named
function taking the streams as an argument: the generated chunk source must be able to spell
the call).

`apply_recompute(gm, mode) -> gm`; `recompute_pass(mode)` is the same as a pass-list entry (run
per chunk, after passes.pipeline.split_chunks).
Requires: node.meta[REGION] on the compute nodes (passes/layers.py; kept by
  passes/pipeline.split_chunks and passes/tensor_parallel); node.meta[VAL] on values; a block's
  activation nodes are contiguous in graph order (no outside node consumes a block value before
  the block's last node) — true of captured graphs, checked.
Guarantees: the same forward values and gradients as the input graph (bit-identical for the
  same RNG state); parameters and other get_attr nodes stay in the outer graph and are passed to
  the checkpointed submodule as arguments, so the module's attributes are unchanged (the runtime
  attaches parameters as before and codegen emits the submodule as a nested class); gm is
  modified in place and returned.
Reads node.meta (keys of passes/meta.py): REGION, VAL, STACK_TRACE (in errors). Writes: REGION
  and VAL on the new get_attr / checkpoint / getitem nodes (the region of the nodes they
  replace); gm.meta[RECOMPUTE] = {"mode": mode, "regions": [submodule names]}.
"""
from __future__ import annotations

import contextlib
import inspect
import operator
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.passes import meta as K
from autopar.passes.manager import Pass, run_passes
from autopar.rules import RECOMPUTE
from autopar.runtime.context_shard import context_causal_attention
from autopar.runtime.shard import DropoutStreams, tp_dropout, tp_sdpa

MODES = RECOMPUTE

_aten = torch.ops.aten
_SDPA = {_aten.scaled_dot_product_attention.default,
         _aten._scaled_dot_product_flash_attention_for_cpu.default,
         _aten._scaled_dot_product_efficient_attention.default,
         _aten._scaled_dot_product_flash_attention.default,
         torch.nn.functional.scaled_dot_product_attention,
         tp_sdpa}   # split heads with attention dropout (the tensor-parallel rewrite)
_MATMUL = {_aten.matmul.default, _aten.bmm.default, _aten.baddbmm.default, _aten.mm.default,
           torch.matmul, torch.bmm, operator.matmul}
_SOFTMAX = {_aten._softmax.default, _aten.softmax.int, _aten._safe_softmax.default,
            torch.softmax, torch.nn.functional.softmax}


def recompute_pass(mode: str) -> Pass:
    """The pass checkpointing a chunk's blocks ('full', 'op') or attention cores
    ('selective')."""
    if mode not in MODES:
        raise ValueError(f"apply_recompute: mode={mode!r} is not one of {MODES}; use "
                         f"'none' (keep activations), 'selective' (recompute the attention "
                         f"core), 'op' (keep every other GEMM's output) or 'full' (recompute "
                         f"whole blocks)")
    return Pass(f"recompute[{mode}]", partial(_checkpoint_regions, mode=mode),
                reads=(K.REGION, K.VAL), writes=(K.REGION, K.VAL, K.RECOMPUTE))


def apply_recompute(gm: torch.fx.GraphModule, mode: str) -> torch.fx.GraphModule:
    """Checkpoint `gm`'s blocks ('full') or attention cores ('selective'); see module doc.
    Linted and recompiled (passes.manager.run_passes)."""
    return run_passes(gm, [recompute_pass(mode)])


def _checkpoint_regions(gm: torch.fx.GraphModule, mode: str) -> torch.fx.GraphModule:
    names: list[str] = []
    if mode in ("full", "op"):
        for i, nodes in _blocks(gm).items():
            names.append(_outline(gm, nodes, f"recompute_block_{i}", ("block", i),
                                  per_op=mode == "op"))
    elif mode == "selective":
        for k, (region, nodes) in enumerate(_attention_cores(gm)):
            tag = f"{region[1]}" if region and region[1] is not None else f"{k}"
            name = f"recompute_attention_{tag}"
            while hasattr(gm, name):
                name += "_"
            names.append(_outline(gm, nodes, name, region))
    gm.meta[K.RECOMPUTE] = {"mode": mode, "regions": names}
    return gm


# ---- region discovery ---------------------------------------------------------------------
def _activation_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes that depend on a placeholder (an activation, input or target). The rest (get_attr,
    rotary tables, masks and position ids built from buffers/constants) stay outside regions."""
    dep: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or (n.op not in ("get_attr", "output")
                                     and any(i in dep for i in n.all_input_nodes)):
            dep.add(n)
    return dep


def _blocks(gm: torch.fx.GraphModule) -> dict[int, list[torch.fx.Node]]:
    act = _activation_nodes(gm)
    out: dict[int, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        region = n.meta.get(K.REGION)
        if (n in act and n.op == "call_function" and isinstance(region, tuple)
                and region[0] == "block"):
            out.setdefault(region[1], []).append(n)
    return out


def _target_in(n: torch.fx.Node, targets: set) -> bool:
    if n.op != "call_function":
        return False
    try:
        return n.target in targets
    except TypeError:  # unhashable target
        return False


def _attention_cores(gm: torch.fx.GraphModule) -> list[tuple[Any, list[torch.fx.Node]]]:
    """(region, nodes) of every attention core, in graph order."""
    act = _activation_nodes(gm)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    cores: list[tuple[Any, list[torch.fx.Node]]] = []
    for n in gm.graph.nodes:
        if n not in act:
            continue
        if _target_in(n, _SDPA):
            nodes = [n] + [u for u in n.users if u.target is operator.getitem]
            cores.append((n.meta.get(K.REGION), nodes))
        elif _target_in(n, _SOFTMAX):
            nodes = _unfused_core(n, act, order)
            if nodes:
                cores.append((n.meta.get(K.REGION), nodes))
    return cores


def _unfused_core(softmax: torch.fx.Node, act: set, order: dict,
                  max_hops: int = 8) -> list[torch.fx.Node] | None:
    """The nodes between the scores matmul (q·kᵀ) feeding `softmax` and the matmul its
    probabilities feed (·v), following activation edges only; None when either is missing."""
    first = _walk(softmax, lambda n: [i for i in n.all_input_nodes if i in act], max_hops)
    last = _walk(softmax, lambda n: [u for u in n.users if u in act], max_hops)
    if first is None or last is None:
        return None
    down = _reach(first, lambda n: [u for u in n.users if u in act and order[u] <= order[last]])
    up = _reach(last, lambda n: [i for i in n.all_input_nodes if i in act])
    nodes = sorted(down & up, key=order.__getitem__)
    if any(n.op != "call_function" for n in nodes):
        return None
    return nodes


def _walk(start: torch.fx.Node, step: Callable, max_hops: int) -> torch.fx.Node | None:
    """Breadth-first from `start` along `step` to the nearest matmul within max_hops."""
    frontier, seen = [start], {start}
    for _ in range(max_hops):
        nxt = []
        for n in frontier:
            for m in step(n):
                if _target_in(m, _MATMUL):
                    return m
                if m not in seen and m.op == "call_function":
                    seen.add(m)
                    nxt.append(m)
        frontier = nxt
    return None


def _reach(start: torch.fx.Node, step: Callable) -> set[torch.fx.Node]:
    seen, stack = {start}, [start]
    while stack:
        for m in step(stack.pop()):
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


# ---- outlining -------------------------------------------------------------------------
def _outline(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], name: str,
             region: Any, per_op: bool = False) -> str:
    """Replace `nodes` (graph order) by `checkpoint(self.<name>, *inputs)`; return name.
    per_op: through `checkpoint_ops` (the 'op' mode's policy)."""
    nodes = _absorb(gm, nodes)
    inside = set(nodes)
    inputs: list[torch.fx.Node] = []
    for n in nodes:
        for i in n.all_input_nodes:
            if i not in inside and i not in inputs:
                inputs.append(i)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    last = nodes[-1]
    _check_contiguous(gm, inside, last, name)

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in inputs:
        env[i] = sub.placeholder(i.name)
        env[i].meta = dict(i.meta)
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
        env[n].meta = dict(n.meta)
    sub.output(tuple(env[o] for o in outputs))
    sub.lint()
    gm.add_submodule(name, torch.fx.GraphModule(torch.nn.Module(), sub,
                                                class_name=name.title().replace("_", "")))

    # a function object cannot be written into the generated source as a keyword value, so a
    # region with tensor-parallel dropout calls checkpoint through a named wrapper instead,
    # handing it the program's dropout streams (a graph input of the region) to replay
    streams = _dropout_streams(nodes)
    if per_op:
        target, lead, kwargs = checkpoint_ops, (streams, _last_weight(gm, nodes, inputs)), {}
    elif streams is not None:
        target, lead, kwargs = checkpoint_tp_rng, (streams,), {}
    else:
        target, lead, kwargs = torch.utils.checkpoint.checkpoint, (), dict(_CHECKPOINT_KWARGS)
    with gm.graph.inserting_after(last):
        fn = gm.graph.get_attr(name)
    with gm.graph.inserting_after(fn):
        call = gm.graph.call_function(target, (*lead, fn, *inputs), kwargs)
    fn.meta[K.REGION] = call.meta[K.REGION] = region
    call.meta[K.VAL] = tuple(o.meta.get(K.VAL) for o in outputs)
    prev = call
    for k, o in enumerate(outputs):
        with gm.graph.inserting_after(prev):
            item = gm.graph.call_function(operator.getitem, (call, k))
        item.meta = {K.VAL: o.meta.get(K.VAL), K.REGION: region}
        o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        prev = item
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return name


def _absorb(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Add the call_function nodes lying between the region's first and last node that consume
    a region value (e.g. export's _assert_tensor_metadata checks, dtype casts) to the region:
    their inputs are defined before them, so the region stays well ordered."""
    inside, first, last = set(nodes), nodes[0], nodes[-1]
    out, active = [], False
    for n in gm.graph.nodes:
        active = active or n is first
        if active and (n in inside or (n.op == "call_function"
                                       and any(i in inside for i in n.all_input_nodes))):
            inside.add(n)
            out.append(n)
        if n is last:
            break
    return out


def _check_contiguous(gm: torch.fx.GraphModule, inside: set, last: torch.fx.Node,
                      name: str) -> None:
    """The checkpoint call goes where the region's last node was: every outside user of a
    region value must come after it."""
    seen_last = False
    for n in gm.graph.nodes:
        if n is last:
            seen_last = True
        elif not seen_last and n not in inside and any(i in inside for i in n.all_input_nodes):
            raise ValueError(f"recompute: node {n.name} ({n.meta.get(K.STACK_TRACE, '')!s:.80}) "
                             f"uses a value of region {name} before the region ends; the region "
                             f"is not contiguous in graph order, so it cannot be checkpointed "
                             f"as one call — use recompute='none' for this model")


def _last_weight(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node],
                 inputs: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The 2-D parameter the region reads last (a get_attr input): its last GEMM's weight,
    whose output 'op' need not keep (module doc), or None."""
    def matrix(n: torch.fx.Node) -> bool:
        try:
            value = operator.attrgetter(n.target)(gm)
        except AttributeError:
            return False
        return (isinstance(value, torch.Tensor) and value.dim() == 2
                and value.is_floating_point())
    weights = {i for i in inputs if i.op == "get_attr" and matrix(i)}
    last = None
    for n in nodes:
        for i in n.all_input_nodes:
            if i in weights:
                last = i
    return last


def _dropout_streams(nodes: Iterable[torch.fx.Node]) -> torch.fx.Node | None:
    """The DropoutStreams argument (the `tp_rng` get_attr) of the region's first
    stream-drawn dropout (tp_dropout, tp_sdpa, context_causal_attention's), or None."""
    for n in nodes:
        at = _TP_DROPOUT.get(n.target)
        if at is not None and len(n.args) > at and n.args[at] is not None:
            return n.args[at]
    return None


# ---- tensor-parallel RNG replay ------------------------------------------------------------
_CHECKPOINT_KWARGS = {"use_reentrant": False, "preserve_rng_state": True}
# target -> position of its DropoutStreams argument (None: attention without dropout)
_TP_DROPOUT = {tp_dropout: 3, tp_sdpa: 3, context_causal_attention: 7}


def checkpoint_tp_rng(streams: DropoutStreams, fn: Any, *args: Any) -> Any:
    """checkpoint(fn, *args) that also replays the tensor-parallel dropout streams."""
    return torch.utils.checkpoint.checkpoint(fn, *args, **_CHECKPOINT_KWARGS,
                                             context_fn=streams.recompute_context)


# ---- per-op selective checkpointing ('op') -------------------------------------------------
# the 2-D GEMMs of linear layers as the dispatcher sees them (aten.linear decomposes to mm on
# folded rows, addmm with a bias; the FP8 pass's GEMMs are _scaled_mm): every other one saved
_LINEAR_GEMMS = {_aten.mm.default, _aten.addmm.default, _aten._scaled_mm.default}
_WEIGHT_ARG = {_aten.mm.default: 1, _aten.addmm.default: 2, _aten._scaled_mm.default: 1}
# fused attention kernels: their outputs (and logsumexp) saved, as torchtitan's save list
_ATTENTION_KERNELS = {_aten._scaled_dot_product_flash_attention.default,
                      _aten._scaled_dot_product_efficient_attention.default,
                      _aten._scaled_dot_product_cudnn_attention.default,
                      _aten._scaled_dot_product_flash_attention_for_cpu.default}


class KeptStorages(set):
    """The storages of the outputs op's policy kept so far in one region. `pending`: the
    policy decided to keep an op it saw before the op ran (a torch whose selective
    checkpoint calls the policy first: 2.11), so `_RecordKept` adds that op's outputs once
    it has run."""
    pending: bool = False


class _RecordKept(TorchDispatchMode):
    """Entered under the selective checkpoint's forward mode, it sees each op after the policy
    decided on it: the outputs of an op the policy kept go into `kept` (where the policy
    cannot read them from its context: `KeptStorages`)."""

    def __init__(self, kept: KeptStorages):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.kept.pending:
            self.kept.pending = False
            self.kept.update(_storage(t) for t in _tensors(out))
        return out


def op_policy(gemms_seen: list[int], last_weight: tuple | None = None,
              kept: KeptStorages | None = None) -> Callable:
    """The 'op' mode's selective-checkpoint policy for one checkpointed region: save the 1st,
    3rd, ... 2-D GEMM's output (gemms_seen[0] counts them; the row pieces of a collective
    matmul are one GEMM: they share its weight) and the fused attention kernels'; recompute
    the rest (torchtitan's `_custom_policy`, its mm count per region). The block's last GEMM
    (its weight at `last_weight`, a `_place`) is not kept whatever its place: its output feeds
    the residual add, which saves nothing, so the recomputation stops before it (under
    sequence parallelism a row-parallel GEMM's output is the whole partial sum: keeping it
    cost more than the layer saves without recompute). torchtitan keeps it when odd.

    A collective (c10d's in-place ops) that writes into a kept output — the all-reduce a
    row-parallel GEMM's piece gets in place — is kept too: the recomputation hands back the
    kept tensor, which already holds the reduced values, so reducing it again would double
    them; a collective writing into anything else runs again.

    Across torch versions: 2.13 calls the policy once per op, after it ran, with its output;
    2.11 calls it before the op, with no output (`kept` is then filled through `_RecordKept`:
    `_op_contexts` makes both), and again for every op it recomputes (`is_recompute`): those
    calls get the forward's decisions back in order, not a second count of the GEMMs."""
    from torch.utils.checkpoint import CheckpointPolicy
    kept = KeptStorages() if kept is None else kept
    last = [None, False]            # the previous GEMM's weight's place and decision
    # the forward's decisions per op, replayed in order while recomputing (per op, as 2.11's
    # cache keeps the saved outputs: an op the forward ran and the recomputation does not
    # shifts no other op's answers)
    decided: dict[Any, list[bool]] = {}
    replayed: dict[Any, int] = {}

    def policy(ctx, func, *args, **kwargs):
        if getattr(ctx, "is_recompute", False):
            i = replayed.get(func, 0)
            replayed[func] = i + 1
            save = decided[func][i]
        else:
            save = decide(ctx, func, args)
            decided.setdefault(func, []).append(save)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    def decide(ctx, func, args) -> bool:
        if func in _LINEAR_GEMMS:
            # the pieces of one GEMM (a row-parallel collective matmul's row pieces) share
            # its weight: one GEMM, one decision
            weight = _place(args[_WEIGHT_ARG[func]])   # a view of a flat buffer: its own
            if weight != last[0]:
                gemms_seen[0] += 1
                last[:] = weight, gemms_seen[0] % 2 == 1 and weight != last_weight
            save = last[1]
        elif func.namespace == "c10d":
            out = getattr(ctx, "op_output", None)
            save = any(_storage(t) in kept for t in _written(out, args))
        else:
            save = func in _ATTENTION_KERNELS
        if save and POLICY_SEES_OUTPUT:
            kept.update(_storage(t) for t in _tensors(ctx.op_output))
        elif save:
            kept.pending = True
        return save
    return policy


def _sac_parameters(name: str) -> frozenset[str]:
    """The parameters of torch.utils.checkpoint's `name` (empty where this torch has none)."""
    obj = getattr(torch.utils.checkpoint, name, None)
    return frozenset(inspect.signature(obj).parameters) if obj is not None else frozenset()


# torch 2.13's selective checkpoint calls the policy after the op with its output
# (SelectiveCheckpointContext.op_output); 2.11's (the GPU image's, 2026-11-27) before it
POLICY_SEES_OUTPUT = "op_output" in _sac_parameters("SelectiveCheckpointContext")


def op_mode_refusal() -> str | None:
    """Why this torch cannot run recompute 'op', or None: it needs PyTorch's selective
    checkpoint with cache-entry mutation allowed (`_op_contexts`: a kept row-parallel piece is
    reduced in place after it is kept)."""
    if "allow_cache_entry_mutation" in _sac_parameters("create_selective_checkpoint_contexts"):
        return None
    return (f"recompute='op' on torch {torch.__version__}: it needs torch.utils.checkpoint."
            f"create_selective_checkpoint_contexts(..., allow_cache_entry_mutation=True), "
            f"which this torch lacks (2.11 and 2.13 have it); install a newer torch, or plan "
            f"with recompute 'full' or 'selective'")


def _storage(t: torch.Tensor) -> int:
    """The storage's identity: its C object, which Dynamo's fake tensors have too (their
    data pointers all read 0 while torch.compile traces the policy)."""
    return t.untyped_storage()._cdata


def _place(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's elements start: its storage and offset (a weight and its transpose
    agree; the weights viewing one gathered ZeRO-3 buffer do not)."""
    return _storage(t), t.storage_offset()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _written(output: Any, args: tuple) -> list[torch.Tensor]:
    """The tensors a c10d op writes: what it returns (allreduce_, _reduce_scatter_base_, ...:
    their schemas carry no alias annotations), else its first argument (the coalesced ops'
    outputs)."""
    return _tensors(output) or _tensors(args[0] if args else ())


def _op_contexts(streams: DropoutStreams | None, last: torch.Tensor | None) -> tuple:
    """checkpoint's context_fn for 'op': the policy's (forward, recompute) contexts, each
    entered together with the dropout streams' snapshot / replay when the region has any."""
    # a kept row-parallel piece is reduced in place after it is kept (op_policy): expected
    kept = KeptStorages()
    sac = torch.utils.checkpoint.create_selective_checkpoint_contexts(
        op_policy([0], None if last is None else _place(last), kept),
        allow_cache_entry_mutation=True)
    if not POLICY_SEES_OUTPUT:      # the policy's kept outputs recorded after each op runs
        sac = (_entered(_RecordKept(kept), sac[0]), sac[1])
    if streams is None:
        return sac
    rng = streams.recompute_context()
    return tuple(_entered(a, b) for a, b in zip(sac, rng))


@contextlib.contextmanager
def _entered(*managers: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


def checkpoint_ops(streams: DropoutStreams | None, last: torch.Tensor | None, fn: Any,
                   *args: Any) -> Any:
    """checkpoint(fn, *args) under the 'op' policy (module doc), replaying the tensor-parallel
    dropout streams when given (as checkpoint_tp_rng); `last`: the region's last GEMM's
    weight (op_policy), or None."""
    return torch.utils.checkpoint.checkpoint(fn, *args, **_CHECKPOINT_KWARGS,
                                             context_fn=partial(_op_contexts, streams, last))
