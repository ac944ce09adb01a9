"""The cost model: step time, memory and throughput of one parallel configuration.

Pure functions of (ModelProfile, Cluster, Config, layers per chunk); units are in the names.
The solver (cost/solver.py), `predict` and `Plan.explain()` all go through `config_costs` and
the step-time pieces below it (`rank_load_ns`, `rank_tail_terms_ns`, `rank_memory_bytes`,
affine in a rank's layer count, and `scaled_step_ns`, the one statement of the step-time
formula), so the solver's constraints and objective and the reported prediction are the same
functions.

This module assembles a configuration's costs (`load_parts_s`, `load_costs`, `config_costs`)
and its prediction (`predict`) from the mechanisms, one concern per module, each stating its
own (one mechanism each, no per-configuration constants):

    cost/config.py      Config; the schedule and ZeRO tables; LoadCosts / ConfigCosts
    cost/shares.py      one rank's share: its profile, the tensor-parallel pass's fallbacks,
                        its parameters, the vocabulary padding
    cost/compute.py     GEMMs, attention kernels, elementwise traffic: a block's and the
                        embedding's / head's times per micro-batch; FLOPs; the optimizer step
    cost/comm.py        collectives on a link; the pipeline's p2p
    cost/exchanges.py   context parallelism's K/V exchange, the experts' all-to-alls
    cost/dp_terms.py    gradient reduction, ZeRO's gathers, what the schedule hides of them
    cost/memory.py      activations, bytes per pipeline rank, the schedule walk, lower bounds
    cost/step.py        the step-time formula from rank layer counts (bubble, tail)
    cost/memo.py        CostMemo: the caches one solve shares across configurations

Every name of theirs used elsewhere is re-exported here: `from autopar.cost.model import X`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

# re-exported: the cost model's names as callers (solver, search, simulate, report, tests) use
from autopar.cost.comm import (allgather_s, allreduce_s, alltoall_s,  # noqa: F401
                               chunk_p2p_s, group_spans_nodes, p2p_s, pipeline_p2p_s)
from autopar.cost.compute import (block_times_s, edge_times_s, elementwise_time_s,  # noqa: F401
                                  flops_per_seq, fp8_cast_time_s, fused_attention_time_s,
                                  gemm_efficiency, gemm_time_s, local_gemm_time_s,
                                  optimizer_step_s)
from autopar.cost.config import (NS, RECOMPUTE, SCHEDULE_TRAITS, ZERO_TRAITS,  # noqa: F401
                                 Config, ConfigCosts, LoadCosts, ScheduleTraits, ZeroTraits,
                                 bubble_div, inflight, pending_weight_grads)
from autopar.cost.dp_terms import dp_terms_s, weight_gather_stats  # noqa: F401
from autopar.cost.exchanges import (alltoall_attention_s, alltoall_exchange_elems,  # noqa: F401
                                    alltoall_heads_rule, context_comm_s, expert_comm_s,
                                    ring_attention_s, ring_exposed_s)
from autopar.cost.hardware import Cluster
from autopar.cost.kinds import kinds_cut_ns, kinds_memory_slopes, kinds_rank_memory
from autopar.cost.layout import schedule_pipe_s
from autopar.cost.layer_parts import layer_loads, layer_parts_s, seconds_to_ns  # noqa: F401
from autopar.cost.memo import CostMemo
from autopar.cost.memory import (activation_bytes_lower_bound,  # noqa: F401
                                 layer_activation_bytes, memory_coefficients,
                                 pending_w_layer_bytes, rank_memory_parts,
                                 schedule_activation_bytes, state_bytes_lower_bound)
from autopar.cost.profile import ModelProfile
from autopar.cost.shares import (RankParams, expert_params_elems, padded_vocab,  # noqa: F401
                                 rank_params, rank_profile, shard_params_elems,
                                 vocab_pad_ratio)
from autopar.cost.step import (Lin, even_chunks, fits, rank_layers, rank_load_ns,  # noqa: F401
                               rank_memory_bytes, rank_tail_ns, rank_tail_terms_ns,
                               scaled_step_ns, step_scale, step_time_ns, step_time_scaled,
                               tail_layer_ns, total_load_ns, total_tail_ns, v_step_ns)
from autopar.plan import Prediction
from autopar.weight_gathers import GatherCounts


# ----- a configuration's costs -------------------------------------------------------------------
def load_parts_s(profile: ModelProfile, cluster: Cluster, cfg: Config,
                 memo: CostMemo | None = None
                 ) -> tuple[float, float, float, float, float, float, float]:
    """(layer compute, layer TP comm, embedding, head, rank p2p, layer context-parallel comm,
    layer expert all-to-alls) seconds per micro-batch, on one context rank's share of the
    sequences.

    `memo` (optional) caches the parts shared by many configurations within one solve; the
    result does not depend on it.
    """
    if memo is None:
        return _load_parts_s(profile, cluster, cfg, CostMemo())
    return memo.load_parts(cfg, lambda: _load_parts_s(profile, cluster, cfg, memo))


def _load_parts_s(profile: ModelProfile, cluster: Cluster, cfg: Config, memo: CostMemo
                  ) -> tuple[float, float, float, float, float, float, float]:
    profile = memo.rank_profile(profile, cluster, cfg)
    comp_s, tp_s, emb_s, head_s, cp_s, ep_s = memo.layer_parts(
        cfg, lambda: layer_parts_s(profile, cluster, cfg, memo))
    p2p_total = pipeline_p2p_s(profile, cluster, cfg, comp_s + tp_s + cp_s + ep_s)
    return comp_s, tp_s, emb_s, head_s, p2p_total, cp_s, ep_s


def load_costs(profile: ModelProfile, cluster: Cluster, cfg: Config,
               memo: CostMemo | None = None) -> LoadCosts:
    """`load_parts_s` rounded to integer ns: the exact integers the solver and predict use."""
    if memo is None:
        memo = CostMemo()
    comp, tp, emb, head, p2p, cp, ep = memo.load_ns(cfg, lambda: tuple(
        seconds_to_ns(x) for x in load_parts_s(profile, cluster, cfg, memo)))
    return LoadCosts(cfg=cfg, layer_compute_ns=comp, layer_tp_ns=tp, embed_ns=emb, head_ns=head,
                     p2p_ns=p2p, layer_cp_ns=cp, layer_ep_ns=ep)


def p2p_load_ns(hop_s: float, p: int, v: int, group: int | None, layer_s: float,
                num_layers: int, comm_overlap: float) -> int:
    """`load_costs`' p2p_ns from one pipeline hop (comm.p2p_hop_s) and a layer's load in s
    (`layer_loads`), without a Config: comm.chunk_p2p_s rounded as load_costs rounds."""
    return seconds_to_ns(chunk_p2p_s(hop_s, p, v, group, layer_s, num_layers, comm_overlap))


def config_costs(profile: ModelProfile, cluster: Cluster, cfg: Config,
                 memo: CostMemo | None = None,
                 gathers: "GatherCounts | None" = None) -> ConfigCosts:
    """Every integer ns / byte constant of cfg (the load's, the data-parallel and optimizer
    tail's, the memory's per rank, the FLOPs), each affine in a rank's layer count: what the
    solver's constraints and objective and `predict` use. `memo` as in `load_parts_s`.
    `gathers`: the weight-gather counts to price sharded weights with (default: the plan of
    cfg's own schedule, walked); the search passes `weight_gathers.least_counts`, which no
    schedule's plan undercuts, to bound a configuration before walking its schedule."""
    memo = CostMemo() if memo is None else memo
    lc = load_costs(profile, cluster, cfg, memo)
    profile = memo.rank_profile(profile, cluster, cfg)
    block_s = memo.block_times_s(profile, cluster, cfg)
    fwd_ns = min(seconds_to_ns(block_s[2] + memo.context_comm_s(profile, cluster, cfg)[0]
                               + expert_comm_s(profile, cluster, cfg)[0]), lc.layer_ns)
    params = rank_params(profile, cfg)
    if not ZERO_TRAITS[cfg.zero].sharded_weights:
        gathers = None
    elif gathers is None:
        gathers = memo.weight_gathers(cfg)
    dp_layer, window_layer, dp_first, dp_last, dp_rank = dp_terms_s(
        profile, cluster, cfg, params, block_s, lc.layer_compute_ns / NS, gathers)
    opt_layer, opt_first, opt_last = optimizer_step_s(cluster, cfg, params, profile)
    mem_layer, mem_fixed, parts, fparts, acts = memory_coefficients(profile, cluster, cfg,
                                                                    params, gathers)
    rank_cut_ns: tuple[int, ...] = ()
    if profile.mixed:   # a stack of kinds: each rank's bytes and time from its real layers
        mem_layer, mem_fixed, parts, fparts = kinds_memory_slopes(profile, cluster, cfg, parts,
                                                                  fparts, memo, gathers)
        rank_cut_ns = kinds_cut_ns(profile, cluster, cfg, lc.layer_ns, memo=memo)
    flops_fwd_seq, rec_seq = memo.flops_per_seq(profile, cfg)
    # a rank's share of a sequence is 1/c of its FLOPs (the balanced split): the sequence's are c×
    B = cfg.global_batch_size * cfg.c

    ns = seconds_to_ns
    return ConfigCosts(
        cfg=cfg, layer_compute_ns=lc.layer_compute_ns, layer_tp_ns=lc.layer_tp_ns,
        embed_ns=lc.embed_ns, head_ns=lc.head_ns, p2p_ns=lc.p2p_ns, layer_cp_ns=lc.layer_cp_ns,
        layer_ep_ns=lc.layer_ep_ns, rank_cut_ns=rank_cut_ns,
        dp_layer_ns=ns(dp_layer), dp_first_ns=ns(dp_first), dp_last_ns=ns(dp_last),
        window_layer_ns=ns(window_layer),
        opt_layer_ns=ns(opt_layer), opt_first_ns=ns(opt_first), opt_last_ns=ns(opt_last),
        mem_layer_bytes=mem_layer, mem_fixed_bytes=mem_fixed,
        capacity_bytes=int(cluster.usable_memory_bytes),
        flops_per_step=B * (3 * flops_fwd_seq + rec_seq),
        model_flops_per_step=B * 3 * flops_fwd_seq,
        mem_parts=parts, mem_fixed_parts=fparts, layer_fwd_ns=fwd_ns,
        act_layer_bytes=acts.layer, act_embed_bytes=acts.embedding, act_head_bytes=acts.head,
        pending_layer_bytes=acts.pending_layer, pending_head_bytes=acts.pending_head,
        dp_rank_ns=ns(dp_rank))


# ----- prediction ----------------------------------------------------------------------------
STALL_RTOL = 1e-6   # a simulated excess this small is float rounding of equal chunks


def schedule_stall_ns(cc: ConfigCosts, layers_per_chunk: Sequence[int], pipe_ns: float,
                      mixed: bool = False) -> float:
    """What the plan's own action lists wait beyond the step formula's pipeline time `pipe_ns`
    (m · max tau + bubble, cost/step.py): the simulated first-forward-to-last-backward time
    (`layout.schedule_pipe_s`) less `pipe_ns`, when positive; else 0.

    Why both: the formula is exact for equal chunks and charges every pipeline message in
    full (on a host whose ranks' cores also copy the messages, what they pay), but it sees a
    rank's load only, not how its chunks are cut; the simulator runs the lists the runtime
    runs, so it sees the stalls of uneven chunks (an embedding-only first chunk, a head-only
    last one), in zero-bubble's most (a W placed before the forward the next rank waits for:
    a 2-layer GPT at p = v = 2 simulates 22% over the formula, measured 23–27% over
    interleaved 1F1B), but hides every message behind compute. The larger of the two is
    the price. 0 for one pipeline rank, lists too long to simulate cheaply, and stacks of
    layer kinds (their chunks' real layers are not simulated)."""
    if mixed:
        return 0.0
    sim_s = schedule_pipe_s(cc, layers_per_chunk)
    stall_ns = 0.0 if sim_s is None else sim_s * NS - pipe_ns
    return stall_ns if stall_ns > STALL_RTOL * pipe_ns else 0.0


def predict(profile: ModelProfile, cluster: Cluster, cfg: Config,
            layers_per_chunk: tuple[int, ...] | list[int] | None = None,
            costs: ConfigCosts | None = None) -> Prediction:
    """Predicted step of `cfg` with the given layers per chunk (default: as even as possible)."""
    cc = costs or config_costs(profile, cluster, cfg)
    profile = rank_profile(profile, cluster, cfg)
    nchunks = cfg.p * cfg.v
    if layers_per_chunk is None:
        layers_per_chunk = even_chunks(profile.num_layers, nchunks)
    if len(layers_per_chunk) != nchunks or sum(layers_per_chunk) != profile.num_layers:
        raise ValueError(f"layers_per_chunk={list(layers_per_chunk)}: needs p·v = {nchunks} "
                         f"entries summing to num_layers={profile.num_layers}")
    if profile.mixed:   # a stack of kinds: each rank's time from its real layers at this split
        cc = dataclasses.replace(cc, rank_cut_ns=kinds_cut_ns(
            profile, cluster, cfg, cc.layer_ns, layers_per_chunk))
    y = rank_layers(layers_per_chunk, cfg.p)
    m = cfg.num_microbatches
    loads = [rank_load_ns(cc, r, yr) for r, yr in enumerate(y)]
    crit = max(range(cfg.p), key=lambda r: loads[r])
    tails = [rank_tail_terms_ns(cc, r, yr) for r, yr in enumerate(y)]
    tr = max(range(cfg.p), key=lambda r: max(tails[r]))
    tail_ns, opt_ns = max(tails[tr]), tails[tr][1]
    step_ns = step_time_ns(cc, y)
    bubble_ns = (sum(loads) - loads[crit]) / step_scale(cfg)
    stall_ns = schedule_stall_ns(cc, layers_per_chunk, m * loads[crit] + bubble_ns,
                                 profile.mixed)
    step_ns, bubble_ns = step_ns + stall_ns, bubble_ns + stall_ns
    # the critical rank's layers, its real layers' time when the stack has kinds (the parts in
    # proportion to the mean layer's)
    yc = y[crit] + (cc.cut_ns(crit) / cc.layer_ns if cc.layer_ns else 0)
    compute_ns = m * (cc.layer_compute_ns * yc + (cc.embed_ns if crit == 0 else 0)
                      + (cc.head_ns if crit == cfg.p - 1 else 0))
    if profile.mixed:   # a stack of kinds: each rank's real layers (cost/kinds.py)
        ranks = kinds_rank_memory(profile, cluster, cfg, cc, layers_per_chunk)
    else:
        acts = schedule_activation_bytes(cc, layers_per_chunk)
        ranks = tuple(dataclasses.replace(rank_memory_parts(cc, r, y[r]),
                                          activations_bytes=acts[r]) for r in range(cfg.p))
    mem = max(ranks, key=lambda m: m.total_bytes)
    step_s = step_ns / NS
    return Prediction(
        step_time_s=step_s,
        tflops_per_gpu=cc.flops_per_step / (cfg.gpus * step_s) / 1e12,
        mfu=cc.model_flops_per_step / (cfg.gpus * step_s * cluster.peak_flops),
        bubble_fraction=bubble_ns / (m * loads[crit]) if loads[crit] else 0.0,
        memory_bytes_per_gpu=mem.total_bytes,
        compute_s=compute_ns / NS, tp_comm_s=m * cc.layer_tp_ns * yc / NS,
        cp_comm_s=m * cc.layer_cp_ns * yc / NS, ep_comm_s=m * cc.layer_ep_ns * yc / NS,
        pp_comm_s=m * cc.p2p_ns / NS, dp_comm_s=(tail_ns - opt_ns) / NS,
        bubble_s=bubble_ns / NS, optimizer_s=opt_ns / NS, memory=mem, rank_memory=ranks,
        attention=cluster.attention, elementwise=cluster.elementwise)

