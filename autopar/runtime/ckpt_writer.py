"""The asynchronous checkpoint writer: one background *process* per rank, started at the
first asynchronous save, that writes each save's staged pieces with DCP over a gloo group of
the writer processes and commits them, at the lowest CPU priority.

Why a process and not a thread: a writer thread shares the rank's GIL. DCP's planning, its
pickling and the layout work are Python, so a writer thread takes the GIL from the training
loop between every two PyTorch ops; at a low CPU priority it is also descheduled while holding
the GIL, and the training thread waits for it (measured at d = 4 on 2 cores: the overlapped
steps slowed by 1.03–1.23× the whole synchronous save). A process shares no lock with
training, and at nice 19 it takes only the cycles training leaves idle. Megatron-Core's
persistent async worker and DCP's own `AsyncCheckpointerType.PROCESS` are built the same way.

Protocol. The caller stages the pieces (`stage`): one flat shared-memory byte buffer
(page-locked with cudaHostRegister once the pieces are on a GPU, as DCP's pinned shared staging
does, so the device-to-host copies are DMA transfers that overlap one another; `pin_host`)
holding every piece at its offset of autopar.runtime.ckpt_packs.piece_index, zeros between,
reused from save to save (1× the rank's written bytes of host memory while the job runs).
`ProcessWriter.start(fn, job, staged, groups)` sends `fn`, `job` and the buffer (one file
descriptor, torch.multiprocessing's sharing) down a pipe; the process rebuilds the packs
(`Staged.packed`, `Staged.packs`: raw byte packs over the buffer, byte for byte what a
synchronous save writes) and calls `fn(job, packs)` — for checkpoints
`autopar.runtime.checkpoint.write_version`, the same function a synchronous save runs on the
rank itself, whose ckpt_packs.PackWriter writes the page-aligned buffer to the file with
O_DIRECT — then answers ("ok", None) or ("error", text). Where its CPU goes: with
AUTOPAR_CKPT_PROFILE=DIR each save is profiled (cProfile on process CPU time, all threads)
into DIR/writer<rank>-<uid>.prof. `wait()` blocks for the
answer and raises `CheckpointWriteError` with the writer's text; `busy` polls. At most one save
is in flight per rank: `start` waits for the previous one. The writers' group is created once,
collectively, at the first asynchronous save: rank 0 picks a free port on MASTER_ADDR (the
job's) and every writer joins a TCPStore there, with the job's process-group timeout.

Failure: a writer whose rank dies finishes or fails its write on its own (its pipe closes; it
exits after the current save); a commit needs every writer's files, so a rank that dies before
its writer reports leaves the previous version current (autopar.runtime.ckpt_store). A writer
that dies is an error at the next `wait()`, naming the rank. `close()` (Runner.close) waits for
the save in flight and stops the process.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.runtime.ckpt_packs import Index, Pack, nbytes, piece_index, plan_packs
from autopar.runtime.dist import free_port


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed (the writer's one-line reason)."""


@dataclass(frozen=True, kw_only=True)
class Staged:
    """Pieces staged for a background write: `flat` (a shared-memory uint8 buffer) and, per
    key, (dtype name, shape, byte offset) of its piece inside it (ckpt_packs.piece_index)."""
    flat: torch.Tensor
    index: Index

    def pieces(self) -> dict[str, torch.Tensor]:
        """The pieces, as tensors over the buffer's memory whose storage is exactly the piece
        (torch.frombuffer on a slice)."""
        out = {}
        memory = memoryview(self.flat.numpy())
        for key, dtype, shape, offset in self.index:
            dt = getattr(torch, dtype)
            n = nbytes(shape, dt)
            raw = (torch.frombuffer(memory[offset:offset + n], dtype=torch.uint8) if n
                   else torch.empty(0, dtype=torch.uint8))
            out[key] = raw.view(dt).view(shape)
        return out

    def packed(self, prefix: str, max_bytes: int) -> tuple["Staged", dict[str, tuple[str, int]]]:
        """The buffer as a few packs instead of one item per piece (ckpt_packs.plan_packs:
        the same packs a synchronous save writes), each a uint8 piece f"{prefix}/{k}" of this
        buffer. Returns (the packs as a Staged, {piece key: (pack key, byte offset of the
        piece inside its pack)})."""
        packs, where = plan_packs(self.index, prefix, max_bytes)
        index = tuple((key, "uint8", (end - lo,), lo) for key, lo, end in packs)
        return Staged(flat=self.flat, index=index), where

    def packs(self) -> dict[str, Pack]:
        """Each piece as a Pack over the buffer's memory (of a `packed` Staged: the packs)."""
        return {key: Pack(parts=((0, value),), size=value.numel() * value.element_size())
                for key, value in self.pieces().items()}


def pin_host(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer` (host memory this process already owns, here shared memory) for the
    CUDA device in place: cudaHostRegister, flag 1 (portable), as torch.distributed's
    _create_cpu_state_dict(pin_memory=True, share_memory=True) does; `pin_memory()` would copy
    it out of shared memory. False where it cannot be pinned (no CUDA, an empty buffer, the
    driver refused): the copies then go to pageable memory, correct and slower."""
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1)
    return int(err) == 0


def unpin_host(buffer: torch.Tensor) -> None:
    """Undo pin_host."""
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class ProcessWriter:
    """The rank's background writer process (module docstring)."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._conn: Any = None
        self._key: Any = None
        self._rank = 0
        self._pending = False
        self._buffer: torch.Tensor | None = None
        self._pinned = False
        self._error: BaseException | None = None

    # ---- staging ----------------------------------------------------------------------------

    def stage(self, tensors: dict[str, torch.Tensor]) -> Staged:
        """Copy the pieces into this rank's shared staging buffer (allocated at the first save,
        reused while the total size stays the same), the gaps between them zero (the bytes a
        synchronous save's packs hold there). Waits for the save in flight first."""
        self.wait()
        index, total = piece_index(tensors)
        if self._buffer is None or self._buffer.numel() != total:
            self._release()
            self._buffer = torch.zeros(total, dtype=torch.uint8).share_memory_()
        if not self._pinned and any(v.is_cuda for v in tensors.values()):
            self._pinned = pin_host(self._buffer)
        staged = Staged(flat=self._buffer, index=index)
        ends = [offset + nbytes(shape, getattr(torch, dtype))
                for _, dtype, shape, offset in index]
        for end, (*_, nxt) in zip(ends, index[1:] + (("", "", (), total),)):
            if end < nxt:                     # < 64 bytes: a reused buffer's old bytes
                self._buffer[end:nxt].zero_()
        cuda = False
        for value, view in zip(tensors.values(), staged.pieces().values()):
            view.copy_(value.detach(), non_blocking=value.is_cuda)
            cuda = cuda or value.is_cuda
        if cuda:
            torch.cuda.synchronize()
        return staged

    # ---- the process ------------------------------------------------------------------------

    def start(self, fn: Callable[[Any, dict], None], job: Any, staged: Staged,
              groups: Any) -> None:
        """Hand one save to the writer process (started, collectively, on first use)."""
        self.wait()
        self._ensure(groups)
        self._conn.send((fn, job, staged))
        self._pending = True

    def wait(self) -> None:
        """Block until the save in flight is committed; raise CheckpointWriteError if it failed."""
        if self._pending:
            self._pending = False
            try:
                kind, text = self._conn.recv()
            except (EOFError, OSError):
                kind, text = "error", (f"the checkpoint writer process of rank {self._rank} died "
                                       f"during the write (exit code {self._proc.exitcode}); "
                                       f"the checkpoint's link names the newest complete "
                                       f"version, which a load uses")
                self._proc = None
            if kind == "error":
                self._error = CheckpointWriteError(text)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @property
    def busy(self) -> bool:
        """A save is in flight and has not answered yet."""
        return self._pending and not self._conn.poll()

    def _release(self) -> None:
        """Unpin the staging buffer (before it is dropped or replaced)."""
        if self._pinned and self._buffer is not None:
            unpin_host(self._buffer)
        self._pinned = False

    def close(self) -> None:
        """Wait for the save in flight, then stop the process."""
        try:
            self.wait()
            self._release()
        finally:
            if self._proc is not None:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
                self._proc.join(timeout=30)
                if self._proc.is_alive():
                    self._proc.kill()
                self._conn.close()
            self._proc = self._conn = self._key = None

    def _ensure(self, groups: Any) -> None:
        multi = groups is not None and groups.world_size > 1
        key = groups if multi else None   # the object itself: an id() of a freed groups
        # can be reused on some ranks only, and then only those would skip the collective
        # restart below (autopar.runtime.ckpt_store.checkpoint_group)
        if self._proc is not None and self._proc.is_alive() and self._key is key:
            return
        self.close()
        rank, world = (groups.rank, groups.world_size) if multi else (0, 1)
        addr, port = _rendezvous(groups) if multi else ("", 0)
        timeout_s = float(getattr(groups, "timeout_s", 600.0))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_serve, name=f"autopar-ckpt-writer{rank}",
                                 args=(child, addr, port, rank, world, timeout_s), daemon=True)
        self._proc.start()
        child.close()
        self._conn, self._key, self._rank = parent, key, rank


def _rendezvous(groups: Any) -> tuple[str, int]:
    """(address, port) of the writers' TCPStore: rank 0's free port on MASTER_ADDR, broadcast
    over the checkpoint group (collective)."""
    from autopar.runtime.ckpt_store import checkpoint_group
    box: list[Any] = [None]
    if groups.rank == 0:
        box[0] = (os.environ.get("MASTER_ADDR", "127.0.0.1"), free_port(""))
    group = checkpoint_group(groups)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _serve(conn: Any, addr: str, port: int, rank: int, world: int, timeout_s: float) -> None:
    """The writer process: lowest priority, its own gloo group, one save per message."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    except (AttributeError, OSError):    # not Linux, or not permitted: the same priority
        pass
    torch.set_num_threads(1)
    if world > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
    kept = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):       # the rank is gone
            break
        if msg is None:
            break
        fn, job, staged = msg
        # The staging buffer arrives as a file descriptor with every save, and torch reuses
        # its mapping of that memory (torch.multiprocessing's shared cache) only while a
        # tensor over it lives. Kept here, the next save reads the same mapping instead of
        # mapping it again and page-faulting through all of it (the writer's CPU per 48 MiB
        # save 0.07 → 0.03–0.04 s, benchmarks/checkpoint.py). A buffer the rank replaced (its
        # shard size changed) is let go at the next save.
        kept = staged.flat  # noqa: F841 (held, not read)
        try:
            _profiled(fn, job, staged, rank)
            answer = ("ok", None)
        except BaseException as exc:   # noqa: BLE001 - every failure goes back to the rank
            answer = ("error", f"{type(exc).__name__}: {exc}")
        del staged, msg
        try:
            conn.send(answer)
        except OSError:
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _profiled(fn: Callable[[Any, dict], None], job: Any, staged: Staged, rank: int) -> None:
    """fn(job, staged.packs()), under cProfile when AUTOPAR_CKPT_PROFILE names a directory."""
    prof_dir = os.environ.get("AUTOPAR_CKPT_PROFILE")
    if not prof_dir:
        return fn(job, staged.packs())
    import cProfile
    import time
    pr = cProfile.Profile(time.process_time)
    pr.enable()
    try:
        return fn(job, staged.packs())
    finally:
        pr.disable()
        pr.dump_stats(f"{prof_dir}/writer{rank}-{job.uid}.prof")


WRITER = ProcessWriter()
