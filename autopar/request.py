"""The planning request as data: what the caller pinned (`Pins`) and what it asks for
(`PlanRequest`: GPUs, batch, cluster, token budget, precision). Frozen and keyword-only,
validated once on construction by autopar/rules.py: each bad value is one ValueError line
naming the value, the rule and the fix.

Every way into the planner builds one: `parallelize` (autopar/api.py), the CLI's plan / build /
timeline (autopar/cli.py), `autopar tune` (autopar/tuning.py), `autopar scale`
(autopar/scaling.py) and launch's re-plan for another world size (autopar/launch.py); the
solver takes the pins as they are (`cost.solver.solve(..., **pins.as_dict())`), and a saved
program records them (build.json's "pins").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autopar.rules import (context_split_refusal, cp_attention_refusal, degrees_refusal,
                           expert_degree_refusal, knob_refusal, recompute_refusal,
                           schedule_refusal, zero_refusal)


@dataclass(frozen=True, kw_only=True)
class Pins:
    """The knobs the caller fixed; None leaves a knob to the solver. Degrees: t (tensor),
    c (context), ep (expert), p (pipeline), d (data), v (chunks per pipeline rank); the
    micro-batch size, schedule, recompute, ZeRO level, sequence parallelism, the interleaved
    schedules' micro-batch group N and the context attention method (autopar.rules)."""
    t: int | None = None
    c: int | None = None
    cp_attention: str | None = None
    ep: int | None = None
    p: int | None = None
    d: int | None = None
    v: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    zero: int | None = None
    sequence_parallel: bool | None = None
    microbatch_group: int | None = None

    def __post_init__(self) -> None:
        for f in fields(Pins):
            why = knob_refusal(f.name, getattr(self, f.name))
            if why:
                raise ValueError(why)
        # (ep runs with every ZeRO level: ZeRO-2/3 shard the experts over the expert-data group)
        why = (schedule_refusal(self.schedule, self.v, self.microbatch_group)
               or recompute_refusal(self.recompute, self.schedule)
               or zero_refusal(self.zero, self.schedule))
        if why is None and self.ep is not None and self.d is not None:
            why = expert_degree_refusal(self.ep, self.c or 1, self.d)
        why = why or cp_attention_refusal(self.cp_attention, self.c)
        if why:
            raise ValueError(why)

    def as_dict(self) -> dict[str, Any]:
        """The pinned knobs only (what build.json records and the solver takes)."""
        return {f.name: getattr(self, f.name) for f in fields(Pins)
                if getattr(self, f.name) is not None}

    @classmethod
    def of(cls, pins: "Pins | dict[str, Any] | None", where: str = "pins") -> "Pins":
        """`pins` as Pins: a dict's unknown key is one line naming the knobs there are."""
        if isinstance(pins, Pins):
            return pins
        pins = dict(pins or {})
        names = [f.name for f in fields(Pins)]
        unknown = sorted(set(pins) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown knob(s) {unknown}; the knobs are {names}")
        return cls(**pins)

    def without(self, *names: str) -> "Pins":
        """These pins with `names` left to the solver (launch's re-plan drops the degrees)."""
        return Pins(**{k: x for k, x in self.as_dict().items() if k not in names})


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One planning request. gpus: ranks to plan for (t·c·p·d). global_batch_size: sequences
    per optimizer step (None: the example batch, or chosen under `tokens`). cluster: a preset
    name, a cluster file or a `Cluster`. tokens: plan for the shortest time to train this
    many tokens (the batch chosen too, by the critical batch `critical_batch_tokens`; None:
    estimated from the model). precision: the GEMMs' price (autopar.rules.PLAN_PRECISIONS;
    None: bf16). name: the model's name in the plan. documents: packed documents
    (autopar/documents.py: position ids and a block mask as inputs, attention priced at the
    mask's tiles). moe_imbalance: expert load imbalance (cost/imbalance.py)."""
    gpus: int
    pins: Pins = field(default_factory=Pins)
    global_batch_size: int | None = None
    cluster: Any = "dgx-a100-80gb"
    tokens: float | None = None
    critical_batch_tokens: float | None = None
    precision: str | None = None
    name: str | None = None
    documents: Any = None       # autopar.PackedDocuments: the rows are packed documents
    moe_imbalance: Any = None   # the hot expert's load over the mean, or an ExpertLoad

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus={self.gpus!r} must be a positive integer (the number of "
                             f"GPUs / torchrun ranks to plan for)")
        if not isinstance(self.pins, Pins):
            object.__setattr__(self, "pins", Pins.of(self.pins))
        why = (knob_refusal("global_batch_size", self.global_batch_size)
               or knob_refusal("precision", self.precision)
               or degrees_refusal(self.gpus, t=self.pins.t, c=self.pins.c, p=self.pins.p,
                                  d=self.pins.d))
        if why is None and self.critical_batch_tokens is not None and self.tokens is None:
            why = (f"critical_batch_tokens={self.critical_batch_tokens!r} without tokens=; "
                   f"pass tokens=<training tokens> to plan for the time to train, or drop "
                   f"critical_batch_tokens")
        if why:
            raise ValueError(why)

    def check_sequence(self, seq_len: int) -> None:
        """The pins against the example's sequence length (known once the inputs are)."""
        why = context_split_refusal(seq_len, self.pins.c)
        if why:
            raise ValueError(why)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["pins"] = self.pins.as_dict()
        return out
