"""Price the tensor-parallel pass's decisions: per-t corrections of the structural profile.

`profile_from_graph` classifies each GEMM by Megatron's structural rule (`Gemm.tp_split`) and the
cost model divides the work, parameters and activations of every split GEMM by t. The pass
(`propagate_sharding`) decides per t what really is split: where a split cannot continue (k/v
projections when t exceeds the key/value heads, an op with no split rule, logits returned without
a loss below the machine balance) it keeps the GEMMs replicated and inserts the collectives that
connect replicated and split values. `tp_corrections` runs the pass for each candidate t (and
sequence-parallel mode) on the planning graph and states the difference per region as a
`TPCorrection` (cost/profile.py), which `cost/model.py` prices:

  - replicated GEMMs: the region GEMMs the profile splits (n / k / batch) whose node the pass
    leaves unsplit (layout neither Shard nor Partial);
  - partly split GEMMs: the output columns of the whole blocks (`whole_columns`), computed on
    every rank;
  - parameters: the region's parameters the profile counts as split and the pass does not split,
    and the whole blocks of those it splits in part (multi-query k/v rows of a fused projection);
  - activations / non-GEMM bytes: saved tensors and elementwise traffic the profile counts as
    split, on the values downstream of a replicated GEMM that stay replicated ("affected" below:
    the forward closure of the replicated GEMMs through non-GEMM ops with unsplit layouts, inside
    the region), and the values held whole in a split region (layout Whole: k/v of multi-query
    attention, computed on every rank);
  - all-reduces removed: a row-parallel GEMM kept replicated does not all-reduce its output (nor
    its column partner's input gradient); two partial sums added before their reduction
    (parallel attention + MLP branches) are reduced once; a vocabulary embedding that is not
    vocab-parallel does not all-reduce the lookup; a head whose vocab GEMMs are all replicated
    needs no all-reduce of its input gradient;
  - extra collectives, mirroring the rewrite (`apply_tensor_parallel`'s `_Rewriter`) edge by
    edge on `meta[K.TP_CONVERT]`: a split value gathered to replicated (all-gather forward; its
    backward is a reduce-scatter when the consumer is split and the value needs a gradient, else
    a local slice) unless it is the structural sequence-parallel gather into a column-parallel
    GEMM; a replicated value of the affected set sliced into a split consumer (free forward; the
    gradient is all-gathered backward, or all-reduced through `copy_to_tp` for multi-block
    slices); a replicated affected value read by a split op without a slice (`copy_to_tp`:
    all-reduce of its gradient). Each is priced at the value's global size per sequence.
    Partial → replicated / sequence-sharded edges are the structural all-reduces (reduce-scatters
    under SP) that RegionProfile.tp_allreduce_elems already counts, except a mean over the split
    dim (role partial_mean, e.g. OLMo-2's RMSNorm over all q heads): its statistic is all-reduced
    forward, and the replicated values computed from it all-reduce their gradient where they
    scale split values.

Block 0 stands for every block, as in the profile. The pass writes only meta (node meta
TP_LAYOUT / TP_CONVERT / TP_ROLE / TP_PARAM and gm.meta[TP_INFO]); running it for another t
overwrites all of it, and `apply_tensor_parallel` / `tp_report` re-run it when gm.meta[K.TP_INFO] is
for a different t or mode, so analysing several t on the planning graph is safe.

Requires: the Captured / LayerStructure that `profile_from_graph` profiled (it writes the
  GEMM_IDX / OTHER / SAVED node meta and gm.meta[PARAMS]
  read here).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import torch
import torch.fx as fx

from autopar.cost.profile import ModelProfile, TPCollective, TPCorrection, TPRegionFallback
from autopar.passes import meta as K
from autopar.passes.activation_meter import batch_dependent
from autopar.passes.capture import Captured
from autopar.passes.fusion import VIEW_OPS
from autopar.passes.graph_profile import param_identity
from autopar.passes.layers import LayerStructure
from autopar.passes.sharding import (Partial, Replicate, Shard, Whole, is_grouped_mm, is_split,
                                     is_tensor)
from autopar.passes.tensor_parallel import nodes_requiring_grad
from autopar.passes.tp_layouts import (PropagationError, lost_region_refusal,
                                       propagate_sharding, sequence_parallel_fits)

_REGIONS = ("embedding", "block", "head")
_SPLITS = ("n", "k", "batch")


def with_tp_corrections(profile: ModelProfile, captured: Captured, structure: LayerStructure,
                        ts: Iterable[int], *,
                        sequence_parallel: Iterable[bool] = (False, True)) -> ModelProfile:
    """`profile` with `tp_fallbacks` filled for every t > 1 of `ts` and every mode of
    `sequence_parallel` the pass accepts (a sequence length not divisible by t rejects SP), and
    a note per t with fallbacks (or whose propagation settles on no layout, PropagationError:
    that t is priced structurally); `tp_refused` the t's the pass refuses to build in either
    mode (`lost_region_refusal`: a split lost for divisibility), which the solver never
    offers (cost/families.py `tensor_rule`). Any other error is a bug and propagates."""
    corr, failed, refused = _analyse(captured, structure, profile, ts, sequence_parallel)
    notes = [f"tensor parallel t={c.t}{' + SP' if c.sequence_parallel else ''}: "
             f"{len(c.fallbacks)} replicated fallback(s) priced" for c in corr
             if not c.empty and not _only_weight_reductions(c)]
    notes += [f"tensor parallel t={t}{' + SP' if sp else ''}: pass analysis failed ({why}); "
              f"priced structurally" for t, sp, why in failed]
    notes += [f"tensor parallel t={t}{' + SP' if sp else ''}: not offered, the pass refuses "
              f"it ({why})" for t, sp, why in refused]
    first_why = {t: (t, why) for t, _, why in reversed(refused)}   # one reason per t
    return dataclasses.replace(profile, tp_fallbacks=corr, notes=profile.notes + tuple(notes),
                               tp_refused=profile.tp_refused + tuple(sorted(first_why.values())))


def tp_corrections(captured: Captured, structure: LayerStructure, profile: ModelProfile,
                   ts: Iterable[int], *, sequence_parallel: Iterable[bool] = (False, True)
                   ) -> tuple[TPCorrection, ...]:
    """One `TPCorrection` per analysed (t, sequence_parallel), t > 1 (empty ones included: the
    pass splits everything the profile splits). A mode the pass rejects (SP with a sequence
    length not divisible by t) or cannot settle is left out: the cost model then prices it
    with the other mode's correction at that t, or structurally."""
    return _analyse(captured, structure, profile, ts, sequence_parallel)[0]


def _analyse(captured, structure, profile, ts, sequence_parallel):
    gm = captured.gm
    facts = _Facts(captured, structure, profile)
    out, failed, refused = [], [], []
    for t in sorted({int(t) for t in ts if int(t) > 1}):
        for sp in dict.fromkeys(bool(s) for s in sequence_parallel):
            if sp and not sequence_parallel_fits(gm, t):
                continue  # the mode is not runnable at this t
            try:
                propagate_sharding(gm, t, sequence_parallel=sp, strict=False)
            except PropagationError as e:  # planning goes on, this t priced structurally
                failed.append((t, sp, f"{type(e).__name__}: {e}".splitlines()[0][:200]))
                continue
            why = lost_region_refusal(gm, gm.meta[K.TP_INFO])
            if why is not None:   # what building at this t raises: never offered
                refused.append((t, sp, why))
                continue
            out.append(_correction(facts, t, sp))
    return tuple(out), failed, tuple(refused)


class _Facts:
    """Per-graph facts shared by every t: regions, parameter identities, gradients, batch."""

    def __init__(self, captured: Captured, structure: LayerStructure, profile: ModelProfile):
        gm = captured.gm
        if K.PARAMS not in gm.meta:
            raise ValueError("tp_corrections: the graph has no profile meta; run "
                             "profile_from_graph(captured, structure) on it first")
        self.gm, self.profile, self.batch = gm, profile, captured.batch_size
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.region = {"embedding": [self.nodes[x] for x in structure.embedding_nodes],
                       "block": [self.nodes[x] for x in structure.unit_nodes],
                       "head": [self.nodes[x] for x in structure.head_nodes]}
        self.region["head"] += [n for n in gm.graph.nodes  # output gathers (logits, no loss)
                                if n.op == "output" and n not in self.region["head"]]
        self.targets: dict[int, list[str]] = {}
        for target, (pid, _) in param_identity(captured).items():
            self.targets.setdefault(pid, []).append(target)
        self.grad = nodes_requiring_grad(gm)
        self.per_batch = batch_dependent(gm)

    def elems(self, n: fx.Node) -> int:
        """Global elements of n's value for one sequence."""
        v = n.meta.get(K.VAL)
        if not isinstance(v, torch.Tensor):
            return 0
        numel = math.prod(int(d) for d in v.shape)
        return numel // self.batch if n in self.per_batch else numel


def _correction(facts: _Facts, t: int, sp: bool) -> TPCorrection:
    """The correction of the decision now in the graph's meta (gm.meta[K.TP_INFO] for t, sp)."""
    info = facts.gm.meta[K.TP_INFO]
    assert info.t == t and info.sequence_parallel == sp
    regions = {kind: _region(facts, kind, info) for kind in _REGIONS}
    return TPCorrection(t=t, sequence_parallel=sp, **regions,
                        fallbacks=tuple(f"{f.node}: {f.reason}" for f in info.fallbacks))


def _region(facts: _Facts, kind: str, info: Any) -> TPRegionFallback:
    prof = getattr(facts.profile, kind)
    nodes = facts.region[kind]
    inside = set(nodes)
    # GEMMs the profile splits and the pass computes whole
    seeds, gemm_idx = [], []
    for n in nodes:
        idx = n.meta.get(K.GEMM_IDX)
        if not idx or n.meta.get(K.GEMM_SPLIT) not in _SPLITS or is_split(n.meta.get(K.TP_LAYOUT)):
            continue
        seeds.append(n)
        gemm_idx.extend(i for i in idx if prof.gemms[i].tp_split is not None)
    affected = _closure(seeds, inside) | {n for n in nodes
                                          if isinstance(n.meta.get(K.TP_LAYOUT), Whole)}
    # all-reduces of the structural count that the pass does not do
    removed = sum(prof.gemms[i].batch * prof.gemms[i].m * prof.gemms[i].n
                  for i in gemm_idx if prof.gemms[i].tp_split == "k")
    if kind == "block":  # the structural count there is one per row-parallel GEMM
        removed += min(_merged_reductions_elems(facts, nodes),
                       max(0, prof.tp_allreduce_elems - removed))
    if kind == "embedding" and prof.tp_allreduce_elems and not any(
            n.meta.get(K.TP_ROLE) == "vocab_embedding" for n in nodes):
        removed += prof.tp_allreduce_elems
    vocab = [i for i, g in enumerate(prof.gemms) if g.tp_split == "n"]
    if kind == "head" and vocab and set(vocab) <= set(gemm_idx):
        removed += prof.input_bytes // facts.profile.activation_bytes_per_elem
    return TPRegionFallback(
        replicated_gemms=tuple(sorted(set(gemm_idx))),
        whole_columns=_whole_columns(nodes, prof),
        params_elems=_params_kept_whole(facts, kind, info),
        act_split_bytes=round(_saved_whole(facts, nodes, affected, "split")),
        act_attention_bytes=round(_saved_whole(facts, nodes, affected, "attn")),
        other_split_bytes=round(sum(n.meta.get(K.OTHER, (0, False))[0] for n in affected
                                    if n.meta.get(K.OTHER, (0, False))[1])),
        allreduce_elems_removed=removed,
        collectives=_collectives(facts, nodes, set(seeds), affected))


def _whole_columns(nodes: list, prof: Any) -> tuple[tuple[int, int], ...]:
    """(GEMM index, columns computed whole) of the column GEMMs split in part (Shard.whole)."""
    out = []
    for n in nodes:
        lay = n.meta.get(K.TP_LAYOUT)
        if n.meta.get(K.TP_ROLE) != "column" or not isinstance(lay, Shard) or not lay.whole:
            continue
        cols = sum(b for b, w in zip(lay.blocks, lay.whole) if w)
        out += [(i, cols) for i in n.meta.get(K.GEMM_IDX, ()) if prof.gemms[i].tp_split == "n"]
    return tuple(out)


def _merged_reductions_elems(facts: _Facts, nodes: list) -> int:
    """All-reduce elements the structural count has and the rewrite does not do because
    partial sums are added before their reduction (parallel attention + MLP branches: Falcon
    reduces once per block): the split row-parallel outputs produced in the region
    minus the partial values produced there that some consumer really reduces (statistics of
    a mean over the split dim, role partial_mean, are priced as extra collectives)."""
    inside = set(nodes)
    rows = sum(_row_output_elems(facts, n) for n in nodes if n.meta.get(K.TP_ROLE) == "row"
               and isinstance(n.meta.get(K.TP_LAYOUT), Partial))
    reduced = set()
    for n in facts.gm.graph.nodes:
        for name, want in n.meta.get(K.TP_CONVERT, {}).items():
            src = facts.nodes.get(name)
            if (src in inside and isinstance(src.meta.get(K.TP_LAYOUT), Partial)
                    and not isinstance(want, Partial)
                    and src.meta.get(K.TP_ROLE) != "partial_mean"):
                reduced.add(src)
    return max(0, rows - sum(facts.elems(n) for n in reduced))


def _row_output_elems(facts: _Facts, n: fx.Node) -> int:
    """Elements the structural count reduces for row product n: its output, except a grouped
    (experts') product, whose k rows per token are summed before the one reduction of s·h."""
    if not is_grouped_mm(n):
        return facts.elems(n)
    return facts.profile.seq_len * int(n.meta[K.VAL].shape[-1])


def _unsplit(n: fx.Node) -> bool:
    return not is_split(n.meta.get(K.TP_LAYOUT))


def _is_gemm(n: fx.Node) -> bool:
    return K.GEMM_IDX in n.meta or K.GEMM in n.meta


def _closure(seeds: list[fx.Node], inside: set) -> set:
    """The seeds (replicated GEMMs, or means over the split dim) and the values computed from
    them whole, up to the next GEMM or split value (inside the region)."""
    out, todo = set(seeds), list(seeds)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in out or u not in inside or u.op != "call_function" or _is_gemm(u) \
                    or not _unsplit(u):
                continue
            out.add(u)
            todo.append(u)
    return out


def _params_kept_whole(facts: _Facts, kind: str, info: Any) -> int:
    """Elements of the region's parameters the profile splits and the pass leaves whole."""
    table = facts.gm.meta[K.PARAMS].get(kind, {})
    out = 0
    for pid, (elems, split) in table.items():
        splits = [info.params[t] for t in facts.targets.get(pid, ()) if t in info.params]
        if split and not splits:
            out += elems
        elif split and splits[0].whole:     # split in part: its whole blocks stay replicated
            ps = splits[0]
            out += elems * sum(b for b, w in zip(ps.blocks, ps.whole) if w) // sum(ps.blocks)
    return out


def _view_chain(n: Any) -> list[str]:
    """n and the nodes it views, back to the value that owns the storage."""
    out = [n.name]
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in VIEW_OPS \
            and isinstance(n.args[0], fx.Node):
        n = n.args[0]
        out.append(n.name)
    return out


def _saved_whole(facts: _Facts, nodes: list, affected: set, cls: str) -> float:
    """Bytes (per sequence) the profile saved as `cls` ("split" / "attn": divided by t) that are
    values of the affected set and reach the saving node whole (not sliced on its edge), or
    temporaries an affected node makes and saves itself (e.g. a cross-entropy's log-softmax)."""
    names = {n.name for n in affected}
    total = 0.0
    for n in nodes:
        records = n.meta.get(K.SAVED)
        if not records:
            continue
        sliced = {x for a, lay in n.meta.get(K.TP_CONVERT, {}).items() if isinstance(lay, Shard)
                  for x in _view_chain(facts.nodes[a])}
        for producer, nbytes, c in records:
            if c != cls:
                continue
            if (producer in names and producer not in sliced) or (producer is None
                                                                   and n in affected):
                total += nbytes
    return total


def _only_weight_reductions(c: TPCorrection) -> bool:
    """Whether `c` holds nothing but SP's gradient all-reduces of replicated weights (what
    every SP plan runs: no fallback to note)."""
    plain = [dataclasses.replace(c.region(k), collectives=tuple(
        x for x in c.region(k).collectives if x.per_sequence)) for k in _REGIONS]
    return all(r.empty for r in plain)


def _row_bias(n: fx.Node) -> fx.Node | None:
    """The bias input of a linear / addmm node (what `_Rewriter._drop_bias` takes off a
    row-parallel GEMM), None without one."""
    op = getattr(n.target, "overloadpacket", n.target)
    if op is torch.ops.aten.linear:
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    elif op is torch.ops.aten.addmm:
        b = n.args[0]
    else:
        b = None
    return b if isinstance(b, fx.Node) else None


def _collectives(facts: _Facts, nodes: list, seeds: set, affected: set) -> tuple:
    """The collectives the rewrite inserts that the structural pricing does not count (see the
    module docstring), deduplicated like the rewrite's conversion cache."""
    out: list[TPCollective] = []
    seen: set = set()

    def add(key: tuple, kind: str, n: fx.Node, backward: bool, what: str) -> None:
        if key in seen:
            return
        seen.add(key)
        e = facts.elems(n)
        if e:
            out.append(TPCollective(kind=kind, elems=e, backward=backward, what=what,
                                    per_sequence=n in facts.per_batch))

    def slice_grad(x: fx.Node, want: Shard, key: tuple) -> None:
        # _Rewriter._slice: scatter_to_sp (gradient all-gathered) or copy_to_tp + local blocks
        if x not in facts.grad:
            return
        if len(want.blocks) == 1 and not want.padded:
            add(key + ("slice",), "all-gather", x, True, f"gradient of {x.name} (sliced)")
        else:
            add(("f", x), "all-reduce", x, True, f"gradient of {x.name} (copy_to_tp)")

    # values computed whole from an all-reduced mean over the split dim (an RMSNorm statistic
    # over all heads): where they scale split values, their gradient is all-reduced
    stats = _closure([n for n in nodes if n.meta.get(K.TP_ROLE) == "partial_mean"], set(nodes))
    for n in nodes:
        conv = n.meta.get(K.TP_CONVERT, {})
        out_split = is_split(n.meta.get(K.TP_LAYOUT))
        for a_name, want in conv.items():
            a = facts.nodes[a_name]
            have = a.meta.get(K.TP_LAYOUT)
            grad = a in facts.grad
            key = (a, repr(want), out_split and grad)
            if a.meta.get(K.TP_ROLE) == "partial_mean":
                add(key, "all-reduce", a, False, f"{a.name}: mean over the split dim")
            elif isinstance(have, Shard):
                structural = have.seq and n not in seeds and a not in affected \
                    and n.op != "output"
                if structural:
                    continue
                add(key, "all-gather", a, False, f"{a.name} gathered for {n.name}")
                if out_split and grad:
                    add(key + ("bwd",), "all-gather", a, True,
                        f"gradient of {a.name} reduce-scattered")
                if isinstance(want, Shard):
                    slice_grad(a, want, key)
            elif isinstance(have, Replicate) and isinstance(want, Shard) and a in affected:
                slice_grad(a, want, key)
        if not out_split or n.meta.get(K.TP_ROLE) == "vocab_ce":
            continue
        # _Rewriter._drop_bias: a row-parallel GEMM's bias is added after its reduction, to
        # a split value (and so copied to the group) only under sequence parallelism
        dropped = _row_bias(n) if n.meta.get(K.TP_ROLE) == "row" else None
        for a in n.all_input_nodes:  # _Rewriter._convert_inputs: copy_to_tp on whole inputs
            # (a replicated parameter a split op reads, as sequence parallelism's norms and
            # row-parallel biases: its gradient all-reduced each micro-batch, unstructural)
            param = a not in facts.per_batch
            if a is dropped and not facts.gm.meta[K.TP_INFO].sequence_parallel:
                continue
            if a.name in conv or not (a in affected or a in stats or param) \
                    or a not in facts.grad or not is_tensor(a):
                continue
            if isinstance(a.meta.get(K.TP_LAYOUT), Replicate):
                add(("f", a), "all-reduce", a, True, f"gradient of {a.name} (copy_to_tp)")
    return tuple(out)

