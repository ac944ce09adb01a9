"""A rank's checkpoint pieces written as a few raw byte items ("packs"), with the fewest layers
between the pieces' memory and the file.

Format. The pieces a rank writes, in order, each at a 64-byte aligned byte offset of one linear
space (`piece_index`), are grouped into packs of consecutive pieces of ≤ max_bytes each (a
larger piece alone; `plan_packs`); pack k of rank r is the DCP *bytes* item f"pack/{r}/{k}"
(DCP metadata: BytesStorageMetadata, its _StorageInfo the file, offset and length) whose bytes
are the pieces' raw bytes in native byte order (the layout records `byteorder`), zeros between
them. The layout JSON names each piece's pack and byte offset (autopar.runtime.checkpoint); a
load reads a piece's byte ranges at pack offset + piece offset (autopar.runtime.ckpt_load).
An asynchronous save stages the pieces at exactly these offsets in one shared buffer
(autopar.runtime.ckpt_writer), so its packs are slices of that buffer; a synchronous save
writes the pieces themselves one after another: the same bytes, the same file.

Why not DCP's own tensor items: DCP writes each item through torch.save (a zip archive: its
records, a CRC-32 of the data computed by the zip writer, a pickle) and each write through the
file system's Python stream, and plans and pickles per item; for a rank's tens to hundreds of
pieces that per-item work, and the zip's second pass over the data, were most of a background
writer's CPU (docs/benchmarks.md). `PackWriter`, DCP's file writer with its `write_data`
replaced, writes each pack's memory straight to the file in 4 MiB blocks, the file's CRC-32
kept over each block while it is in cache, one fsync per file; DCP still plans the items
(keys, the files' names) and writes the metadata. Memory: a contiguous CPU piece is written
from its own memory; any other (a strided view, a GPU tensor) is copied alone just before it
is written (≤ the largest piece: 1/16 of the shard state, autopar.runtime.ckpt_pieces).
"""
from __future__ import annotations

import mmap
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

ALIGN_BYTES = 64
_DIRECT_ALIGN = 4096      # O_DIRECT's alignment: the largest logical block size in use
_BOUNCE_BYTES = 1 << 20   # the bounce buffer and the direct write size (fitted to this VM:
#                           48 MiB copied, checksummed and written direct: 256 KiB 0.049 CPU-s,
#                           1 MiB 0.033, 4 MiB 0.034; 1 MiB stays small beside a rank's state)
Index = tuple[tuple[str, str, tuple[int, ...], int], ...]   # (key, dtype name, shape, offset)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def piece_index(tensors: dict[str, torch.Tensor]) -> tuple[Index, int]:
    """((key, dtype name, shape, byte offset) of each piece, in order, offsets 64-byte
    aligned; the total bytes, ≥ 64)."""
    index, offset = [], 0
    for key, value in tensors.items():
        index.append((key, str(value.dtype).removeprefix("torch."), tuple(value.shape), offset))
        offset += -(-value.numel() * value.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    return tuple(index), max(offset, ALIGN_BYTES)


def plan_packs(index: Index, prefix: str, max_bytes: int
               ) -> tuple[list[tuple[str, int, int]], dict[str, tuple[str, int]]]:
    """Consecutive pieces grouped into packs of ≤ max_bytes (a larger piece alone): ([(pack
    key f"{prefix}/{k}", first byte, end byte)], {piece key: (pack key, byte offset of the
    piece inside its pack)})."""
    packs: list[list] = []
    where: dict[str, tuple[str, int]] = {}
    for key, dtype, shape, offset in index:
        end = offset + nbytes(shape, getattr(torch, dtype))
        if not packs or end - packs[-1][1] > max_bytes:
            packs.append([f"{prefix}/{len(packs)}", offset, end])
        packs[-1][2] = max(packs[-1][2], end)
        where[key] = (packs[-1][0], offset - packs[-1][1])
    return [tuple(p) for p in packs], where


@dataclass(frozen=True, kw_only=True)
class Pack:
    """One pack's bytes: `parts`, (byte offset inside the pack, tensor) in offset order, and
    the pack's length `size`; the gaps are zeros."""
    parts: tuple[tuple[int, torch.Tensor], ...]
    size: int

    def chunks(self) -> Iterator[tuple[memoryview, int | None]]:
        """The pack's bytes in order: (bytes, their memory address, None for the zero gaps).
        A piece that is not contiguous CPU memory is copied alone, here (module docstring)."""
        at = 0
        for offset, value in self.parts:
            if offset > at:
                yield memoryview(bytes(offset - at)), None
            value = value.detach()
            if value.device.type != "cpu":
                value = value.cpu()
            value = value.contiguous().reshape(-1).view(torch.uint8)
            if value.numel():
                yield memoryview(value.numpy()), value.data_ptr()
            at = offset + value.numel()
            del value
        if self.size > at:
            yield memoryview(bytes(self.size - at)), None


def packs_of(tensors: dict[str, torch.Tensor], prefix: str, max_bytes: int
             ) -> tuple[dict[str, Pack], dict[str, tuple[str, int]]]:
    """The pieces `tensors` as packs (module docstring), without copying them: ({pack key:
    Pack}, {piece key: (pack key, byte offset inside it)})."""
    index, _ = piece_index(tensors)
    packs, where = plan_packs(index, prefix, max_bytes)
    parts: dict[str, list] = {key: [] for key, _, _ in packs}
    bounds = {key: lo for key, lo, _ in packs}
    for key, _, _, offset in index:
        pack = where[key][0]
        parts[pack].append((offset - bounds[pack], tensors[key]))
    return {key: Pack(parts=tuple(parts[key]), size=end - lo) for key, lo, end in packs}, where


class PackWriter(dcp.FileSystemWriter):
    """DCP's file writer for a state dict of Packs: one file a rank (`__<rank>_0.distcp`), the
    packs one after another (`PackFile`), `written`: {file name: [bytes, CRC-32]} (module
    docstring). direct: O_DIRECT where the file system takes it."""

    def __init__(self, path: str, *, direct: bool = True) -> None:
        super().__init__(path)
        self.direct = direct
        self.written: dict[str, list[int]] = {}

    def write_data(self, plan: Any, planner: Any) -> Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        f = PackFile(os.path.join(self.path, name), direct=self.direct)
        try:
            for item in plan.items:
                pack = planner.lookup_object(item.index)
                if not isinstance(pack, Pack):
                    raise TypeError(f"PackWriter writes Packs only; {item.index.fqn!r} is a "
                                    f"{type(pack).__name__} (use dcp.FileSystemWriter)")
                start = f.size
                for data, address in pack.chunks():
                    f.write(data, address)
                results.append(WriteResult(index=item.index, size_in_bytes=f.size - start,
                                           storage_data=_StorageInfo(name, start,
                                                                     f.size - start)))
        finally:
            f.close(sync=self.sync_files)
        self.written[name] = [f.size, f.crc]
        future: Future = Future()
        future.set_result(results)
        return future


class PackFile:
    """A file written from memory, its size and CRC-32 kept as it goes.

    direct: opened with O_DIRECT, the bytes go from memory to the device without the page
    cache. Buffered writes cost the writer the page cache's work — allocating a page for every
    4 KiB and copying into it, 0.015 – 0.16 CPU-s for 48 MiB on this VM, the most where fresh
    pages must be faulted in on the host (docs/benchmarks.md) — against ~0.004 CPU-s direct;
    the file is not left in the page cache either (what a checkpoint, read back only at a
    restart, does not need). DeepSpeed's FastPersist writes checkpoints the same way. O_DIRECT
    wants memory addresses, file offsets and lengths aligned to the device's block: memory
    that is (an asynchronous save's staged buffer: page-aligned, written at file offset 0) goes
    straight from there; the rest through a 1 MiB aligned bounce buffer (a memcpy, fused with
    the CRC pass), its last block padded and the file truncated back. A file system that
    refuses O_DIRECT (tmpfs, some network ones) gets buffered writes."""

    def __init__(self, path: str, *, direct: bool = True) -> None:
        self.size = self.crc = 0
        self._bounce: memoryview | None = None
        self._fill = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:
                pass
            else:
                self._map = mmap.mmap(-1, _BOUNCE_BYTES)       # page-aligned
                self._bounce = memoryview(self._map)
                if _direct_writes(self._fd, self._bounce):
                    return
                self._bounce.release()   # opened O_DIRECT, but its writes are refused
                self._map.close()
                self._bounce = None
                os.close(self._fd)
        self._fd = os.open(path, flags, 0o644)

    @property
    def direct(self) -> bool:
        return self._bounce is not None

    def write(self, data: memoryview, address: int | None = None) -> None:
        data = data.cast("B")
        if self._bounce is None:
            self.crc = zlib.crc32(data, self.crc)
            self._write(data)
            self.size += len(data)
            return
        pos = 0
        if address is not None and address % _DIRECT_ALIGN == 0 and self._fill == 0:
            whole = len(data) // _DIRECT_ALIGN * _DIRECT_ALIGN    # straight from memory
            for lo in range(0, whole, _BOUNCE_BYTES):
                block = data[lo:min(whole, lo + _BOUNCE_BYTES)]
                self.crc = zlib.crc32(block, self.crc)
                self._write(block)
            pos, self.size = whole, self.size + whole
        while pos < len(data):
            n = min(len(data) - pos, _BOUNCE_BYTES - self._fill)
            room = self._bounce[self._fill:self._fill + n]
            room[:] = data[pos:pos + n]
            self.crc = zlib.crc32(room, self.crc)
            self._fill, pos, self.size = self._fill + n, pos + n, self.size + n
            if self._fill == _BOUNCE_BYTES:
                self._flush()

    def close(self, *, sync: bool = True) -> None:
        """Write what the bounce buffer holds, truncate the padding, fsync (sync), close."""
        try:
            if self._bounce is not None and self._fill:
                self._flush()
                os.ftruncate(self._fd, self.size)
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            if self._bounce is not None:
                self._bounce.release()
                self._map.close()
                self._bounce = None

    def _flush(self) -> None:
        n = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
        self._bounce[self._fill:n] = bytes(n - self._fill)
        self._write(self._bounce[:n])
        self._fill = 0

    def _write(self, block: memoryview) -> None:
        done = 0
        while done < len(block):
            done += os.write(self._fd, block[done:])


def _direct_writes(fd: int, block: memoryview) -> bool:
    """Whether an O_DIRECT file takes an aligned write: some file systems accept the open and
    refuse the writes (EINVAL); one block written at offset 0 and truncated away tells."""
    try:
        os.write(fd, block[:_DIRECT_ALIGN])
    except OSError:
        return False
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    return True
