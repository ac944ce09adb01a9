"""Uneven routing in the cost model: the most loaded expert rank sets the pace.

Experts are never evenly loaded. Under expert parallelism (ep > 1) rank e holds experts
[e·E/ep, (e+1)·E/ep) of every MoE layer and computes every row routed to them, so the layer
waits for the rank whose experts drew the most rows: its grouped GEMMs run `rank_factor` times
the mean rank's rows, and its dispatch / combine all-to-alls receive and send as many (the
exchange finishes with its busiest rank). With ep = 1 every rank runs its own tokens through all
experts: the rows per rank are the same whatever the routing (factor 1). Megatron-Core and
DeepSpeed-MoE report the same straggler (the capacity factor and the aux loss fight it).

The imbalance is given one of two ways (`ExpertLoad`):
- `factor` (the user's `moe_imbalance=`, `--moe-imbalance`): the most loaded expert's rows over
  the mean expert's. A rank of n = E/ep experts holds that expert and n − 1 others, taken as
  loaded at the mean, so its rows are (factor + n − 1)/n of the mean rank's:
  rank_factor = 1 + (factor − 1)·ep/E — the expert's own factor at ep = E, 1 at ep = 1.
- `counts` (`measure_expert_load`, autopar/expert_load.py: a batch of the user's data through
  the routers on one device): the rows routed to each expert of each MoE layer; rank_factor is
  the mean over layers of the largest rank's rows (contiguous blocks of E/ep experts, as
  autopar/runtime/experts.py places them) over the mean rank's.

Both are priced as pure functions of the profile and the configuration: `expert_gemm_extra_s`
(the rank's expert GEMMs beyond the balanced price: forward, twice for backward, once more under
full or op recompute) and `alltoall_factor` (the all-to-alls' multiplier). cost/model.py calls them
from `load_parts_s` and `expert_comm_s`. Neither has a fitted constant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from autopar.cost.config import BLOCK_CHECKPOINTED


@dataclass(frozen=True, kw_only=True)
class ExpertLoad:
    """How unevenly a mixture of experts routes its tokens (module docstring).

    factor: the most loaded expert's rows over the mean expert's (>= 1), used when no counts.
    counts: measured rows per expert, one tuple per MoE layer (all of one length E).
    source: how it was obtained, for the plan's explanation.
    """
    factor: float = 1.0
    counts: tuple[tuple[float, ...], ...] = ()
    source: str = "given"

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor)
                and self.factor >= 1.0):
            raise ValueError(f"moe_imbalance={self.factor!r}: the most loaded expert's tokens "
                             f"over the mean expert's, a finite number >= 1 (1: balanced); "
                             f"pass e.g. moe_imbalance=1.3")
        sizes = {len(layer) for layer in self.counts}
        if len(sizes) > 1 or 0 in sizes or any(x < 0 for layer in self.counts for x in layer):
            raise ValueError(f"ExpertLoad.counts: {len(self.counts)} layers of sizes "
                             f"{sorted(sizes)}: give one tuple of non-negative rows per "
                             f"expert for each MoE layer, all of one length (the experts)")

    @property
    def expert_factor(self) -> float:
        """The most loaded expert's rows over the mean expert's (mean over layers)."""
        if not self.counts:
            return float(self.factor)
        return _mean(max(layer) / _mean(layer) for layer in self.counts if sum(layer))

    def rank_factor(self, ep: int, experts: int) -> float:
        """The most loaded of ep expert ranks' rows over the mean rank's (1 at ep = 1)."""
        if ep <= 1 or experts <= 0:
            return 1.0
        if not self.counts:
            return 1.0 + (float(self.factor) - 1.0) * min(1.0, ep / experts)
        out = []
        for layer in self.counts:
            if len(layer) % ep:
                raise ValueError(f"ExpertLoad: ep={ep} does not divide the {len(layer)} "
                                 f"experts measured per layer; measure the model planned")
            n = len(layer) // ep
            ranks = [sum(layer[r * n:(r + 1) * n]) for r in range(ep)]
            if sum(ranks):
                out.append(max(ranks) / _mean(ranks))
        return _mean(out) if out else 1.0

    def describe(self, ep: int, experts: int) -> str:
        """One line for the plan's explanation: the factor at ep and where it came from."""
        where = ("given (moe_imbalance)" if not self.counts else self.source)
        degrees = sorted({1, 2, 4, 8, ep} & set(range(1, experts + 1))
                         if experts else {ep})
        at = ", ".join(f"{self.rank_factor(e, experts):.2f}× at ep={e}" for e in degrees
                       if experts % e == 0)
        return (f"expert load imbalance: the most loaded expert gets "
                f"{self.expert_factor:.2f}× the mean expert's tokens, {where}; the most loaded "
                f"expert rank {at} — its expert GEMMs and all-to-alls priced at that factor "
                f"(this plan: ep={ep}, {self.rank_factor(ep, experts):.2f}×)")


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 1.0


def _rank_factor(profile: Any, ep: int) -> float:
    load = profile.expert_load
    return 1.0 if load is None else load.rank_factor(ep, profile.block.experts)


def expert_gemm_extra_s(profile: Any, ep: int, recompute: str,
                        gemm_s: Callable[[Any], float]) -> float:
    """Seconds per layer per micro-batch the most loaded expert rank spends on its expert
    GEMMs beyond the balanced price: (rank_factor − 1) × the block's expert GEMMs (forward
    `gemm_s(g)` each; backward twice that, once more when the block is checkpointed whole: full
    and op recompute (op keeps no expert GEMM's output))."""
    if profile.expert_load is None or ep <= 1:   # the dense / balanced fast path
        return 0.0
    f = _rank_factor(profile, ep)
    fwd = sum(gemm_s(g) for g in profile.block.gemms if g.expert)
    return (f - 1.0) * fwd * (4 if recompute in BLOCK_CHECKPOINTED else 3)


def alltoall_factor(profile: Any, ep: int) -> float:
    """What the experts' all-to-alls take over the balanced price: the busiest rank receives
    (dispatch) and sends back (combine) rank_factor times the mean rank's rows."""
    return _rank_factor(profile, ep)


def with_expert_load(profile: Any, load: "ExpertLoad | float | None") -> Any:
    """`profile` with its experts' load (a factor is `ExpertLoad(factor=...)`); None: as is.
    Refuses an imbalance for a model without experts (nothing it could change)."""
    if load is None:
        return profile
    if not isinstance(load, ExpertLoad):
        load = ExpertLoad(factor=load)
    if not profile.block.experts:
        raise ValueError(f"moe_imbalance={load.expert_factor:g}: the model has no mixture of "
                         f"experts (no grouped matmul over 3-D expert weights) whose load it "
                         f"could describe; drop moe_imbalance")
    if not any(g.expert for g in profile.block.gemms):
        raise ValueError(f"moe_imbalance={load.expert_factor:g}: the model's experts run every "
                         f"token (batched matmuls over 3-D expert weights), so their load is "
                         f"even whatever the router picks; drop moe_imbalance")
    return replace(profile, expert_load=load)
