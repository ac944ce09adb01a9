"""CostMemo: the caches one solve shares between the configurations it prices.

One solve prices one profile on one cluster over ~10^5 configurations, most of which share
their parts: a block's times depend on (t, b, recompute, sp, TP link, c, method), not on p, d,
v or the ZeRO level. Each cache is a named dict keyed by exactly the configuration fields its
value depends on (the profile and the cluster are the solve's own, fixed); every value is a
pure function's, so a result never depends on whether it came from a cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from autopar.cost.comm import group_spans_nodes
from autopar.cost.compute import block_times_s, edge_times_s, flops_per_seq
from autopar.cost.config import ZERO_TRAITS, Config, layer_parts_key
from autopar.cost.context import context_rank_profile
from autopar.cost.dp_terms import weight_gather_stats
from autopar.cost.exchanges import context_comm_s
from autopar.cost.hardware import Cluster
from autopar.cost.profile import ModelProfile
from autopar.cost.shares import rank_profile
from autopar.schedules import SPLIT_BACKWARD
from autopar.weight_gathers import GatherCounts


@dataclass(frozen=True, eq=False)
class CostMemo:
    """Caches of one solve (one profile on one cluster); pass one to `config_costs`,
    `load_costs`, ... to share work across configurations, or none for a one-off price.

    Profiles are the caller's (the solve's) profile; `block_times_s`, `edge_times_s`,
    `context_comm_s` and `flops_per_seq` take the rank's (`rank_profile`), as the functions
    they cache do."""
    rank_profiles: dict[tuple, ModelProfile] = field(default_factory=dict)
    context_profiles: dict[tuple, ModelProfile] = field(default_factory=dict)
    blocks: dict[tuple, tuple[float, float, float]] = field(default_factory=dict)
    edges: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    context_comm: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    gathers: dict[tuple, GatherCounts] = field(default_factory=dict)
    flops: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    loads: dict[tuple, tuple[float, ...]] = field(default_factory=dict)
    loads_ns: dict[tuple, tuple[int, ...]] = field(default_factory=dict)
    layers: dict[tuple, tuple[float, ...]] = field(default_factory=dict)
    # the search's bounds (cost/search.py): state bytes per configuration, a family's loads
    # (layer, embedding and head ns, a layer's s), a layer's activation bytes per (t, c,
    # method, b, recompute, sp)
    state_bytes: dict[tuple, float] = field(default_factory=dict)
    family_loads: dict[tuple, tuple[int, int, int, float]] = field(default_factory=dict)
    activation_bytes: dict[tuple, float] = field(default_factory=dict)
    # a stack of several kinds (cost/kinds.py): each kind's rank profile per (kind, attention,
    # c, method) and the kinds' per-layer ns per `layer_parts` key
    kinds: dict[tuple, object] = field(default_factory=dict)

    def cached(self, key: tuple, compute: Callable[[], object]) -> object:
        """`kinds[key]`, `compute()` on a miss (the key names everything the value reads)."""
        out = self.kinds.get(key)
        if out is None:
            out = self.kinds[key] = compute()
        return out

    def rank_profile(self, profile: ModelProfile, cluster: Cluster, cfg: Config) -> ModelProfile:
        """`shares.rank_profile`: priced on the cluster, restated for one of c context ranks."""
        key = (cluster.attention, cfg.c, cfg.cp_attention)
        out = self.rank_profiles.get(key)
        if out is None:
            out = self.rank_profiles[key] = rank_profile(profile, cluster, cfg)
        return out

    def context_profile(self, profile: ModelProfile, cfg: Config) -> ModelProfile:
        """`context_rank_profile` of cfg's (c, method), the profile as given otherwise."""
        key = (cfg.c, cfg.cp_attention)
        out = self.context_profiles.get(key)
        if out is None:
            out = self.context_profiles[key] = context_rank_profile(profile, cfg.c,
                                                                    cfg.cp_attention)
        return out

    def block_times_s(self, profile: ModelProfile, cluster: Cluster,
                      cfg: Config) -> tuple[float, float, float]:
        """`compute.block_times_s` of cfg's (t, b, recompute, sp, TP link, c, method)."""
        sp = cfg.sequence_parallel and cfg.t > 1
        tp_inter = group_spans_nodes(cluster, stride=1, size=cfg.t, gpus=cfg.gpus)
        key = (cfg.t, cfg.micro_batch_size, cfg.recompute, sp, tp_inter, cfg.c, cfg.cp_attention)
        out = self.blocks.get(key)
        if out is None:
            out = self.blocks[key] = block_times_s(profile, cluster, cfg.t, cfg.micro_batch_size,
                                                   cfg.recompute, sp, tp_inter)
        return out

    def edge_times_s(self, profile: ModelProfile, cluster: Cluster,
                     cfg: Config) -> tuple[float, float]:
        """`compute.edge_times_s` of cfg's (t, b, sp, TP link, c, method)."""
        sp = cfg.sequence_parallel and cfg.t > 1
        tp_inter = group_spans_nodes(cluster, stride=1, size=cfg.t, gpus=cfg.gpus)
        key = (cfg.t, cfg.micro_batch_size, sp, tp_inter, cfg.c, cfg.cp_attention)
        out = self.edges.get(key)
        if out is None:
            out = self.edges[key] = edge_times_s(profile, cluster, cfg.t, cfg.micro_batch_size,
                                                 sp, tp_inter)
        return out

    def context_comm_s(self, profile: ModelProfile, cluster: Cluster,
                       cfg: Config) -> tuple[float, float]:
        """`exchanges.context_comm_s` of cfg's (t, b, sp, c, method, recompute, GPUs): the
        ring's price runs the attention pricing twice; load and memory both ask for it."""
        key = (cluster.attention, cfg.t, cfg.micro_batch_size,
               cfg.sequence_parallel and cfg.t > 1, cfg.c, cfg.cp_attention, cfg.recompute,
               cfg.gpus)
        out = self.context_comm.get(key)
        if out is None:
            out = self.context_comm[key] = context_comm_s(profile, cluster, cfg)
        return out

    def weight_gathers(self, cfg: Config) -> GatherCounts:
        """`dp_terms.weight_gather_stats` of cfg's schedule, p, v, m, group and kept chunks."""
        key = (cfg.schedule, cfg.p, cfg.v, cfg.num_microbatches, cfg.microbatch_group,
               ZERO_TRAITS[cfg.zero].keep(cfg.v))
        out = self.gathers.get(key)
        if out is None:
            out = self.gathers[key] = weight_gather_stats(cfg)
        return out

    def load_parts(self, cfg: Config,
                   compute: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
        """`model.load_parts_s` of cfg (`compute()` on a miss), keyed by what it reads: every
        field but the ZeRO level, m and the schedule past whether it splits the backward (the
        loads are per micro-batch; the ZeRO levels and schedules of one (t, c, p, d, ep, b, v,
        N, ...) share them)."""
        key = _load_key(cfg)
        out = self.loads.get(key)
        if out is None:
            out = self.loads[key] = compute()
        return out

    def load_ns(self, cfg: Config, compute: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
        """`model.load_costs`' integers of cfg (`compute()` on a miss), keyed as `load_parts`."""
        key = _load_key(cfg)
        out = self.loads_ns.get(key)
        if out is None:
            out = self.loads_ns[key] = compute()
        return out

    def layer_parts(self, cfg: Config,
                    compute: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
        """`model.load_parts_s` less the p2p (`compute()` on a miss), keyed by what it reads
        (`config.layer_parts_key`)."""
        key = layer_parts_key(cfg)
        out = self.layers.get(key)
        if out is None:
            out = self.layers[key] = compute()
        return out

    def flops_per_seq(self, profile: ModelProfile, cfg: Config) -> tuple[float, float]:
        """`compute.flops_per_seq` of cfg's (t, recompute, c)."""
        key = (cfg.t, cfg.recompute, cfg.c)
        out = self.flops.get(key)
        if out is None:
            out = self.flops[key] = flops_per_seq(profile, cfg.t, cfg.recompute)
        return out


def _load_key(cfg: Config) -> tuple:
    """What the loads read of cfg: every field but the ZeRO level, m and the schedule, of
    which only whether it splits the backward (`CostMemo.load_parts` and `load_ns` share it)."""
    return (cfg.t, cfg.c, cfg.cp_attention, cfg.p, cfg.d, cfg.ep, cfg.v, cfg.micro_batch_size,
            cfg.recompute, cfg.sequence_parallel, cfg.microbatch_group,
            cfg.schedule in SPLIT_BACKWARD)
