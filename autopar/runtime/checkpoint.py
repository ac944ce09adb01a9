"""Sharded, atomic, plan-independent checkpoints on torch.distributed.checkpoint (DCP).

Format. Every parameter (and every optimizer-state tensor, which follows its parameter's
slicing) is stored as pieces of the *logically full* tensor, each written by one rank, each a
box of the full tensor: in a program's checkpoint (below) inside the rank's raw byte pack
(a DCP bytes item f"pack/{rank}/{k}", autopar.runtime.ckpt_packs; layout piece [box, pack key,
byte offset], the piece's bytes contiguous in the pack; checkpoints written before 2026-11-26
hold a DCP tensor item per piece, key f"{key}@[lo:hi,...]", piece [box, dcp_key], or uint8
tensor packs; all load); in `save_checkpoint`'s (a tensor
per rank) a tensor-split piece under f"{key}@{dim}:{start}-{stop}" (rows [start, stop) of split
dim `dim`, vocabulary padding dropped; layout piece [start, stop, dcp_key]), a replicated tensor
under `key`, written by data-parallel rank 0 (tensor rank 0 for tensor-replicated tensors, the
first pipeline stage for tied embedding copies). Optimizer states are stored under
f"optim/{name}/{key}..." (scalar states such as Adam's `step` as 0-d tensors). Beside the DCP
files, `autopar_layout.json` lists every logical tensor's full shape, dtype and pieces, the
step, the plan and every file's size and CRC-32; it is written last and marks the checkpoint
complete.

Loading under another plan (other t, c, p, d, v, ep, zero): each rank reads the parts of the
saved pieces that overlap what it holds (autopar.runtime.ckpt_load: byte ranges of the DCP
items, in bounded spans) — a program's load straight into its regime's shard state, never
building the unsharded local tensors; `load_checkpoint` into the caller's local tensors. Both
piece forms load, so checkpoints written before sharded saves still load.

Atomicity (autopar.runtime.ckpt_store): the DCP files and the layout go to `path.tmp-<uuid>`;
once every rank's files are complete rank 0 renames it to `path.ckpt-<uuid>` and atomically
repoints the symlink `path` at it (os.replace of a fresh link), then deletes all but the `keep`
newest versions and any leftovers. A crash at any moment leaves `path` pointing at a complete
checkpoint (the old one until the replace). A load checks the files' sizes and checksums and
falls back to an older kept version when the newest is damaged.

A training program's checkpoint (`save_program_checkpoint` / `load_program_checkpoint`, what
Runner.save_checkpoint / load_checkpoint call): every local parameter under its user key, its
fp32 value (the masters under bf16) and the optimizer state, from what the program's optimizer
regime holds (`Regime.shard_state()`: ZeRO segments, or whole tensors the replicas split
between them) — nothing is gathered; autopar.runtime.ckpt_pieces turns flat ranges into boxes
(fused q/k/v slices, padded rows and expert slices included) and bounds each piece to 1/16 of
the rank's shard (what a piece that is not contiguous host memory is copied through, one at a
time). Synchronous (the pieces written straight from the regime's memory into the rank's pack)
or asynchronous (async_save: a shared host copy, written by a background process of the rank:
autopar.runtime.ckpt_writer; the same pack, byte for byte).

Safety: loading unpickles nothing but DCP's metadata, through an unpickler that accepts only
DCP's own metadata classes, dtypes and sizes, and each item's tensor description, with
torch.load(weights_only=True) (its data skipped, then read as raw bytes); our layout is JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autopar.runtime.ckpt_load import (dtype_of, load_into_shards, piece_box, read_boxes,
                                       volume)
from autopar.runtime.ckpt_packs import Pack, PackWriter, packs_of
from autopar.runtime.ckpt_pieces import sharded_entries
from autopar.runtime.ckpt_store import (LAYOUT_FILE, ChecksumFileSystem, adopt_copy,
                                        checkpoint_group, choose_version, commit,
                                        file_records, own_files)
from autopar.runtime.ckpt_writer import WRITER
from autopar.runtime.dist import peer_guard
from autopar.runtime.optim_state import state_value
from autopar.runtime.params import LocalParams, ParamInfo
from autopar.runtime.shard import gather_unshard, local_shard

PLAN_FILE = "plan.json"
FORMAT = "autopar-checkpoint-1"
PACK_BYTES = 1 << 40     # a pack's size bound: one pack a rank in practice (a raw pack is
#                          only ever read by byte range, never whole; one pack keeps the staged
#                          buffer's page alignment at file offset 0: ckpt_packs.PackFile)

Tensors = dict[str, tuple[torch.Tensor, ParamInfo]]
OptimState = dict[str, dict[str, torch.Tensor]]


# ---- save ----------------------------------------------------------------------------------

def _writes(info: ParamInfo, groups: Any) -> bool:
    """Whether this rank is the one that writes `info`'s piece (see module docstring)."""
    if groups is None:
        return True
    # experts: the first expert group's ranks (c·d ranks dp_rank < ep) each write their slice
    first = groups.dp_rank < getattr(groups, "ep", 1) if info.expert else groups.dp_rank == 0
    return (first and (info.tensor_split or groups.tp_rank == 0)
            and (info.shared_with is None or groups.pp_rank == info.first_holder))


def _piece(name: str, local: torch.Tensor, info: ParamInfo) -> tuple[str, torch.Tensor, dict]:
    """(DCP key, real data, layout record) of one local tensor."""
    if info.split_dim is None:
        if tuple(local.shape) != tuple(info.global_shape):
            raise ValueError(f"save_checkpoint: {name!r} has local shape {tuple(local.shape)} "
                             f"but ParamInfo says it is replicated with full shape "
                             f"{tuple(info.global_shape)}; set split_dim/start/stop for a shard")
        return name, local, {"start": None, "stop": None, "dcp_key": name}
    dcp_key = f"{name}@{info.split_dim}:{info.start}-{info.stop}"
    return dcp_key, info.real_part(local), {"start": info.start, "stop": info.stop,
                                            "dcp_key": dcp_key}


def _record(name: str, data: torch.Tensor, info: ParamInfo | None) -> dict:
    return {"name": name, "global_shape": list(info.global_shape) if info else [],
            "split_dim": info.split_dim if info else None, "dtype": str(data.dtype)}


def _local_entries(tensors: Tensors, optimizer_state: OptimState | None, groups: Any
                   ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    state_dict: dict[str, torch.Tensor] = {}
    records: list[dict] = []
    for key, (local, info) in tensors.items():
        if info.key != key:
            raise ValueError(f"save_checkpoint: tensors[{key!r}] carries ParamInfo.key="
                             f"{info.key!r}; key the dict by each tensor's ParamInfo.key")
        if not _writes(info, groups):
            continue
        items = [(key, local, info)]
        for sname, value in (optimizer_state or {}).get(key, {}).items():
            oname = f"optim/{sname}/{key}"
            if value.dim() == 0:
                items.append((oname, value.reshape(()), None))
            elif tuple(value.shape) == tuple(local.shape):
                items.append((oname, value, info))
            else:
                raise ValueError(
                    f"save_checkpoint: optimizer state {sname!r} of {key!r} has shape "
                    f"{tuple(value.shape)}, neither a scalar nor the parameter's local shape "
                    f"{tuple(local.shape)}; only elementwise optimizer states can be resharded")
        for name, value, vinfo in items:
            if vinfo is None:
                dcp_key, data, piece = name, value, {"start": None, "stop": None,
                                                     "dcp_key": name}
            else:
                dcp_key, data, piece = _piece(name, value, vinfo)
            state_dict[dcp_key] = data.detach().contiguous().clone()
            records.append({**_record(name, data, vinfo),
                            "piece": [piece["start"], piece["stop"], piece["dcp_key"]]})
    return state_dict, records


def _merge_layout(all_records: list[list[dict]], step: int, plan_json: str,
                  user_state: dict | None = None) -> dict:
    tensors: dict[str, dict] = {}
    seen: dict[str, set[str]] = {}
    for records in all_records:
        for r in records:
            entry = tensors.setdefault(r["name"], {
                "global_shape": r["global_shape"], "split_dim": r["split_dim"],
                "dtype": r["dtype"], "pieces": []})
            if entry["global_shape"] != r["global_shape"] or entry["split_dim"] != r["split_dim"]:
                raise ValueError(f"save_checkpoint: ranks disagree on {r['name']!r}: full shape "
                                 f"{entry['global_shape']} vs {r['global_shape']}, split_dim "
                                 f"{entry['split_dim']} vs {r['split_dim']}; their ParamInfos "
                                 f"must describe the same full tensor")
            key = json.dumps(r["piece"][1:] if isinstance(r["piece"][0], list)
                             else r["piece"][-1])
            if key not in seen.setdefault(r["name"], set()):
                seen[r["name"]].add(key)
                entry["pieces"].append(r["piece"])
    return {"format": FORMAT, "step": int(step), "plan": plan_json,
            "user_state": user_state or {}, "byteorder": sys.byteorder, "tensors": tensors}


def _check_coverage(layout: dict) -> None:
    """Every sharded tensor's boxes add up to the whole tensor (they are disjoint by
    construction: ckpt_pieces writes each element on one rank)."""
    for name, entry in layout["tensors"].items():
        if not entry["pieces"] or not all(isinstance(p[0], list) for p in entry["pieces"]):
            continue
        have = sum(volume(p[0]) for p in entry["pieces"])
        if have != volume([(0, n) for n in entry["global_shape"]]):
            raise ValueError(f"save_checkpoint: the ranks wrote {have} elements of {name!r} "
                             f"of shape {entry['global_shape']}; a rank's shard description "
                             f"is wrong (autopar.runtime.ckpt_pieces)")


def _packed(record: dict, where: dict[str, tuple[str, int]]) -> dict:
    """`record` with its piece moved into a pack: [box, pack key, byte offset]."""
    piece = record["piece"]
    pack, offset = where[piece[-1]]
    box = piece_box(record["global_shape"], record["split_dim"], piece)
    return {**record, "piece": [[list(b) for b in box], pack, offset]}


def _shared_uid(groups: Any) -> str:
    uid = [uuid.uuid4().hex]
    if groups is not None and groups.world_size > 1:
        dist.broadcast_object_list(uid, src=0, group=groups.world)
    return uid[0]


def save_checkpoint(path: str | os.PathLike, tensors: Tensors,
                    optimizer_state: OptimState | None, step: int, groups: Any,
                    plan_json: str = "{}", user_state: dict | None = None) -> None:
    """Save this rank's tensors (+ optimizer state, step, plan) atomically to `path`.

    tensors: {ParamInfo.key: (local tensor, ParamInfo)}; optimizer_state: {ParamInfo.key:
    {state name: tensor shaped like the local tensor, or 0-d}} (see `optimizer_state_by_key`;
    ZeroOptimizer.gathered_state()). groups: ProcessGroups, or None for one process.
    user_state: JSON-serialisable state of the training loop (e.g. the data's read position),
    rank 0's stored in the layout and committed with the tensors (`read_user_state`).
    Collective over groups.world: every rank calls it with the same path.
    """
    _check_json(user_state)
    state_dict, records = _local_entries(tensors, optimizer_state, groups)
    save_entries(path, state_dict, records, step, groups, plan_json, user_state, packed=False)


@dataclass(frozen=True, kw_only=True)
class WriteJob:
    """One save of one rank: where it goes (`path`, its temporary version `tmp`, the shared
    `uid`, `keep` versions), who writes (`rank` of `world`), and what the layout records
    (`records`: this rank's pieces, `step`, `plan_json`, rank 0's `user_state`). Picklable:
    an asynchronous save hands it to the writer process (autopar.runtime.ckpt_writer).
    `fault`: a test hook (AUTOPAR_CKPT_FAULT=exit-after-files in the saving rank's
    environment: the writer dies once this rank's files are written, before the commit)."""
    path: Path
    tmp: Path
    uid: str
    keep: int
    rank: int
    world: int
    records: list
    step: int
    plan_json: str
    user_state: dict | None
    fault: str = ""


def save_entries(path: str | os.PathLike, state_dict: dict[str, torch.Tensor],
                 records: list[dict], step: int, groups: Any, plan_json: str = "{}",
                 user_state: dict | None = None, *, keep: int = 1,
                 async_save: bool = False, packed: bool = True) -> None:
    """Write this rank's pieces (`state_dict`: DCP key -> tensor, `records`: their layout
    records) as a new version of `path` and commit it (autopar.runtime.ckpt_store): after
    every rank's files are complete, rank 0 writes the layout (with each file's size and
    CRC-32), repoints the link and keeps the `keep` newest versions. packed: the pieces
    written as a few raw byte packs (autopar.runtime.ckpt_packs), not as a DCP item each
    (save_checkpoint's whole tensors: items any DCP reader loads). async_save: stage the
    pieces in shared host memory and hand them, packed, to this rank's writer process
    (autopar.runtime.ckpt_writer; returns at once, the next save or `wait_for_save` waits).
    Collective: every rank calls it with the same path.
    Why this size: save_checkpoint's pieces and layout inputs, then the three save options."""
    path = Path(path)
    _check_json(user_state)
    WRITER.wait()                                     # one save in flight at a time
    multi = groups is not None and groups.world_size > 1
    rank = groups.rank if multi else 0
    uid = _shared_uid(groups)
    tmp = path.parent / f"{path.name}.tmp-{uid}"
    if rank == 0:
        adopt_copy(path, uid)                         # a `cp -rL` copy becomes a version
        tmp.mkdir(parents=True)
    group = checkpoint_group(groups) if multi else None
    if multi:
        dist.barrier(group=groups.world)
    job = WriteJob(path=path, tmp=tmp, uid=uid, keep=keep, rank=rank,
                   world=groups.world_size if multi else 1, records=records, step=step,
                   plan_json=plan_json, user_state=user_state,
                   fault=os.environ.get("AUTOPAR_CKPT_FAULT", ""))
    if async_save:
        staged, where = WRITER.stage(state_dict).packed(f"pack/{rank}", PACK_BYTES)
        job = dataclasses.replace(job, records=[_packed(r, where) for r in records])
        WRITER.start(write_version, job, staged, groups)
        return
    items: dict[str, Any] = state_dict
    if packed:
        items, where = packs_of(state_dict, f"pack/{rank}", PACK_BYTES)
        job = dataclasses.replace(job, records=[_packed(r, where) for r in records])
    with peer_guard("checkpoint save with", group):
        write_version(job, items, group)


def write_version(job: WriteJob, state_dict: dict[str, Any], group: Any = None) -> None:
    """Write `state_dict` (this rank's pieces: tensors, or Packs written raw by
    ckpt_packs.PackWriter) into `job.tmp` with DCP, checksum this rank's files as they are
    written, and — on rank 0, once every rank's records arrived — write the layout and
    commit. Collective over `group` (None: the default group; the writer process's own)."""
    multi = job.world > 1
    if all(isinstance(v, Pack) for v in state_dict.values()):
        writer: Any = PackWriter(str(job.tmp))
        written = writer.written
    else:
        writer = dcp.FileSystemWriter(str(job.tmp))
        writer.fs = ChecksumFileSystem()              # checksums as the bytes are written
        written = writer.fs.written
    dcp.save(state_dict, storage_writer=writer, process_group=group, no_dist=not multi)
    if job.fault == "exit-after-files":
        os._exit(9)                                   # tests: files written, never committed
    mine = (job.records, {n: written[n] for n in own_files(job.tmp, job.rank)})
    parts: list[Any] | None = [None] * job.world if job.rank == 0 and multi else None
    if multi:   # rank 0 hears from every rank only once its files are complete
        dist.gather_object(mine, parts, dst=_global(group, 0), group=group)
    if job.rank == 0:
        parts = parts or [mine]
        layout = _merge_layout([r for r, _ in parts], job.step, job.plan_json, job.user_state)
        _check_coverage(layout)
        _write_text(job.tmp / PLAN_FILE, job.plan_json)              # the saving plan
        files = {n: v for _, f in parts for n, v in f.items()}
        layout["files"] = {**files, **file_records(job.tmp, [".metadata", PLAN_FILE])}
        _write_text(job.tmp / LAYOUT_FILE, json.dumps(layout, separators=(",", ":")))
        commit(job.path, job.tmp, job.uid, job.keep)
    if multi:
        dist.barrier(group=group)


def _global(group: Any, rank: int) -> int:
    """The global rank of `group`'s rank `rank` (the default group's when group is None)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def wait_for_save() -> None:
    """Block until this process's background save (if any) is committed; raise its error."""
    WRITER.wait()


def close_writer() -> None:
    """Wait for this process's background save (if any), then stop its writer process."""
    WRITER.close()


def _write_text(file: Path, text: str) -> None:
    """Write `text` to `file` atomically (fsync, rename). A layout's JSON comes from
    json.dumps without indent, json's C encoder: json.dump to a file, and any indent, run the
    pure-Python encoder (~0.2 CPU-s a save for a 4-rank layout of ~500 pieces)."""
    part = file.with_suffix(".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, file)


# ---- load ----------------------------------------------------------------------------------

def read_layout(path: str | os.PathLike) -> dict:
    """The checkpoint's JSON layout (step, plan, tensors); ValueError if incomplete."""
    file = Path(path) / LAYOUT_FILE
    if not file.is_file():
        raise ValueError(f"{path}: no {LAYOUT_FILE}, so not a complete autopar checkpoint "
                         f"(a save that crashed leaves only .tmp-* directories); pass the path "
                         f"given to save_checkpoint")
    layout = json.loads(file.read_text())
    if layout.get("format") != FORMAT:
        raise ValueError(f"{file}: format {layout.get('format')!r}, expected {FORMAT!r}")
    return layout


def _check_keys(layout: dict, tensors: Tensors, strict: bool) -> None:
    model = {k: info.global_shape for k, (_, info) in tensors.items()}
    check_fits(layout, model, where="load_checkpoint: the checkpoint", strict=strict,
               fix="(or pass strict=False to ignore extra keys)")


def check_fits(layout: dict, model: dict[str, Any], *, where: str, strict: bool = True,
               fix: str = "") -> None:
    """Raise a ValueError naming every key that is missing, extra (if strict) or of another
    full shape between the checkpoint `layout` and `model` ({user key: full shape})."""
    saved = {n: tuple(e["global_shape"]) for n, e in layout["tensors"].items()
             if not n.startswith("optim/")}
    missing = sorted(k for k in model if k not in saved)
    unexpected = sorted(k for k in saved if k not in model) if strict else []
    shapes = sorted(f"{k} (checkpoint {saved[k]}, model {tuple(model[k])})"
                    for k in model if k in saved and saved[k] != tuple(model[k]))
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {unexpected}")
    if shapes:
        problems.append(f"shape mismatch: {shapes}")
    if problems:
        raise ValueError(f"{where} does not fit this model — " + "; ".join(problems)
                         + ". Load a checkpoint saved from the same model configuration "
                         + fix)


def _local_view(local: torch.Tensor, info: ParamInfo) -> tuple[torch.Tensor,
                                                                list[tuple[int, int]]]:
    """The real part of `local` and the box of the full tensor it stands for."""
    box = [(0, n) for n in info.global_shape]
    if info.split_dim is not None:
        box[info.split_dim] = (info.start, info.stop)
    return info.real_part(local), box


def load_checkpoint(path: str | os.PathLike, tensors: Tensors, groups: Any = None, *,
                    optimizer_state: OptimState | None = None, strict: bool = True) -> int:
    """Fill `tensors` (local shards of a possibly different plan) from `path`; return the step.

    tensors: {ParamInfo.key: (local tensor to overwrite, its new ParamInfo)}. optimizer_state:
    a dict to fill with {key: {state name: tensor shaped like the local tensor, or 0-d}} for
    every key whose state the checkpoint holds (install it with `load_optimizer_state` or
    ZeroOptimizer.load_gathered_state). Mismatched keys or shapes raise ValueError naming them.
    Each rank reads only the pieces it needs; no collectives.
    """
    path = Path(path)
    layout = read_layout(path)
    _check_keys(layout, tensors, strict)
    boxes: list[tuple[str, torch.Tensor, list[tuple[int, int]]]] = []
    for key, (local, info) in tensors.items():
        view, want = _local_view(local, info)
        boxes.append((key, view, want))
        if optimizer_state is None:
            continue
        for name, entry in layout["tensors"].items():
            if not (name.startswith("optim/") and name.split("/", 2)[2] == key):
                continue
            sname = name.split("/", 2)[1]
            if not entry["global_shape"]:
                target = torch.zeros((), dtype=dtype_of(entry["dtype"]))
                boxes.append((name, target, []))
            else:
                target = torch.zeros_like(local, dtype=dtype_of(entry["dtype"]))
                boxes.append((name, info.real_part(target), want))
            optimizer_state.setdefault(key, {})[sname] = target
    read_boxes(path, layout, boxes, sum(v.numel() * v.element_size() for _, v, _ in boxes))
    return int(layout["step"])


def read_plan_json(path: str | os.PathLike) -> str:
    return read_layout(path)["plan"]


def read_user_state(path: str | os.PathLike) -> dict:
    """The `user_state` saved with the checkpoint at `path` ({} if none); no collectives."""
    return dict(read_layout(path).get("user_state") or {})


def _check_json(user_state: dict | None) -> None:
    if user_state is None:
        return
    try:
        json.dumps(user_state)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"save_checkpoint: user_state is not JSON-serialisable ({exc}); "
                         f"pass a dict of numbers, strings, lists and dicts") from exc
    if not isinstance(user_state, dict):
        raise ValueError(f"save_checkpoint: user_state is a {type(user_state).__name__}; "
                         f"pass a dict")


# ---- torch optimizers <-> per-key state ----------------------------------------------------

def optimizer_state_by_key(optimizer: torch.optim.Optimizer,
                           named_params: dict[str, torch.Tensor]) -> OptimState:
    """{key: {state name: tensor}} of a plain torch optimizer over `named_params`."""
    out: OptimState = {}
    for key, p in named_params.items():
        st = optimizer.state.get(p)
        if st:
            out[key] = {k: v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                        for k, v in st.items()}
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer,
                         named_params: dict[str, torch.Tensor], state: OptimState) -> None:
    """Install per-key state (from load_checkpoint) into a plain torch optimizer."""
    for key, p in named_params.items():
        if key in state:
            optimizer.state[p] = {k: state_value(optimizer, p, v)
                                  for k, v in state[key].items()}


# ---- a training program's checkpoint -------------------------------------------------------

def save_program_checkpoint(path: str | os.PathLike, params: LocalParams, regime: Any,
                            groups: Any, step: int, plan_json: str,
                            user_state: dict | None = None, *, keep: int = 1,
                            async_save: bool = False) -> None:
    """Save the program's weights, optimizer state and step (module docstring). `regime`: the
    program's optimizer regime (autopar.runtime.regimes): each rank writes the pieces it holds
    (`regime.shard_state()`, autopar.runtime.ckpt_pieces), nothing gathered; a regime without
    a sharded form is gathered as before. keep: versions kept (the newest `keep`); async_save:
    written by the rank's background writer process (ckpt_writer). Collective: every rank calls it.
    Why this size: what a program checkpoint records (params, regime, groups, step, plan, the
    loop's state) plus the two save options."""
    held = regime.shard_state()
    if held is not None:
        state_dict, records = sharded_entries(held, params, groups)
        save_entries(path, state_dict, records, step, groups, plan_json, user_state,
                     keep=keep, async_save=async_save)
        return
    weights = regime.fp32_weights()
    ostate = regime.optimizer_state()
    tensors: Tensors = {}
    for q, w in weights.items():
        info = params.infos[q]
        if _gathered_over_tp(info, params, q):   # fused q/k/v, tensor-split experts: store
            # the whole tensor over the tensor group (tp rank 0 writes)
            whole = _whole_over_tp(params, q, groups)
            w = whole(w)
            ostate[info.key] = {k: whole(v) for k, v in sorted(ostate.get(info.key, {}).items())}
            info = info.whole()
        tensors[info.key] = (w.detach().cpu(), info)
    ostate = {k: {n: v.detach().cpu() for n, v in st.items()} for k, st in ostate.items()}
    with peer_guard("checkpoint save with", groups.world):
        save_checkpoint(path, tensors, ostate, step, groups, plan_json, user_state)


def load_program_checkpoint(path: str | os.PathLike, params: LocalParams, regime: Any,
                            groups: Any, *, weights_only: bool = False) -> int:
    """Load a checkpoint saved under this or any other plan into the program; return its step.
    weights_only: the weights alone (the optimizer state is not read and stays as it is).
    Keys and full shapes must match the model's: otherwise the same ValueError on every rank,
    naming them. Collective: every rank calls it."""
    return load_program_version(path, params, regime, groups, weights_only=weights_only)[0]


def load_program_version(path: str | os.PathLike, params: LocalParams, regime: Any,
                         groups: Any, *, weights_only: bool = False) -> tuple[int, Path]:
    """load_program_checkpoint from the newest version of `path` whose files are sound
    (sizes and checksums; autopar.runtime.ckpt_store.choose_version): (step, that version).
    A skipped version is one line on rank 0's stderr naming the bad file. Collective."""
    WRITER.wait()                    # a save of this process still in flight lands first
    path, skipped = choose_version(Path(path), read_layout, groups.world if groups else None)
    if skipped and (groups is None or groups.rank == 0):
        for problem in skipped:
            print(f"load_checkpoint: skipped a version: {problem}; using the previous "
                  f"complete version {path}", file=sys.stderr, flush=True)
    layout = read_layout(path)
    _check_program_keys(path, layout, params)
    held = regime.shard_state()
    if held is not None:       # straight into the regime's shards (ckpt_load), bounded
        load_into_shards(path, layout, held, params, groups, regime.optimizer,
                         weights_only=weights_only, copies=regime.loaded_copies())
        regime.shards_loaded()
        return int(layout["step"]), path
    targets: Tensors = {}
    for q, p in params.tensors.items():
        info = params.infos[q]
        gathered = _gathered_over_tp(info, params, q)
        shape = (p.shape if not gathered else info.global_shape if info.blocked
                 else (info.stop - info.start,) + tuple(info.global_shape[1:]))
        targets[info.key] = (torch.zeros(shape, dtype=torch.float32),
                             info.whole() if gathered else info)
    ostate: OptimState = {}
    step = load_checkpoint(path, targets, groups, optimizer_state=None if weights_only else ostate,
                           strict=False)
    weights: dict[str, torch.Tensor] = {}
    for q in params.tensors:
        key = params.infos[q].key
        w = targets[key][0]
        if _gathered_over_tp(params.infos[q], params, q):
            split, _ = params.splits[q]
            mine = lambda v: local_shard(v, split, groups.tp_rank, groups.t)  # noqa: E731
            w = mine(w)
            if key in ostate:
                ostate[key] = {k: v if v.dim() == 0 else mine(v) for k, v in ostate[key].items()}
        weights[q] = w
    regime.load(weights, ostate)
    return step, path


def _gathered_over_tp(info: ParamInfo, params: LocalParams, q: str) -> bool:
    """Whether q is stored whole over the tensor group: a fused q/k/v (a slice of every
    block) or an expert parameter also split over the tensor ranks."""
    return info.blocked or (info.expert and q in params.splits)


def _whole_over_tp(params: LocalParams, q: str, groups: Any) -> Any:
    """tensor -> the whole tensor gathered over the tensor group (0-d tensors unchanged)."""
    split, full = params.splits[q]
    return lambda v: v if v.dim() == 0 else gather_unshard(v, split, full, groups.tensor)


def _check_program_keys(path: Any, layout: dict, params: LocalParams) -> None:
    """Every rank's parameters together must be exactly the checkpoint's, with the same full
    shapes; else the same ValueError on every rank, naming the keys."""
    mine = {info.key: list(info.global_shape) for info in params.infos.values()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    model: dict[str, list[int]] = {}
    for part in parts:
        model.update(part)
    check_fits(layout, model, where=f"load_checkpoint: {path}", fix="(the plan may differ)")
