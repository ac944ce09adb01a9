"""The tensor-parallel layouts, decided (the analysis half of passes/tensor_parallel.py).

`propagate_sharding(gm, t)` gives every node a layout — Replicate, Shard(dim, blocks), Whole or
Partial — with the rules of `passes/sharding/`, and every parameter its split. The Megatron
pattern is found, not named: each weight matmul with a replicated input is a column-parallel
candidate; a candidate stays split only if its output can be carried (through elementwise ops,
head reshapes, rotary arithmetic, attention, ...) to matmuls that contract over the split
(row-parallel, Partial) or to a cross-entropy (vocab-parallel) without gathering it back.
Everything else falls back to replicated (`Fallback`), and is reported (`TPInfo`, stored as
gm.meta[K.TP_INFO]). The rewrite that reads these layouts: passes/tensor_parallel.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autopar.cost.hardware import get_cluster
from autopar.passes import meta as K
from autopar.passes import sharding as S
from autopar.passes.sharding import Replicate, Shard, is_split, packet, shape, source_line
from autopar.runtime import shard as shard_rt


_MAX_ROUNDS = 10_000


class PropagationError(RuntimeError):
    """Sharding propagation settles on no layout: a conflict whose origins are all off already
    (it loops) or no fixed point within _MAX_ROUNDS — a graph the rules cannot settle."""


@dataclass(frozen=True, kw_only=True)
class Fallback:
    """A column candidate kept replicated, and why (shown by plan.explain())."""
    node: str
    reason: str
    where: str
    indivisible: bool = False


@dataclass(kw_only=True)
class TPInfo:
    """What propagate_sharding decided; stored as gm.meta[K.TP_INFO]."""
    t: int
    sequence_parallel: bool
    params: dict[str, shard_rt.ParamSplit]           # get_attr target -> split (split ones only)
    column: list[str] = field(default_factory=list)  # column-parallel matmuls
    row: list[str] = field(default_factory=list)     # row-parallel matmuls
    vocab: list[str] = field(default_factory=list)   # vocab-parallel embedding / cross-entropy
    fallbacks: list[Fallback] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # gathers the pass had to insert

    def summary(self) -> str:
        lines = [f"tensor parallel t={self.t}{' + sequence parallel' if self.sequence_parallel else ''}: "
                 f"{len(self.column)} column, {len(self.row)} row, {len(self.vocab)} vocab-parallel; "
                 f"{len(self.params)} parameters split"]
        lines += [f"  replicated: {f.node}: {f.reason} ({f.where})" for f in self.fallbacks]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def propagate_sharding(gm: fx.GraphModule, t: int, *, sequence_parallel: bool = False,
                       vocab_multiple: int = 128, strict: bool = True,
                       cluster: Any = "dgx-a100-80gb") -> fx.GraphModule:
    """Decide the tensor-parallel layout of every value of `gm` for degree `t`.

    Requires: `gm` from `capture` (ATen training IR with node.meta[K.VAL]).
    Guarantees: every node has meta[K.TP_LAYOUT] (Replicate | Shard | Partial | Whole, a tuple for
      multi-output nodes); split get_attr nodes have meta[K.TP_PARAM] (a ParamSplit); nodes the
      rewrite changes have meta[K.TP_ROLE] ('column' | 'row' | 'vocab_embedding' | 'vocab_ce' |
      'partial_mean': a mean over the split dim, each rank's summand | 'split_norm': a
      layer/RMS norm over the split dim, its statistics all-reduced);
      meta[K.TP_CONVERT] = {input name: layout} on edges that need a collective or a slice;
      gm.meta[K.TP_INFO] is a TPInfo. Writes only meta; the graph is unchanged.
    A split value the graph returns (logits of a model without a loss) stays column-parallel
      and is all-gathered at the output only when that pays on `cluster` (its machine balance,
      sustained GEMM FLOP/s over intra-node bytes/s; see Propagator._gather_output); otherwise
      its origins fall back to replicated. Either way the choice is in TPInfo.notes.
    Errors: ValueError for a bad t, a sequence length not divisible by t under sequence
      parallelism, or (strict) a head / hidden size that cannot be split under this t, naming
      the node and the user's source line; PropagationError when no layout settles.
    """
    check_degree(t)
    seq_len = _seq_len(gm) if sequence_parallel else None
    if sequence_parallel and not sequence_parallel_fits(gm, t):
        raise ValueError(f"sequence_parallel with t={t}: the sequence length {seq_len} (dim 1 of "
                         f"the first input) must be divisible by t; pad the sequence to a "
                         f"multiple of {t} or turn sequence parallelism off")
    prop, fallbacks = _settle(gm, t, sequence_parallel=sequence_parallel, seq_len=seq_len,
                              vocab_multiple=vocab_multiple, balance=_flop_per_byte(cluster))
    info = _write_meta(gm, prop, t, sequence_parallel, fallbacks)
    if strict and t > 1:
        _check_lost_regions(gm, info)
    gm.meta[K.TP_INFO] = info
    return gm


def _settle(gm: fx.GraphModule, t: int, *, sequence_parallel: bool, seq_len: int | None,
            vocab_multiple: int, balance: float) -> tuple[S.Propagator, list[Fallback]]:
    """The driver's fixed point: run the Propagator, re-seed a candidate on Refine (finer
    blocks, or blocks held whole — tentatively, undone if they conflict later), turn the
    origins of a Conflict off (each a Fallback with the reason), until a run completes."""
    off: set[str] = set()
    refine: dict[str, tuple[int, ...]] = {}
    whole: dict[str, tuple[bool, ...]] = {}  # mixed projections: the seed blocks held whole
    fallbacks: dict[str, Fallback] = {}
    tentative: dict[str, S.Conflict] = {}   # refined origins and the conflict they replaced
    for _ in range(_MAX_ROUNDS):
        prop = S.Propagator(gm, t, off=off, refine=refine, sequence_parallel=sequence_parallel,
                            seq_len=seq_len, vocab_multiple=vocab_multiple,
                            flop_per_byte=balance, whole=whole)
        try:
            prop.run()
            break
        except S.Refine as r:
            refine[r.origin] = r.blocks
            if r.whole:
                whole[r.origin] = r.whole
            if r.fallback is not None and not (r.whole and r.origin in tentative):
                tentative[r.origin] = r.fallback   # (a second block held whole: the first's)
        except S.Conflict as c:
            undo = [o for o in c.origins if o in tentative]
            for o in undo:  # the tentative refinement did not hold: report the original
                first = tentative.pop(o)
                del refine[o]
                whole.pop(o, None)
                fallbacks[o] = Fallback(node=o, reason=first.reason,
                                        where=source_line(first.node),
                                        indivisible=first.indivisible)
                off.add(o)
            if undo:
                continue
            if not c.origins - off:
                raise PropagationError(f"tensor_parallel: propagation loops at {c.node.name}: "
                                       f"{c.reason} ({source_line(c.node)})") from None
            for o in c.origins - off:
                fallbacks[o] = Fallback(node=o, reason=c.reason, where=source_line(c.node),
                                        indivisible=c.indivisible)
            off |= c.origins
    else:
        raise PropagationError("tensor_parallel: sharding propagation did not converge")
    return prop, list(fallbacks.values())


def _flop_per_byte(cluster: Any) -> float:
    """Machine balance: the GEMM FLOPs one byte of tensor-parallel communication costs
    (sustained peak / intra-node collective bandwidth; A100: 0.8·312e12 / 231e9 ≈ 1080)."""
    c = get_cluster(cluster)
    return c.peak_flops * c.gemm_max_efficiency / c.intra_node_bandwidth_Bps


def check_degree(t: Any) -> None:
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ValueError(f"tensor_parallel: t={t!r} must be a positive integer (the number of "
                         f"tensor-parallel ranks)")


def sequence_parallel_fits(gm: fx.GraphModule, t: int) -> bool:
    """Whether sequence parallelism can split gm's sequence (dim 1 of the first input) t ways."""
    seq_len = _seq_len(gm)
    return seq_len is not None and seq_len % t == 0


def _seq_len(gm: fx.GraphModule) -> int | None:
    """Dim 1 of the first input when it is token ids; None for pixels or features (a
    floating-point first input: no sequence to split, so no sequence parallelism)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and shape(node) and len(shape(node)) >= 2:
            return None if node.meta[K.VAL].is_floating_point() else shape(node)[1]
    return None


def _write_meta(gm: fx.GraphModule, prop: S.Propagator, t: int, sp: bool,
                fallbacks: list[Fallback]) -> TPInfo:
    info = TPInfo(t=t, sequence_parallel=sp, params={}, fallbacks=fallbacks, notes=prop.notes)
    for node in gm.graph.nodes:
        node.meta[K.TP_LAYOUT] = prop.layout.get(node, Replicate())
        node.meta.pop(K.TP_ROLE, None)
        node.meta.pop(K.TP_PARAM, None)
        conv = prop.convert.get(node)
        node.meta[K.TP_CONVERT] = {a.name: lay for a, lay in conv.items()} if conv else {}
        role = prop.role.get(node)
        if role:
            node.meta[K.TP_ROLE] = role
            listed = {"column": info.column, "row": info.row, "vocab_embedding": info.vocab,
                      "vocab_ce": info.vocab}.get(role)
            if listed is not None:
                listed.append(node.name)
        lay = node.meta[K.TP_LAYOUT]
        if node.op == "get_attr" and isinstance(lay, Shard):
            split = shard_rt.ParamSplit(dim=lay.dim, blocks=lay.blocks, padded=lay.padded,
                                        whole=lay.whole)
            node.meta[K.TP_PARAM] = split
            info.params[node.target] = split
    return info


def _check_lost_regions(gm: fx.GraphModule, info: TPInfo) -> None:
    """Raise `lost_region_refusal`'s reason, with the fix, where it has one."""
    why = lost_region_refusal(gm, info)
    if why is not None:
        raise ValueError(f"tensor_parallel: {why}; fix: pick a t that divides the number of "
                         f"heads and the hidden/FFN sizes, or leave t unpinned so the planner "
                         f"chooses one")


def lost_region_refusal(gm: fx.GraphModule, info: TPInfo) -> str | None:
    """Why the pass refuses t (strict: what building a program raises), or None: a candidate
    that fell back for divisibility is refused unless its replicated output still feeds split
    work before the next weight matmul (e.g. k/v heads replicated when t > kv_heads: the
    attention stays split by query heads). The planner's analysis (passes/tp_cost.py) asks
    the same, so it never offers a t the build refuses."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for fb in info.fallbacks:
        if not fb.indivisible or fb.node not in nodes:
            continue
        if not _feeds_split_work(nodes[fb.node]):
            return (f"cannot split {fb.node} across t={info.t} ranks: {fb.reason} "
                    f"(at {fb.where})")
    return None


def _feeds_split_work(start: fx.Node) -> bool:
    return S.reaches(
        start, lambda n: is_split(n.meta.get(K.TP_LAYOUT)) and n.op != "output",
        lambda n: not (n.meta.get(K.TP_ROLE) or packet(n) in S.MATMUL_OPS or S.is_grouped_mm(n)))
