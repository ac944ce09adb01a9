"""One layer's parts per micro-batch (compute, TP / context / expert communication, the
embedding and head), the same at every p, d, v and N: the part of cost/model.py that
cost/kinds.py prices each kind with. Below both (a module of its own so that model.py can use
kinds.py and kinds.py these, without an import loop)."""
from __future__ import annotations

from dataclasses import replace

from autopar.cost.config import NS, Config, LoadCosts
from autopar.cost.compute import local_gemm_time_s, split_backward_s
from autopar.cost.exchanges import expert_comm_s
from autopar.cost.hardware import Cluster
from autopar.cost.imbalance import expert_gemm_extra_s
from autopar.cost.memory import MicrobatchActivations, microbatch_activations
from autopar.cost.memo import CostMemo
from autopar.cost.profile import ModelProfile
from autopar.schedules import SPLIT_BACKWARD


def layer_parts_s(profile: ModelProfile, cluster: Cluster, cfg: Config, memo: CostMemo
                  ) -> tuple[float, float, float, float, float, float]:
    """`cost.model.load_parts_s` but the p2p: (layer compute, layer TP comm, embedding, head,
    layer context-parallel comm, layer expert all-to-alls), the same at every p, d, v and N."""
    comp_s, tp_s, _ = memo.block_times_s(profile, cluster, cfg)
    comp_s += expert_gemm_extra_s(profile, cfg.ep, cfg.recompute, lambda g: local_gemm_time_s(
        cluster, g, cfg.t, cfg.micro_batch_size, profile.activation_bytes_per_elem)
    )   # the most loaded expert rank (cost/imbalance.py)
    cp_s = memo.context_comm_s(profile, cluster, cfg)[1]
    ep_s = expert_comm_s(profile, cluster, cfg)[1]
    emb_s, head_s = memo.edge_times_s(profile, cluster, cfg)
    if cfg.schedule in SPLIT_BACKWARD:     # B and W: the split's host work (0 on fused stacks)
        saved = _saved_bytes(profile, cluster, cfg)
        comp_s += split_backward_s(cluster, profile.block, comp_s, saved.layer)
        emb_s += split_backward_s(cluster, profile.embedding, emb_s, saved.embedding)
        head_s += split_backward_s(cluster, profile.head, head_s, saved.head)
    return comp_s, tp_s, emb_s, head_s, cp_s, ep_s


def _saved_bytes(profile: ModelProfile, cluster: Cluster, cfg: Config) -> MicrobatchActivations:
    """A micro-batch's saved activations per layer, embedding and head without recompute
    (what a split backward's B makes gradients for), where the cluster prices them per byte
    (`split_backward_s`); zeros elsewhere."""
    if cluster.elementwise != "eager" or not cluster.split_backward_s_per_byte:
        return MicrobatchActivations(layer=0.0, embedding=0.0, head=0.0)
    return microbatch_activations(profile, replace(cfg, recompute="none"))


def seconds_to_ns(seconds: float) -> int:
    """Seconds as the integer nanoseconds the solver and `predict` use."""
    return int(round(seconds * NS))


def layer_loads(profile: ModelProfile, cluster: Cluster, cfg: Config,
                memo: CostMemo) -> tuple[LoadCosts, float]:
    """`load_costs` but the p2p (its p2p_ns 0: the other integers are the same at every p, d,
    v and N, from the layer's parts alone), and a layer's load in s as `load_parts_s` hands
    it to pipeline_p2p_s: the search's family bound and, with `p2p_load_ns`, its quick bound."""
    rank = memo.rank_profile(profile, cluster, cfg)
    comp, tp, emb, head, cp, ep = memo.layer_parts(
        cfg, lambda: layer_parts_s(rank, cluster, cfg, memo))
    ns = seconds_to_ns
    return (LoadCosts(cfg=cfg, layer_compute_ns=ns(comp), layer_tp_ns=ns(tp), embed_ns=ns(emb),
                      head_ns=ns(head), p2p_ns=0, layer_cp_ns=ns(cp), layer_ep_ns=ns(ep)),
            comp + tp + cp + ep)
