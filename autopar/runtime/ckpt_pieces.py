"""Which boxes of which full tensors a rank writes: a rank's held flat ranges → rectangular
pieces of the single-device tensors, each written by exactly one rank.

A ZeRO shard is a flat range [lo, hi) of a rank's local tensor (autopar.runtime.flat_shard),
and a local tensor is a slice of the full one (tensor-split rows, a slice of every block of a
fused q/k/v, padded vocabulary rows, an expert slice). A flat range of a row-major tensor is not
a rectangle in general, but it is a union of at most 2·ndim − 1 *contiguous* rectangles — fixed
leading indices, one range, full trailing dimensions (`flat_boxes`):

    shape (4, 6), flat [3, 20): row 0 cols [3, 6) | rows [1, 3) all cols | row 3 cols [0, 2)

Each local rectangle maps to one or more rectangles of the full tensor through the local →
global runs of its split dimensions (`split_runs`: one run for a plain split, one per block for
a fused q/k/v; padding rows, and the whole k/v blocks on tensor ranks > 0, have no run: rank 0
writes those). torch.distributed.checkpoint stores each rectangle as its own tensor and the
layout JSON names its box; a load under any other plan reads the boxes that overlap its own
(autopar.runtime.checkpoint). This is DCP's ChunkStorageMetadata (offsets, sizes) kept in the
project's layout, so the saved pieces of one logical tensor may come from ZeRO ranges of every
shape.

Ranks holding the same values (tensor ranks of a tensor-replicated weight, the two pipeline
stages of a tied embedding, every stage of a block called at several depths, the data-parallel
replicas when the regime keeps the tensor whole)
split its flat index range into equal parts, one per replica (`replica_part`), so every rank
writes about the same bytes and no element is written twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from autopar.runtime.params import LocalParams, ParamInfo

Box = list[tuple[int, int]]
Runs = dict[int, list[tuple[int, int, int]]]    # dim -> [(local lo, local hi, global lo)]


@dataclass(frozen=True, kw_only=True)
class Held:
    """A flat range [lo, hi) of one local parameter (graph name `name`) that this rank holds:
    its fp32 weight and elementwise optimizer states as 1-D tensors of hi − lo elements
    (`tensors`, "weight" first) and its 0-d optimizer states (`scalars`). `whole_over_data`:
    the regime keeps the tensor whole on every data-parallel replica (zero 0, the tied
    weights of zero 3), so the replicas split the writing. `param`: the tensor the
    optimizer keys the range's state by (a master piece, or the stepped parameter), where a
    load installs the state it reads (autopar.runtime.ckpt_load)."""
    name: str
    lo: int
    hi: int
    tensors: dict[str, torch.Tensor]
    scalars: dict[str, torch.Tensor]
    whole_over_data: bool
    param: torch.Tensor | None = None


def held_range(name: str, lo: int, hi: int, weight: torch.Tensor, state: dict,
               whole_over_data: bool) -> Held:
    """A Held from a flat weight piece and its optimizer state (torch's per-tensor dict)."""
    tensors = {"weight": weight.detach().reshape(-1)}
    scalars = {}
    for sname, value in sorted(state.items()):
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value))
        if value.dim() == 0:
            scalars[sname] = value.detach()
        elif value.numel() == hi - lo:
            tensors[f"optim/{sname}"] = value.detach().reshape(-1)
        else:
            raise ValueError(f"save_checkpoint: optimizer state {sname!r} of {name!r} has "
                             f"shape {tuple(value.shape)}, neither a scalar nor the parameter's "
                             f"{hi - lo} elements; only elementwise optimizer states (SGD, Adam, "
                             f"AdamW) can be sharded and resharded")
    return Held(name=name, lo=lo, hi=hi, tensors=tensors, scalars=scalars,
                whole_over_data=whole_over_data, param=weight)


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[int, int, Box]]:
    """The flat range [lo, hi) of a row-major `shape` as contiguous rectangles
    (flat lo, flat hi, box) in order (module docstring)."""
    if lo >= hi:
        return []
    if not shape:
        return [(lo, hi, [])]
    inner = 1
    for n in shape[1:]:
        inner *= n
    rest = list(shape[1:])
    first, last = -(-lo // inner), hi // inner       # the rows wholly inside [lo, hi)
    if first > last:                                  # inside one row
        r = lo // inner
        return [(a + r * inner, b + r * inner, [(r, r + 1)] + box)
                for a, b, box in flat_boxes(tuple(rest), lo - r * inner, hi - r * inner)]
    out = []
    if lo < first * inner:
        r = first - 1
        out += [(a + r * inner, b + r * inner, [(r, r + 1)] + box)
                for a, b, box in flat_boxes(tuple(rest), lo - r * inner, inner)]
    if first < last:
        out.append((first * inner, last * inner, [(first, last)] + [(0, n) for n in rest]))
    if hi > last * inner:
        out += [(a + last * inner, b + last * inner, [(last, last + 1)] + box)
                for a, b, box in flat_boxes(tuple(rest), 0, hi - last * inner)]
    return out


def split_runs(name: str, info: ParamInfo, params: LocalParams | None, tp_rank: int,
               t: int, *, reading: bool = False) -> Runs:
    """Local → global index runs of each split dimension of `name`'s local tensor (module
    docstring); dimensions not listed are whole. Rows without a run are not written here.
    reading: the runs a load fills — the rows every tensor rank holds alike on every rank
    (padding rows still have none)."""
    runs: Runs = {}
    split = params.splits.get(name) if params is not None else None
    if info.split_dim is not None and (info.expert or split is None):
        runs[info.split_dim] = [(0, info.stop - info.start, info.start)]
    if split is not None:
        ps, full = split
        out, off = [], 0
        for k, (gstart, n) in enumerate(ps.ranges(tp_rank, t)):
            real = max(0, min(n, full - gstart))          # rows past the end are padding
            whole = not ps.padded and ps.is_whole(k)      # the same on every tensor rank
            if real and (reading or not whole or tp_rank == 0):
                out.append((off, off + real, gstart))
            off += n
        runs[ps.dim] = out
    return runs


def replica_part(info: ParamInfo, groups: Any, whole_over_data: bool) -> tuple[int, int]:
    """(R, i): this rank is replica i of the R ranks holding the same values of the tensor
    (module docstring); (1, 0) for one process."""
    if groups is None:
        return 1, 0
    count, index = 1, 0
    if not info.tensor_split and groups.t > 1:
        count, index = groups.t, groups.tp_rank
    ranks = _sharing_ranks(info, groups)
    if groups.rank in ranks and len(ranks) > 1:
        count, index = count * len(ranks), index * len(ranks) + ranks.index(groups.rank)
    if whole_over_data:
        if info.expert and groups.expert_data_ranks:
            n, r = len(groups.expert_data_ranks), groups.expert_data_ranks.index(groups.rank)
        else:
            n, r = groups.d, groups.dp_rank
        count, index = count * n, index * n + r
    return count, index


def _sharing_ranks(info: ParamInfo, groups: Any) -> tuple[int, ...]:
    """The pipeline stages' ranks holding copies of a shared weight (ParamInfo.shared_with):
    the first and the last stage for a tied embedding ("embedding"), every stage for a block
    called at every depth ("pipeline"), those stages for a block some stages only hold
    ("stages:1,2", ProcessGroups.shared_ranks); () for a weight one stage holds."""
    if info.shared_with is None:
        return ()
    return groups.shared_ranks(info.shared_with)


def _part(numel: int, count: int, index: int) -> tuple[int, int]:
    size = -(-numel // count) if numel else 0
    return min(index * size, numel), min((index + 1) * size, numel)


def map_box(box: Box, runs: Runs) -> Iterator[tuple[Box, Box]]:
    """(local sub-box, global box) pairs of a local box through the split runs."""
    choices = []
    for dim, (lo, hi) in enumerate(box):
        if dim not in runs:
            choices.append([((lo, hi), (lo, hi))])
            continue
        here = []
        for llo, lhi, glo in runs[dim]:
            a, b = max(lo, llo), min(hi, lhi)
            if a < b:
                here.append(((a, b), (a - llo + glo, b - llo + glo)))
        choices.append(here)
    combos: list[tuple[Box, Box]] = [([], [])]
    for here in choices:
        combos = [(lb + [loc], gb + [glob]) for lb, gb in combos for loc, glob in here]
    yield from combos


def box_key(name: str, box: Box) -> str:
    """The DCP key of the piece `box` of the logical tensor `name`."""
    return f"{name}@[{','.join(f'{a}:{b}' for a, b in box)}]"


def write_pieces(held: Held, info: ParamInfo, local_shape: tuple[int, ...], runs: Runs,
                 part: tuple[int, int], max_elems: int
                 ) -> Iterator[tuple[str, Box, torch.Tensor]]:
    """(state name, global box, data view) of every piece this rank writes of `held`: its
    replica part of the range, cut to ≤ max_elems elements (the staging bound), as rectangles
    of the full tensor. Views, never copies: the writer (ckpt_packs.Pack.chunks) copies one
    strided or device piece at a time."""
    numel = 1
    for n in local_shape:
        numel *= n
    lo, hi = _part(numel, *part)
    lo, hi = max(lo, held.lo), min(hi, held.hi)
    step = max(1, int(max_elems))
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        for flo, fhi, box in flat_boxes(tuple(local_shape), a, b):
            for sname, flat in held.tensors.items():
                piece = flat[flo - held.lo:fhi - held.lo].view([h - l for l, h in box])
                for sub, gbox in map_box(box, runs):
                    view = piece
                    for dim, ((slo, shi), (blo, _)) in enumerate(zip(sub, box)):
                        view = view.narrow(dim, slo - blo, shi - slo)
                    yield sname, gbox, view


def sharded_entries(held: list[Held], params: LocalParams, groups: Any
                    ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """({DCP key: data view}, layout records) of every piece this rank writes of what it holds
    (module docstring). Pieces are cut to ≤ 1/16 of the rank's held elements, so the writer,
    which copies one piece at a time where it must, stages at most that much. A logical tensor's 0-d
    optimizer states (Adam's step) are written by the rank writing its first element."""
    t, tp_rank = (groups.t, groups.tp_rank) if groups is not None else (1, 0)
    total = sum((h.hi - h.lo) * len(h.tensors) for h in held)
    max_elems = max(4096, total // 16)
    state_dict: dict[str, torch.Tensor] = {}
    records: list[dict] = []
    for h in held:
        info = params.infos[h.name]
        shape = tuple(params.tensors[h.name].shape)
        runs = split_runs(h.name, info, params, tp_rank, t)
        origin = False
        for sname, box, view in write_pieces(h, info, shape, runs,
                                             replica_part(info, groups, h.whole_over_data),
                                             max_elems):
            name = info.key if sname == "weight" else f"{sname}/{info.key}"
            key = box_key(name, box)
            state_dict[key] = view
            records.append({"name": name, "global_shape": list(info.global_shape),
                            "split_dim": None, "dtype": str(view.dtype),
                            "piece": [[list(b) for b in box], key]})
            origin = origin or (sname == "weight" and all(lo == 0 for lo, _ in box))
        for sname, value in h.scalars.items() if origin else ():
            name = f"optim/{sname}/{info.key}"
            state_dict[name] = value.detach().reshape(()).cpu().clone()
            records.append({"name": name, "global_shape": [], "split_dim": None,
                            "dtype": str(value.dtype), "piece": [None, None, name]})
    return state_dict, records
