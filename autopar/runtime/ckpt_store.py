"""Where a checkpoint's files live: versions, the atomic commit, checksums, the background
writer, and which version a load may trust.

On disk, for a checkpoint path `ckpt`:

    ckpt               -> ckpt.ckpt-<uid>    the link; replaced atomically at each commit
    ckpt.ckpt-<uid>/   a complete version: DCP files, plan.json, autopar_layout.json (last)
    ckpt.tmp-<uid>/    a save in progress (or one that crashed: removed at the next commit)

The layout JSON lists every file of its version with its size and CRC-32 (`files`); each rank
checksums the files it writes as it writes them (`ChecksumFileSystem`). A load verifies them
first — sizes on every rank, checksums spread over the ranks — and a missing, truncated or
foreign file is one line naming it; when the newest version is bad, the previous complete
one (`keep` > 1) is used instead (`choose_version`). A real directory at `ckpt` (a copy made with `cp -rL`, which resolves the
link) loads as it is and is adopted at the first save: renamed to a version and linked.

Asynchronous save (autopar.runtime.ckpt_writer): the rank stages its pieces in shared host
memory and a background process of its own writes them with DCP over the writer processes'
gloo group, each checksums its files, the records meet on rank 0's writer, which commits only
after every writer's files are complete. The next save (and Runner.close) waits for the
previous one; a rank that dies mid-write leaves the previous version current.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

LAYOUT_FILE = "autopar_layout.json"
_BLOCK_BYTES = 1 << 20


def checkpoint_group(groups: Any, purpose: str = "save") -> Any:
    """A gloo group over every rank for checkpoint traffic, one per purpose ("save": the
    (background) writer's collectives; "vote": the preemption vote, issued by the main thread
    while a save may be in flight), created once per `groups` (collective on first use) and
    kept in its `checkpoint_subgroups`, so it lives and is destroyed with the runner's other
    groups (ProcessGroups.destroy_subgroups).

    Two module-level caches came before. Keyed by id(groups), a program compiled after an
    earlier one was freed could get the freed object's address on some ranks and not others:
    those ranks reused the old group while the rest entered `new_group`, and every rank waited
    out its timeout (the checkpoint matrix's rare save hang). Holding `groups` beside its
    group, the cache kept every process group of the job alive past `destroy_process_group`
    into the interpreter's teardown, where a gloo worker releasing a finished collective's
    tensors took the finalizing interpreter's GIL and aborted the process (autopar/runtime/
    hooks.py)."""
    mine = groups.checkpoint_subgroups
    if purpose not in mine:
        mine[purpose] = dist.new_group(backend="gloo", timeout=datetime.timedelta(
            seconds=float(getattr(groups, "timeout_s", 600.0))))
    return mine[purpose]


def crc32_file(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(_BLOCK_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


class _ChecksumStream(io.RawIOBase):
    """A file being written, its size and CRC-32 kept up as the bytes go by."""

    def __init__(self, raw: Any):
        super().__init__()
        self.raw, self.size, self.crc = raw, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()


class ChecksumFileSystem(FileSystem):
    """DCP's file system, recording each written file's [bytes, CRC-32] as it is written
    (`written`, by file name): a save's checksums without reading its files back."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _ChecksumStream(raw)
            yield stream
            stream.flush()
            self.written[Path(path).name] = [stream.size, stream.crc]


def file_records(directory: Path, names: list[str]) -> dict[str, list[int]]:
    """{file name: [bytes, CRC-32]} of the named files of `directory`."""
    return {n: [(directory / n).stat().st_size, crc32_file(directory / n)] for n in names}


def own_files(directory: Path, rank: int) -> list[str]:
    """The DCP data files this rank wrote (FileSystemWriter names them __<rank>_<i>.distcp)."""
    return sorted(f.name for f in directory.glob(f"__{rank}_*.distcp"))


# ---- versions and the commit -----------------------------------------------------------------

def versions(path: Path) -> list[Path]:
    """The complete versions of checkpoint `path`, newest first: the link's target (or `path`
    itself when it is a real directory), then the other kept ones by their step."""
    out: list[Path] = []
    if path.is_dir():
        out.append(path.resolve() if path.is_symlink() else path)
    kept = []
    for d in path.parent.glob(f"{path.name}.ckpt-*"):
        if d.is_dir() and (d / LAYOUT_FILE).is_file() and d.resolve() not in out:
            kept.append((_step_of(d), d.stat().st_mtime, d))
    return out + [d for *_, d in sorted(kept, key=lambda k: k[:2], reverse=True)]


def _step_of(d: Path) -> int:
    try:
        return int(json.loads((d / LAYOUT_FILE).read_text()).get("step", -1))
    except (OSError, ValueError):
        return -1


def adopt_copy(path: Path, uid: str) -> None:
    """A real directory holding a complete checkpoint at `path` (a `cp -rL` copy) becomes a
    version and `path` its link (rank 0, before a save); anything else there is refused."""
    if not path.exists() or path.is_symlink():
        return
    if not (path.is_dir() and (path / LAYOUT_FILE).is_file()):
        raise ValueError(f"save_checkpoint: {path} exists and is not an autopar checkpoint "
                         f"(no link, no {LAYOUT_FILE}); autopar keeps `path` as a link to its "
                         f"latest complete version: pick another path or remove {path}")
    final = path.parent / f"{path.name}.ckpt-{uid}-adopted"
    os.rename(path, final)
    os.symlink(final.name, path)


def commit(path: Path, tmp: Path, uid: str, keep: int = 1) -> None:
    """Make `path` point at the finished `tmp` (atomic), then delete all but the `keep`
    newest versions and any leftover temporaries."""
    final = path.parent / f"{path.name}.ckpt-{uid}"
    os.rename(tmp, final)
    link = path.parent / f"{path.name}.link-{uid}"
    os.symlink(final.name, link)
    os.replace(link, path)            # the commit point: before it the old version is current
    fsync_dir(path.parent)
    kept = {d.name for d in versions(path)[:max(1, keep)]}
    for old in path.parent.glob(f"{path.name}.*"):
        stale = (old.name.startswith(f"{path.name}.ckpt-") and old.name not in kept) or \
            old.name.startswith((f"{path.name}.tmp-", f"{path.name}.link-"))
        if stale and old.name != final.name:
            if old.is_symlink() or old.is_file():
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- verification ----------------------------------------------------------------------------

def check_files(directory: Path, layout: dict, rank: int = 0, world: int = 1) -> str | None:
    """The first problem with `directory`'s files against the layout's sizes and checksums
    (sizes of every file; checksums of the files i ≡ rank mod world), or None. Layouts
    written before checksums (no `files`) pass."""
    files = layout.get("files")
    if not files:
        return None
    for i, (name, (size, crc)) in enumerate(sorted(files.items())):
        file = directory / name
        if not file.is_file():
            return (f"{file} is missing (the layout lists {size} bytes); the checkpoint was "
                    f"copied or deleted in part: copy the whole directory again")
        have = file.stat().st_size
        if have != size:
            return (f"{file} has {have} bytes, the layout says {size} (truncated or "
                    f"overwritten); copy it again from the original checkpoint")
        if i % world == rank and crc32_file(file) != crc:
            return (f"{file} has CRC-32 {crc32_file(file):08x}, the layout says {crc:08x} (a "
                    f"corrupt file, or one from another checkpoint); copy it again from the "
                    f"original checkpoint")
    return None


def choose_version(path: Path, read_layout: Callable[[Path], dict], group: Any = None
                   ) -> tuple[Path, list[str]]:
    """The newest version of `path` whose files are all sound (every rank agrees; collective
    over `group` when given) and the one-line reasons the newer ones were skipped; ValueError
    naming the newest version's problem when none is sound."""
    multi = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if multi else (0, 1)
    skipped: list[str] = []
    for version in versions(path) or [path]:
        try:
            problem = check_files(version, read_layout(version), rank, world)
        except ValueError as exc:
            problem = str(exc)
        if multi:
            problems: list[Any] = [None] * world
            dist.all_gather_object(problems, problem, group=group)
            problem = next((p for p in problems if p), None)
        if problem is None:
            return version, skipped
        skipped.append(problem)
    raise ValueError(f"load_checkpoint: no sound version of {path}: {skipped[0]}"
                     + (f" (and {len(skipped) - 1} older kept versions are bad too)"
                        if len(skipped) > 1 else ""))
