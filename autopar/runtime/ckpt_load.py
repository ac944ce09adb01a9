"""Reading a checkpoint straight into what a rank holds, in bounded memory.

A program's load (autopar.runtime.checkpoint.load_program_version) fills the optimizer
regime's own shard state in place: `regime.shard_state()` names the flat ranges of the local
parameters the rank holds (autopar.runtime.ckpt_pieces.Held: the fp32 weight, i.e. the master
piece, and the tensor the optimizer keys its state by). Each range maps to boxes of the full
tensors exactly as a save maps it (`ckpt_pieces.flat_boxes`, `split_runs(reading=True)`: the
rows every tensor rank holds alike are read on every rank, padding rows are zero), and every
box reads the overlapping parts of the saved pieces (`plan_reads`) — from any plan: other t, c,
p, d, v, ep and ZeRO level, and the tensor-split pieces of checkpoints written before sharded
saves. A piece is a DCP item of its own (save_checkpoint's, and sharded saves before
2026-11-26), or a byte range of one of the rank's packs: a raw bytes item
(autopar.runtime.ckpt_packs: read at pack offset + piece offset) or, written before, a 1-D
uint8 tensor item (read in ranges the same way at the piece's offset).
Nothing of the rank's unsharded local state is ever built.

Bounded reads. DCP's FileSystemReader loads a stored piece whole (torch.load, then narrow),
so a piece saved by a plan with fewer ranks (or an old checkpoint's whole tensor) would cost
its full size however little of it a rank needs. `PieceFile` reads instead the byte ranges
of the overlap directly: a DCP item of a tensor is a torch.save zip archive inside the .distcp
file (DCP's `_StorageInfo`: file, offset, length), whose one storage record is stored
uncompressed and contiguous; the record's place comes from the archive's directory and its
shape, strides and dtype from its pickle (read without the data: torch.serialization.skip_data
onto the meta device). An overlap is read in spans of at most `budget` elements (`spans`: whole
leading-dimension blocks where they fit, else one index at a time), each into one temporary
buffer, copied into its target and freed. An item in another form (a DCP storage transform, a
compressed or big-endian record, a non-contiguous tensor) is read whole through DCP, counted
the same way. So the memory a load adds to the state it fills is one span buffer —
≤ `budget` = 1/8 of the rank's held bytes (at least 64 KiB) — or one such whole item
(`LoadStats.peak_bytes`, counted, not sampled).

The optimizer state: the checkpoint's elementwise states of each held range go into the
optimizer's existing state tensors where they have the right shape (else new ones, which are
the state itself, not temporaries); scalar states (Adam's step) as 0-d float32 tensors; a range
whose tensor has no saved state loses its state (the saving run had not stepped it). The regime
then refreshes what derives from the shards (`Regime.shards_loaded`: ZeRO-1's all-gather into
the parameters, bf16 copies).

Safety: DCP's metadata through a restricted unpickler (`SafeReader`), tensor pickles with
torch.load(weights_only=True), the layout is JSON.
"""
from __future__ import annotations

import io
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta)

from autopar.runtime.ckpt_packs import nbytes
from autopar.runtime.ckpt_pieces import Held, flat_boxes, map_box, split_runs
from autopar.runtime.optim_state import state_value
from autopar.runtime.params import LocalParams

Box = list[tuple[int, int]]
_MIN_BUDGET_BYTES = 64 << 10


@dataclass(frozen=True, kw_only=True)
class LoadStats:
    """What a load read and what it allocated beyond the state it fills: `peak_bytes`, the
    largest temporary alive at once (one span buffer, or a whole item read through DCP);
    `budget_bytes`, the span bound; `held_bytes`, the rank's held state it filled;
    `read_bytes`, bytes read from the files; `whole_items`, items read whole through DCP."""
    peak_bytes: int
    budget_bytes: int
    held_bytes: int
    read_bytes: int
    whole_items: int


_LAST: list[LoadStats] = []


def last_load_stats() -> LoadStats | None:
    """The LoadStats of this process's last sharded load (None before one)."""
    return _LAST[-1] if _LAST else None


# ---- DCP metadata, safely ------------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """Accepts only what DCP's .metadata holds: its dataclasses, dtypes, sizes, paths."""

    _MODULES = {"torch.distributed.checkpoint.metadata"}
    _NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
              ("torch", "Size"), ("torch.serialization", "_get_layout"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
              ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
              ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's "
            f"metadata format; refusing to unpickle it (the checkpoint is not trusted)")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with a restricted unpickler for the metadata file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{self.path}: DCP metadata is a {type(metadata).__name__}, "
                             f"not Metadata; not a torch.distributed.checkpoint directory")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_reader(path: Path) -> SafeReader:
    """A SafeReader of `path` with its metadata read (a refusal is a ValueError here, not
    buried in DCP's wrapper)."""
    reader = SafeReader(str(path))
    try:
        metadata = reader.read_metadata()
    except pickle.UnpicklingError as exc:
        raise ValueError(f"load_checkpoint: {path}: {exc}") from exc
    reader.set_up_storage_reader(metadata, True)      # where each item is (storage_data)
    reader.metadata = metadata                        # each item's size (a pack's)
    return reader


# ---- the layout's pieces -------------------------------------------------------------------

def dtype_of(name: str) -> torch.dtype:
    value = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"checkpoint layout names dtype {name!r}, which is not a torch dtype")
    return value


def _box(shape: list[int], dim: int | None, start: int | None, stop: int | None) -> Box:
    box = [(0, n) for n in shape]
    if dim is not None and start is not None:
        box[dim] = (start, stop)
    return box


Ref = tuple[str, "int | None"]     # a piece's DCP item, and its byte offset inside a pack


def piece_box(shape: list[int], split_dim: int | None, piece: list) -> Box:
    """The box of the full tensor a layout piece is: [box, key] and [box, pack key, byte
    offset] name it, [start, stop, key] (rows of split_dim; a 0-d tensor: None, None) in
    layouts written before sharded saves."""
    if isinstance(piece[0], list):
        return [tuple(b) for b in piece[0]]
    return _box(shape, split_dim, piece[0], piece[1])


def saved_pieces(entry: dict) -> list[tuple[Box, Ref]]:
    """(box of the full tensor, (DCP key, byte offset in a pack or None)) of each saved
    piece (piece_box's three forms)."""
    out = []
    for piece in entry["pieces"]:
        packed = isinstance(piece[0], list) and len(piece) == 3
        ref = (piece[1], int(piece[2])) if packed else (piece[-1], None)
        out.append((piece_box(entry["global_shape"], entry["split_dim"], piece), ref))
    return out


def volume(box: Any) -> int:
    vol = 1
    for lo, hi in box:
        vol *= hi - lo
    return vol


def plan_reads(name: str, entry: dict, want: Box) -> list[tuple[Ref, Box, Box]]:
    """The saved pieces overlapping the box `want`: (piece ref, piece box, overlap box)."""
    reads, covered = [], 0
    for have, ref in saved_pieces(entry):
        inter = [(max(a, c), min(b, e)) for (a, b), (c, e) in zip(have, want)]
        if all(lo < hi for lo, hi in inter) or not inter:
            reads.append((ref, have, inter))
            covered += volume(inter)
    if covered != volume(want):
        raise ValueError(f"load_checkpoint: the saved pieces of {name!r} cover {covered} of the "
                         f"{volume(want)} elements this rank needs; the checkpoint is incomplete")
    return reads


# ---- ranged reads of DCP items -------------------------------------------------------------

def spans(shape: list[int], box: Box, max_elems: int) -> list[Box]:
    """`box` of a row-major tensor of `shape` cut into sub-boxes whose flat span (first to
    last element) is ≤ max_elems where possible: whole blocks of the first dimension with
    more than one index, else one index of it at a time, recursively (one element at least)."""
    strides = _strides(shape)

    def span(b: Box) -> int:
        return sum((hi - 1 - lo) * s for (lo, hi), s in zip(b, strides)) + 1

    if not box or span(box) <= max_elems:
        return [box]
    d = next(i for i, (lo, hi) in enumerate(box) if hi - lo > 1)
    lo, hi = box[d]
    one = box[:d] + [(lo, lo + 1)] + box[d + 1:]
    if span(one) > max_elems:
        return [s for i in range(lo, hi)
                for s in spans(shape, box[:d] + [(i, i + 1)] + box[d + 1:], max_elems)]
    k = max(1, (max_elems - span(one)) // strides[d] + 1)
    return [box[:d] + [(i, min(hi, i + k))] + box[d + 1:] for i in range(lo, hi, k)]


def _strides(shape: list[int]) -> list[int]:
    out, n = [], 1
    for size in reversed(shape):
        out.append(n)
        n *= size
    return out[::-1]


class _Slice(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a seekable file."""

    def __init__(self, f: BinaryIO, offset: int, length: int):
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: pos, 1: self._pos + pos, 2: self._length + pos}[whence]
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._length - self._pos))
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got
        return got


class PieceFile:
    """Ranged reads of the DCP items of one checkpoint version (module docstring)."""

    def __init__(self, path: Path, reader: SafeReader, byteorder: str = sys.byteorder):
        self.path, self.reader, self.byteorder = path, reader, byteorder
        self._files: dict[str, BinaryIO] = {}
        self._where: dict[str, tuple[str, int] | None] = {}
        self.read_bytes = 0

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def record(self, key: str, shape: list[int], dtype: torch.dtype) -> tuple[str, int] | None:
        """(file, byte offset) of the contiguous data of item `key`, or None when the item
        is in another form (read whole through DCP)."""
        if key not in self._where:
            info = self.reader.storage_data[MetadataIndex(key, [0] * len(shape))]
            self._where[key] = None if info.transform_descriptors else \
                self._locate(info.relative_path, info.offset, info.length, shape, dtype)
        return self._where[key]

    def packed(self, ref: Ref, shape: list[int], dtype: torch.dtype
               ) -> tuple[str, int] | None:
        """(file, byte offset) of a piece's contiguous data: inside its pack at the piece's
        byte offset — a raw bytes item (autopar.runtime.ckpt_packs) or, written before, a 1-D
        uint8 tensor item — or a piece item's own (`record`)."""
        key, offset = ref
        if offset is None:
            return self.record(key, shape, dtype)
        meta = self.reader.metadata.state_dict_metadata[key]
        if isinstance(meta, BytesStorageMetadata):
            info = self.reader.storage_data[MetadataIndex(key)]
            if self.byteorder != sys.byteorder or info.transform_descriptors:
                raise ValueError(f"load_checkpoint: {self.path}: pack {key!r} holds "
                                 f"{self.byteorder}-endian raw bytes (transforms "
                                 f"{info.transform_descriptors}); this {sys.byteorder}-endian "
                                 f"reader reads plain native packs only: load it on a "
                                 f"{self.byteorder}-endian host")
            if offset + nbytes(tuple(shape), dtype) > info.length:
                raise ValueError(f"load_checkpoint: {self.path}: the layout puts a piece at "
                                 f"bytes {offset}+ of pack {key!r}, which has {info.length}; "
                                 f"the layout and the files are from different saves: copy "
                                 f"the whole checkpoint directory again")
            return info.relative_path, info.offset + offset
        where = self.record(key, list(meta.size), torch.uint8)
        return None if where is None else (where[0], where[1] + offset)

    def read_piece_whole(self, ref: Ref, shape: list[int], dtype: torch.dtype
                         ) -> tuple[torch.Tensor, int]:
        """A piece whole through DCP (its pack whole, then the piece's bytes): (tensor, the
        bytes allocated)."""
        key, offset = ref
        if offset is None:
            piece = self.read_whole(key, shape, dtype)
            return piece, piece.numel() * dtype.itemsize
        size = list(self.reader.metadata.state_dict_metadata[key].size)
        pack = self.read_whole(key, size, torch.uint8)
        n = dtype.itemsize
        for s in shape:
            n *= s
        return pack[offset:offset + n].view(dtype).view(shape), pack.numel()

    def _file(self, name: str) -> BinaryIO:
        if name not in self._files:
            self._files[name] = open(self.path / name, "rb")
        return self._files[name]

    def _locate(self, name: str, offset: int, length: int, shape: list[int],
                dtype: torch.dtype) -> tuple[str, int] | None:
        f = self._file(name)
        item = _Slice(f, offset, length)
        try:
            archive = zipfile.ZipFile(item)
            data = [i for i in archive.infolist() if "/data/" in i.filename
                    and not i.filename.endswith(".pkl")]
            order = [i for i in archive.infolist() if i.filename.endswith("/byteorder")]
            if order and archive.read(order[0]).decode() != sys.byteorder:
                return None
            if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
                return None
            item.seek(0)
            with torch.serialization.skip_data():
                meta = torch.load(item, map_location="meta", weights_only=True)
        except (zipfile.BadZipFile, RuntimeError, pickle.UnpicklingError, OSError):
            return None
        if not (isinstance(meta, torch.Tensor) and list(meta.shape) == list(shape)
                and meta.dtype == dtype and meta.is_contiguous() and meta.storage_offset() == 0
                and data[0].file_size == meta.numel() * dtype.itemsize):
            return None
        f.seek(offset + data[0].header_offset)
        head = f.read(30)
        if len(head) != 30 or struct.unpack("<I", head[:4])[0] != 0x04034B50:
            return None
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        return name, offset + data[0].header_offset + 30 + name_len + extra_len

    def read(self, where: tuple[str, int], shape: list[int], dtype: torch.dtype,
             sub: Box) -> torch.Tensor:
        """The sub-box `sub` (piece coordinates) of the contiguous item at `where`: one buffer
        of its flat span, viewed with the item's strides."""
        strides = _strides(shape)
        first = sum(lo * s for (lo, _), s in zip(sub, strides))
        n = sum((hi - 1 - lo) * s for (lo, hi), s in zip(sub, strides)) + 1
        buf = torch.empty(n * dtype.itemsize, dtype=torch.uint8)
        f = self._file(where[0])
        f.seek(where[1] + first * dtype.itemsize)
        got = f.readinto(memoryview(buf.numpy()))
        if got != buf.numel():
            raise ValueError(f"load_checkpoint: {self.path / where[0]} ends {buf.numel() - got} "
                             f"bytes early (truncated); copy it again from the original "
                             f"checkpoint")
        self.read_bytes += got
        return buf.view(dtype).as_strided([hi - lo for lo, hi in sub], strides)

    def read_whole(self, key: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Item `key` whole, through DCP (what it cannot read in ranges)."""
        out = {key: torch.empty(shape, dtype=dtype)}
        dcp.load(out, storage_reader=self.reader, no_dist=True)
        self.read_bytes += out[key].numel() * dtype.itemsize
        return out[key]


# ---- the load ------------------------------------------------------------------------------

Target = tuple[torch.Tensor, Box]      # a view to fill and the box of the full tensor it is


def held_targets(held: list[Held], params: LocalParams, groups: Any
                 ) -> list[tuple[str, Held, str, list[Target]]]:
    """(graph name, range, state name, [(view, global box)]) of every tensor of every held
    range: the boxes of the full tensor its elements are (padding rows have none)."""
    t, tp_rank = (groups.t, groups.tp_rank) if groups is not None else (1, 0)
    out = []
    for h in held:
        info = params.infos[h.name]
        shape = tuple(params.tensors[h.name].shape)
        runs = split_runs(h.name, info, params, tp_rank, t, reading=True)
        for sname, flat in h.tensors.items():
            targets = []
            for flo, fhi, box in flat_boxes(shape, h.lo, h.hi):
                piece = flat[flo - h.lo:fhi - h.lo].view([b - a for a, b in box])
                for sub, gbox in map_box(box, runs):
                    view = piece
                    for dim, ((slo, shi), (blo, _)) in enumerate(zip(sub, box)):
                        view = view.narrow(dim, slo - blo, shi - slo)
                    targets.append((view, gbox))
            out.append((h.name, h, sname, targets))
    return out


def _with_state(held: list[Held], layout: dict, params: LocalParams, optimizer: Any
                ) -> tuple[list[Held], list[tuple[Held, str, str]]]:
    """The held ranges with their targets for every elementwise state the checkpoint holds
    (the optimizer's own tensors, reused or new), and (range, state name, layout name) of
    the scalar states; the optimizer's state of each range replaced accordingly."""
    names: dict[str, list[tuple[str, str]]] = {}
    for name, entry in layout["tensors"].items():
        if name.startswith("optim/"):
            _, sname, key = name.split("/", 2)
            names.setdefault(key, []).append((sname, name))
    out, scalars = [], []
    for h in held:
        param, key = h.param, params.infos[h.name].key
        old = optimizer.state.get(param, {})
        state: dict[str, torch.Tensor] = {}
        tensors = {"weight": h.tensors["weight"]}
        for sname, name in sorted(names.get(key, [])):
            if not layout["tensors"][name]["global_shape"]:
                state[sname] = state_value(optimizer, param, torch.zeros(()))
                scalars.append((h, sname, name))
                continue
            mine = old.get(sname)
            if not (isinstance(mine, torch.Tensor) and mine.shape == param.shape
                    and mine.dtype == param.dtype):
                mine = torch.zeros_like(param, memory_format=torch.contiguous_format)
            state[sname] = mine
            tensors[f"optim/{sname}"] = mine.detach().view(-1)
        if state:
            optimizer.state[param] = state
        else:
            optimizer.state.pop(param, None)
        out.append(Held(name=h.name, lo=h.lo, hi=h.hi, tensors=tensors, scalars={},
                        whole_over_data=h.whole_over_data, param=param))
    return out, scalars


def _weights(h: Held) -> Held:
    return Held(name=h.name, lo=h.lo, hi=h.hi, tensors={"weight": h.tensors["weight"]},
                scalars={}, whole_over_data=h.whole_over_data, param=h.param)


def load_into_shards(path: Path, layout: dict, held: list[Held], params: LocalParams,
                     groups: Any, optimizer: Any, *, weights_only: bool,
                     copies: list[Held] = ()) -> LoadStats:
    """Fill the rank's held ranges (weights and, unless weights_only, optimizer state) and
    the weights of `copies` (Regime.loaded_copies) from the checkpoint version `path` (module
    docstring); no collectives. Returns what it cost."""
    if not weights_only:
        held, scalars = _with_state(held, layout, params, optimizer)
    else:
        held, scalars = [_weights(h) for h in held], []
    held_bytes = sum(t.numel() * t.element_size() for h in held for t in h.tensors.values())
    held = held + [_weights(h) for h in copies]
    boxes: list[tuple[str, torch.Tensor, Box]] = []
    with torch.no_grad():
        for name, h, sname, targets in held_targets(held, params, groups):
            key = params.infos[name].key
            h.tensors[sname].zero_()                         # padding rows stay zero
            boxes += [(key if sname == "weight" else f"{sname}/{key}", view, gbox)
                      for view, gbox in targets]
    boxes += [(lname, optimizer.state[h.param][sname], []) for h, sname, lname in scalars]
    return read_boxes(path, layout, boxes, held_bytes)


def read_boxes(path: Path, layout: dict, boxes: list[tuple[str, torch.Tensor, Box]],
               held_bytes: int) -> LoadStats:
    """Fill each (layout name, view, box of the full tensor it is) from the checkpoint version
    `path`, reading the overlapping parts of the saved pieces in spans of at most 1/8 of
    `held_bytes` (at least 64 KiB; module docstring); no collectives."""
    budget = max(_MIN_BUDGET_BYTES, held_bytes // 8)
    by_key: dict[Ref, list[tuple[torch.Tensor, Box, Box, Box]]] = {}
    for lname, view, want in boxes:
        for ref, have, inter in plan_reads(lname, layout["tensors"][lname], want):
            by_key.setdefault(ref, []).append((view, want, have, inter))
    shapes = {k: ([hi - lo for lo, hi in box], dtype_of(entry["dtype"]))
              for entry in layout["tensors"].values() for box, k in saved_pieces(entry)}
    files = (PieceFile(path, safe_reader(path), layout.get("byteorder", sys.byteorder))
             if by_key else None)
    peak = whole = 0
    try:
        with torch.no_grad():
            for ref, reads in by_key.items():
                shape, dtype = shapes[ref]
                where = files.packed(ref, shape, dtype)
                piece = None
                if where is None:
                    piece, nbytes = files.read_piece_whole(ref, shape, dtype)
                    peak, whole = max(peak, 2 * nbytes), whole + 1
                for view, want, have, inter in reads:
                    local = [(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, have)]
                    for sub in spans(shape, local, max(1, budget // dtype.itemsize)):
                        src = piece if piece is not None else files.read(where, shape, dtype, sub)
                        if piece is not None:
                            for dim, (lo, hi) in enumerate(sub):
                                src = src.narrow(dim, lo, hi - lo)
                        else:
                            peak = max(peak, src.untyped_storage().nbytes())
                        dst = view
                        for dim, ((lo, hi), (a, _), (w, _)) in enumerate(zip(sub, have, want)):
                            dst = dst.narrow(dim, lo + a - w, hi - lo)
                        dst.copy_(src)
                        del src
    finally:
        if files is not None:
            files.close()
    stats = LoadStats(peak_bytes=peak, budget_bytes=budget, held_bytes=held_bytes,
                      read_bytes=files.read_bytes if files else 0, whole_items=whole)
    _LAST[:] = [stats]
    return stats
