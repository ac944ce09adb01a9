"""Stacks whose layers are of several kinds: dense and MoE layers, layers with and without
rotary, local and global attention whose graphs differ (issue 31).

The layer finder (passes/layers.py) groups the blocks of a stack by their graph into kinds and
gives every model layer its kind (`LayerStructure.pattern`, true counts). Each kind is profiled
on its own, as a one-kind model (passes/graph_profile.py on its first block, its tensor-parallel
fallbacks priced by passes/tp_cost.py): `LayerKind.profile`. The planner sees:

  - `mixed_profile`: the model as `num_layers` = L layers of one *mean layer*, each kind's block
    weighted by its share of the layers (GEMM batches, attention tiles, bytes, parameters,
    activations and the tensor-parallel fallbacks all scale linearly), so the solver's search
    (one per-layer slope, cost/solver.py) prices the whole stack exactly in sum: compute,
    communication, weights and activations of all L layers;
  - `stage_layers`: the solver's layers per chunk, in mean layers, cut over the model's real
    layers by cost: each layer weighs its kind's per-layer time at the plan's configuration
    (cost.model.load_costs on the kind's profile: GEMMs, attention, elementwise traffic and
    its t / c / ep collectives), and cut c falls at the layer boundary whose cumulative time
    is nearest the chunks' cumulative share of the total. So a stage of the heavier kind holds
    fewer layers, and every stage's time is the sum of its layers' kinds (`stage_times_ns`).
    The times are one context rank's at c > 1 (`kind_layer_ns` goes through the cost model's
    rank profile, as every price does);
  - `kinds_memory_slopes`: the memory rows of `config_costs` (the search's fits and CP-SAT's
    constraints, affine in a rank's mean layers) restated by the layers the cut of the even
    split gives each rank, each priced by its kind's own memory coefficients
    (cost.memory.memory_coefficients on the kind's rank profile: weights, gradients,
    optimizer states, activations per layer): a stage of MoE layers holds more than the
    mean, and p / v / recompute / ZeRO are chosen for it;
  - `kinds_rank_memory`: the same at the chosen split, exactly (the schedule's walk over the
    chunks' own activation bytes): what `predict` reports, so the plan's per-rank memory and
    the solver's walked-memory fit (cost/solver.py `_fit_walked_memory`) see the kinds.

  - `kinds_cut_ns`: the pipeline load rows of `config_costs` restated the same way, each
    rank's load its real layers' time (`LoadCosts.rank_cut_ns`: what they take beyond its mean
    layers'): the steady state is set by the heaviest stage the cut leaves, not by the mean (a
    stage of few layers of a heavy kind cannot be balanced); `predict` restates them at the
    chosen split.

Not modelled: CP-SAT's rows are exact at the even split only (a split off it is checked after,
by `predict`; docs/known-gaps.md); the schedule simulations of cost/layout.py (breadth-first,
the walked memory's timeline) run every chunk at the mean layer's time.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import fields, replace
from typing import Any, Sequence

from autopar.cost.profile import (EagerOps, FusedAttention, LayerKind, ModelProfile,
                                  NO_FALLBACK, RegionProfile, TPCorrection, TPRegionFallback)
from autopar.cost.config import layer_parts_key
from autopar.cost.step import even_chunks


def mixed_profile(parts: Sequence[ModelProfile], layers: Sequence[tuple[int, ...]],
                  names: Sequence[str]) -> ModelProfile:
    """The model of kinds `parts` (one one-kind profile each, same embedding and head) whose
    model-wide layers are `layers[k]`, as L mean layers (module docstring)."""
    if len(parts) != len(layers) or not parts:
        raise ValueError(f"mixed_profile: {len(parts)} profiles for {len(layers)} kinds; give "
                         f"one profile per kind")
    total = sum(len(x) for x in layers)
    w = [len(x) / total for x in layers]
    base = parts[0]
    kinds = tuple(LayerKind(name=n, num_layers=len(x), fwd_flops=p.block.fwd_flops,
                            layers=tuple(x), profile=p)
                  for n, x, p in zip(names, layers, parts))
    offsets = [0]
    for p in parts[:-1]:
        offsets.append(offsets[-1] + len(p.block.gemms))
    corr = []
    for c in base.tp_fallbacks:
        fixes = []
        for p in parts:
            mine = next((x for x in p.tp_fallbacks
                         if (x.t, x.sequence_parallel) == (c.t, c.sequence_parallel)), None)
            fixes.append(mine.block if mine is not None else NO_FALLBACK)
        corr.append(replace(c, block=_mean_fallback(fixes, w, offsets), fallbacks=tuple(
            dict.fromkeys(f for p in parts for x in p.tp_fallbacks
                          if (x.t, x.sequence_parallel) == (c.t, c.sequence_parallel)
                          for f in x.fallbacks))))
    mix = ", ".join(f"{k.num_layers} × {k.name}" for k in kinds)
    notes = base.notes + (f"{len(kinds)} kinds of layer ({mix}) priced as {total} mean layers "
                          f"by the solver; stages cut where the kinds' per-layer times match "
                          f"its split (cost/kinds.py)",)
    return replace(base, num_layers=total, block=_mean_region([p.block for p in parts], w),
                   tp_fallbacks=tuple(corr), layer_kinds=kinds, notes=notes,
                   tp_refused=tuple(dict.fromkeys(r for p in parts for r in p.tp_refused)),
                   shared_split_elems=sum(p.shared_split_elems for p in parts),
                   shared_replicated_elems=sum(p.shared_replicated_elems for p in parts))


def _weigh(values: Sequence[float], w: Sequence[float]) -> int:
    return round(sum(v * x for v, x in zip(values, w)))


def _mean_sets(regions: Sequence[RegionProfile], w: Sequence[float]
               ) -> tuple[tuple[int, int, int], ...]:
    """The kinds' expert sets weighed like their totals, one per expert count (() where no
    kind has sets of its own)."""
    if not any(r.expert_sets for r in regions):
        return ()
    acc: dict[int, list[float]] = {}
    for r, x in zip(regions, w):
        sets = r.expert_sets or ((r.experts, r.expert_params_elems, r.expert_dispatch_elems),)
        for e, p, d in sets:
            if e:
                a = acc.setdefault(e, [0.0, 0.0])
                a[0], a[1] = a[0] + p * x, a[1] + d * x
    return tuple((e, round(p), round(d)) for e, (p, d) in sorted(acc.items()))


def _mean_region(regions: Sequence[RegionProfile], w: Sequence[float]) -> RegionProfile:
    gemms, calls, offset = [], [], 0
    for r, x in zip(regions, w):
        gemms += [replace(g, batch=g.batch * x) for g in r.gemms]
        if r.fused is not None:
            calls += [replace(c, gemms=tuple(i + offset for i in c.gemms),
                              active_fraction=c.active_fraction * x,
                              materialized_bytes=round(c.materialized_bytes * x))
                      for c in r.fused.calls]
        offset += len(r.gemms)

    def acts(get) -> tuple[int, int, int]:
        vals = [get(r) for r in regions]
        return tuple(_weigh([v[i] for v in vals], w) for i in range(3))

    def own(r):
        return (r.act_split_bytes, r.act_replicated_bytes, r.act_attention_bytes)

    def fused_of(r):
        return own(r.fused) if r.fused is not None else own(r)

    fused = None
    if any(r.fused is not None for r in regions):
        a = acts(fused_of)
        fused = FusedAttention(calls=tuple(calls), act_split_bytes=a[0],
                               act_replicated_bytes=a[1], act_attention_bytes=a[2])
    eager = None
    if all(r.eager is not None for r in regions):
        e = [r.eager for r in regions]
        a, af = acts(lambda r: own(r.eager)), acts(
            lambda r: own(r.eager.fused) if r.eager.fused is not None else fused_of(r))
        eager = EagerOps(
            other_bytes=_weigh([x.other_bytes for x in e], w),
            other_split_bytes=_weigh([x.other_split_bytes for x in e], w),
            act_split_bytes=a[0], act_replicated_bytes=a[1], act_attention_bytes=a[2],
            fused=None if fused is None else replace(fused, act_split_bytes=af[0],
                                                     act_replicated_bytes=af[1],
                                                     act_attention_bytes=af[2]))
    summed = ("params_split_elems", "params_replicated_elems", "act_split_bytes",
              "act_replicated_bytes", "act_attention_bytes", "input_bytes", "other_bytes",
              "other_split_bytes", "tp_allreduce_elems", "cp_gather_elems",
              "expert_params_elems", "expert_dispatch_elems")
    return replace(regions[0], gemms=tuple(gemms), fused=fused, eager=eager,
                   experts=max(r.experts for r in regions), expert_sets=_mean_sets(regions, w),
                   **{f: _weigh([getattr(r, f) for r in regions], w) for f in summed})


def _mean_fallback(fixes: Sequence[TPRegionFallback], w: Sequence[float],
                   offsets: Sequence[int]) -> TPRegionFallback:
    if all(f.empty for f in fixes):
        return NO_FALLBACK
    summed = ("params_elems", "act_split_bytes", "act_attention_bytes", "other_split_bytes",
              "allreduce_elems_removed")
    return TPRegionFallback(
        replicated_gemms=tuple(i + o for f, o in zip(fixes, offsets) for i in f.replicated_gemms),
        whole_columns=tuple((i + o, c) for f, o in zip(fixes, offsets)
                            for i, c in f.whole_columns),
        collectives=tuple(replace(c, elems=round(c.elems * x))
                          for f, x in zip(fixes, w) for c in f.collectives),
        **{k: _weigh([getattr(f, k) for f in fixes], w) for k in summed})


# ----- stages over the kinds --------------------------------------------------------------------

def kind_layer_ns(profile: ModelProfile, cluster: Any, cfg: Any, memo: Any = None) -> list[int]:
    """Per micro-batch time of one layer of each kind at `cfg` (compute, recompute and its
    tensor- / context- / expert-parallel collectives: cost.model.layer_loads on the kind's own
    profile, restated for one of cfg.c context ranks as every profile the cost model prices).
    `memo` (a solve's CostMemo, optional) caches them per `CostMemo.layer_parts` key."""
    from autopar.cost.memo import CostMemo
    from autopar.cost.layer_parts import layer_loads

    def times() -> list[int]:
        return [layer_loads(k.profile.for_cluster(cluster), cluster, cfg, CostMemo())[0].layer_ns
                for k in profile.layer_kinds]
    if memo is None:
        return times()
    return memo.cached(("times",) + layer_parts_key(cfg), times)


def _cost_cut(profile: ModelProfile, cluster: Any, cfg: Any, layers_per_chunk: Sequence[int],
              memo: Any = None) -> tuple[list[float], list[int]]:
    """(every layer's time `layer_weights`, the model's layers per chunk `stage_layers`) of the
    solver's split `layers_per_chunk`; `memo` caches it per split and kinds' times, so the
    memory rows and the load rows of one configuration (`chunk_kind_layers`, `kinds_cut_ns`)
    cut once."""
    def cut() -> tuple[list[float], list[int]]:
        weights = layer_weights(profile, kind_layer_ns(profile, cluster, cfg, memo))
        return weights, stage_layers(layers_per_chunk, weights)
    if memo is None:
        return cut()
    return memo.cached(("cut", tuple(layers_per_chunk)) + layer_parts_key(cfg), cut)


def chunk_kind_layers(profile: ModelProfile, cluster: Any, cfg: Any,
                      layers_per_chunk: Sequence[int], memo: Any = None) -> list[list[int]]:
    """Per chunk, its layers of each kind when the solver's split `layers_per_chunk` (mean
    layers) is cut over the model's layers by the kinds' per-layer times (`stage_layers`)."""
    _, cut = _cost_cut(profile, cluster, cfg, layers_per_chunk, memo)
    kind_of = layer_weights(profile, range(len(profile.layer_kinds)))
    out, first = [], 0
    for n in cut:
        row = [0] * len(profile.layer_kinds)
        for k in kind_of[first:first + n]:
            row[int(k)] += 1
        out.append(row)
        first += n
    return out


def kinds_cut_ns(profile: ModelProfile, cluster: Any, cfg: Any, layer_ns: int,
                 layers_per_chunk: Sequence[int] | None = None,
                 memo: Any = None) -> tuple[int, ...]:
    """Per pipeline rank, the time its real layers take beyond its mean layers' (ns per
    micro-batch) when the cost cut of `layers_per_chunk` (default: the even split) gives it
    its chunks' real layers (`stage_layers`, each layer its kind's `kind_layer_ns`, scaled
    to the mean layer's `layer_ns` so that the mean layers keep pricing the stack in sum):
    the ranks' loads then sum to the mean layers' (the cut only moves time between ranks,
    the rounding's residue put on the last rank) and the heaviest rank, which sets the
    pipeline's steady state, is priced by what it holds: a cut that cannot balance (few
    layers a stage, a heavy kind) costs what it costs. Exact at the split given (`predict`
    passes the chosen one); the search's and CP-SAT's rows use the even split's, as the
    memory rows do, so their step-time formula stays affine in the rank layer counts."""
    if layers_per_chunk is None:
        layers_per_chunk = even_chunks(profile.num_layers, cfg.p * cfg.v)
    weights, cut = _cost_cut(profile, cluster, cfg, layers_per_chunk, memo)
    scale = layer_ns * len(weights) / sum(weights) if sum(weights) else 0.0
    real, mine, first = [0.0] * cfg.p, [0] * cfg.p, 0
    for c, k in enumerate(cut):
        real[c % cfg.p] += sum(weights[first:first + k]) * scale
        mine[c % cfg.p] += layers_per_chunk[c]
        first += k
    out = [round(real[r] - layer_ns * mine[r]) for r in range(cfg.p)]
    out[-1] -= sum(out)
    return tuple(out)


def _kind_memory(profile: ModelProfile, cluster: Any, cfg: Any, memo: Any,
                 gathers: Any = None) -> list[tuple]:
    """Per kind: memory.memory_coefficients' per-rank parts per layer and its micro-batch
    activations, on the kind's rank profile (its own parameters, experts and activations);
    `gathers`: the weight-gather counts sharded weights are priced with (as config_costs')."""
    from autopar.cost.memory import memory_coefficients
    from autopar.cost.shares import rank_params
    out = []
    for i, k in enumerate(profile.layer_kinds):
        kp = _kind_rank_profile(i, k.profile, cluster, cfg, memo)
        _, _, parts, _, acts = memory_coefficients(kp, cluster, cfg, rank_params(kp, cfg),
                                                   gathers)
        out.append((parts, acts))
    return out


def _rank_layer_parts(counts: Sequence[Sequence[int]], per_kind: Sequence[tuple], p: int,
                      r: int) -> tuple[float, ...]:
    """Pipeline rank r's memory_coefficients parts (weights, gradients, optimizer states,
    activations) summed over the layers its chunks (counts[r::p], each per kind) hold."""
    n_k = [sum(row[k] for row in counts[r::p]) for k in range(len(per_kind))]
    return tuple(sum(n * kp[r][i] for n, (kp, _) in zip(n_k, per_kind)) for i in range(4))


def _kind_rank_profile(i: int, kind: ModelProfile, cluster: Any, cfg: Any, memo: Any) -> Any:
    from autopar.cost.shares import rank_profile
    if memo is None:
        return rank_profile(kind, cluster, cfg)
    return memo.cached(("profile", i, cluster.attention, cfg.c, cfg.cp_attention),
                       lambda: rank_profile(kind, cluster, cfg))


def kinds_memory_slopes(profile: ModelProfile, cluster: Any, cfg: Any,
                        parts: Sequence[tuple[float, ...]], fparts: Sequence[tuple[float, ...]],
                        memo: Any = None, gathers: Any = None
                        ) -> tuple[tuple[int, ...], tuple[int, ...], tuple, tuple]:
    """memory.memory_coefficients' (mem_layer, mem_fixed, parts, fparts) of the mean-layer
    profile restated by the real layers: each rank's bytes per (mean) layer are those of the
    layers the cost cut gives it from the even split of the mean layers (`chunk_kind_layers`),
    each priced by its kind; the working set of a recomputed layer is the largest kind's. So
    the solver's memory rows (affine in a rank's mean layers, cost/step.py) are exact at the
    even split and see a stage of MoE layers hold more than the mean; `predict` prices the
    chosen split exactly (`kinds_rank_memory`). `parts`, `fparts`: the mean layer's;
    `memo`, `gathers`: config_costs'."""
    chunks = even_chunks(profile.num_layers, cfg.p * cfg.v)
    counts = chunk_kind_layers(profile, cluster, cfg, chunks, memo)
    per_kind = _kind_memory(profile, cluster, cfg, memo, gathers)
    from autopar.cost.memory import backward_work
    work = max(a.work for _, a in per_kind)
    head_work = max(a.head_work for _, a in per_kind)
    new_parts, new_fixed = [], []
    for r in range(cfg.p):
        y = sum(chunks[r::cfg.p])
        new_parts.append(tuple(x / y for x in _rank_layer_parts(counts, per_kind, cfg.p, r))
                         if y else parts[r])
        new_fixed.append(tuple(fparts[r][:4]) + (backward_work(work, head_work, r == cfg.p - 1),)
                         + tuple(fparts[r][5:]))
    return (tuple(int(math.ceil(sum(x))) for x in new_parts),
            tuple(int(math.ceil(sum(x[:5]))) for x in new_fixed), tuple(new_parts),
            tuple(new_fixed))


def kinds_rank_memory(profile: ModelProfile, cluster: Any, cfg: Any, cc: Any,
                      layers_per_chunk: Sequence[int]) -> tuple[Any, ...]:
    """Per pipeline rank, its Memory when its chunks hold the real layers of the cost cut
    (`chunk_kind_layers`): each kind's per-layer weights / gradients / optimizer states and
    activations from memory_coefficients on the kind's rank profile, the fixed parts
    (embedding, head, shared blocks, reserve, the largest kind's recompute working set) from
    `cc` (`kinds_memory_slopes`); activations walked over the schedule as `predict` walks
    them, each chunk with its own layers' bytes."""
    from autopar.cost.memory import rank_memory_parts, schedule_activation_bytes
    from autopar.plan import Memory
    counts = chunk_kind_layers(profile, cluster, cfg, layers_per_chunk)
    per_kind = _kind_memory(profile, cluster, cfg, None)
    chunk_bytes = [(sum(n * a.layer for n, (_, a) in zip(row, per_kind)),
                    sum(n * a.pending_layer for n, (_, a) in zip(row, per_kind)))
                   for row in counts]
    acts = schedule_activation_bytes(cc, layers_per_chunk, chunk_bytes=chunk_bytes)
    out = []
    for r in range(cfg.p):
        w, g, o, _ = _rank_layer_parts(counts, per_kind, cfg.p, r)
        fixed = rank_memory_parts(cc, r, 0)
        out.append(replace(fixed, weights_bytes=fixed.weights_bytes + w,
                           gradients_bytes=fixed.gradients_bytes + g,
                           optimizer_bytes=fixed.optimizer_bytes + o, activations_bytes=acts[r]))
    return tuple(out)


def layer_weights(profile: ModelProfile, per_kind: Sequence[float]) -> list[float]:
    """The weight of every model layer (its kind's), in order."""
    out = [0.0] * profile.num_layers
    for k, kind in enumerate(profile.layer_kinds):
        for i in kind.layers:
            out[i] = per_kind[k]
    return out


def stage_layers(chunks: Sequence[int], weights: Sequence[float]) -> list[int]:
    """The model's layers in each chunk when the solver's split `chunks` counts mean layers:
    cut c at the layer boundary whose cumulative weight is nearest the chunks' cumulative
    share of the total (a chunk with layers keeps at least one; one without, an embedding-
    or head-only chunk, none)."""
    n = len(weights)
    if sum(chunks) != n:
        raise ValueError(f"stage_layers: chunks {list(chunks)} hold {sum(chunks)} layers but "
                         f"the model has {n}; split the profile's num_layers")
    prefix = [0.0]
    for x in weights:
        prefix.append(prefix[-1] + x)
    mins = [1 if u else 0 for u in chunks]
    later = [0] * len(chunks)     # later[c]: the least layers chunks c+1.. need
    for c in range(len(chunks) - 2, -1, -1):
        later[c] = later[c + 1] + mins[c + 1]
    out, prev, done = [], 0, 0
    for c, u in enumerate(chunks[:-1]):
        done += u
        lo, hi = prev + mins[c], n - later[c]
        cut = prev if not u else _nearest(prefix, prefix[-1] * done / n, lo, hi)
        out.append(cut - prev)
        prev = cut
    out.append(n - prev)
    return out


def _nearest(prefix: Sequence[float], target: float, lo: int, hi: int) -> int:
    """The least i in [lo, hi] whose prefix[i] is nearest `target` (prefix nondecreasing):
    min(range(lo, hi + 1), key=|prefix[i] − target|) by bisection (the solver asks for every
    configuration's cut; a 61-layer stack cut in 32 chunks took 0.8 ms a cut by the scan)."""
    i = bisect.bisect_left(prefix, target, lo, hi + 1)
    best = min(i, hi)
    if i > lo:
        left = bisect.bisect_left(prefix, prefix[i - 1], lo, i)   # the least index of its value
        if abs(prefix[left] - target) <= abs(prefix[best] - target):
            best = left
    return best


def plan_config(plan: Any) -> Any:
    """The cost model's Config of `plan` (its degrees, batch and schedule)."""
    from autopar.cost.config import Config
    return Config(**{f.name: getattr(plan, f.name) for f in fields(Config)
                     if hasattr(plan, f.name)})


def kinds_in(profile: ModelProfile, first: int, last: int) -> str:
    """'3 × dense + 1 × moe': the kinds of layers [first, last)."""
    counts = [sum(first <= i < last for i in k.layers) for k in profile.layer_kinds]
    return " + ".join(f"{n} × {k.name}" for n, k in zip(counts, profile.layer_kinds) if n)
