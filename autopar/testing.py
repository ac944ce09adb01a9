"""Multi-process test harness: run a function on N local gloo ranks, with a deadline.

    from autopar.testing import spawn
    results = spawn(my_fn, 2, arg, timeout_s=60)   # my_fn(rank, world_size, arg) on 2 ranks

`fn` must be importable by a fresh interpreter (defined at module level of an importable module:
a test file under pytest is fine, pytest's sys.path is handed to the children). Children are
started with the "forkserver" method: forked from a clean single-threaded server process that
imported torch (and the modules named by `preload`) once, so a child starts in ~0.1 s instead of
re-importing torch (~2 s; transformers ~5 s); never forked from the caller (torch and gloo threads
do not survive a fork). Each child takes the caller's environment as it is at the call,
initialises a gloo default process group on 127.0.0.1 with a process-group timeout, runs
`fn(rank, world_size, *args, **kwargs)` and sends its (picklable) result back over a pipe.

Failure modes, all of which end every child:
- a rank raises -> `SpawnError` in the parent carrying that rank's traceback text (and the
  original exception as `__cause__` when it pickles);
- a rank exits without a result (crash, os._exit, killed) -> `SpawnError`, unless it is listed
  in `allow_exit`, in which case its result is None;
- the deadline passes -> every child is killed and `TimeoutError` names the unfinished ranks.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.collector import collector_paused
from autopar.runtime.dist import free_port  # noqa: F401  (tests and benchmarks import it here)

_GRACE_S = 3.0  # after the first error, how long to wait for the other ranks' own errors
# autopar.compile pulls in the runtime; torch._dynamo (every compile()'s torch.export), the
# checkpoint module (torch.distributed.checkpoint) and torch.distributed.pipelining (the split
# backward's) are imported where first used, so named here: ~4 s of imports a rank would
# otherwise pay at its first compile(), save or zero-bubble step
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "autopar.api", "autopar.compile",
            "autopar.runtime.checkpoint", "torch.distributed.pipelining"]


def preload(*modules: str) -> None:
    """Have the fork server import `modules` too (call before the first spawn; later calls
    take effect only if the server has not started yet). Modules that fail to import are
    skipped by the server."""
    for m in modules:
        if m not in _PRELOAD:
            _PRELOAD.append(m)


class SpawnError(RuntimeError):
    """A spawned rank raised or died; `rank` and `remote_traceback` say which and where."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def _child(conn, fn, rank, world_size, port, pg_timeout_s, backend, env_at_call, args,
           kwargs) -> None:
    """Why this size: the spawned rank's entry point: its arguments are what multiprocessing passes
    it (pipe, function, rank, world, port, timeout, backend, environment, args, kwargs)."""
    # the fork server's environment is the one of its start: take the caller's of this call
    os.environ.clear()
    os.environ.update(env_at_call)
    torch.set_num_threads(1)  # 2 shared cores: N ranks x M threads would thrash
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
           "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world_size)}
    os.environ.update(env)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args, **kwargs)
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        text = traceback.format_exc()
        try:  # the exception travels as its own pickle: it may not unpickle in the parent
            exc_bytes = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - text only then
            exc_bytes = None
        payload = pickle.dumps(("err", text, exc_bytes))
    conn.send_bytes(payload)
    # Stay alive until the parent has every rank's result: rank 0 hosts the TCPStore, and a
    # rank still creating groups fails if it exits early. The parent closing the pipe is the go.
    try:
        conn.recv_bytes()
    except (EOFError, OSError):
        pass
    # Skip interpreter teardown: gloo threads of a group whose peers died can block exit.
    os._exit(0)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _server_environment() -> dict[str, str | None]:
    """Set what the fork server inherits (one thread; PYTHONPATH = the caller's sys.path: the
    server ignores the sys.path multiprocessing hands it on Python 3.11, and could not preload
    modules found through a test folder); returns the previous values for `_restore`. The
    children get the caller's environment with one thread, the caller's PYTHONPATH."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    return saved


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def start_server(log_path: str | os.PathLike | None = None) -> None:
    """Start the fork server now; its imports (`preload`) run in the background while the
    caller goes on (a test session: while pytest collects), and the first `spawn` finds it
    ready instead of waiting for them. Optional: `spawn` starts it otherwise.

    log_path: the server's and its ranks' standard error go to this file (appended) instead
    of the caller's terminal — the ranks' warnings and the native libraries' messages, which
    a test session started before pytest captures anything would print between its dots;
    failures still come back through `spawn` with their tracebacks."""
    from multiprocessing import forkserver
    _context()
    saved = _server_environment()
    err = None
    if log_path is not None:
        sys.stderr.flush()
        err = os.dup(2)
        fd = os.open(os.fspath(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        forkserver.ensure_running()
    finally:
        if err is not None:
            os.dup2(err, 2)
            os.close(err)
        _restore(saved)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
          pg_timeout_s: float | None = None, backend: str = "gloo",
          allow_exit: Iterable[int] = (), **kwargs: Any) -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` gloo ranks; return the results.

    timeout_s: deadline for the whole run (children killed after it). pg_timeout_s: the process
    group timeout inside the children (default min(60, timeout_s / 2)), so a stuck collective
    raises in the child well before the parent's deadline. allow_exit: ranks that may exit
    without returning (their result is None), for tests that kill a rank on purpose.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1; pass the number of ranks")
    pg_timeout_s = pg_timeout_s if pg_timeout_s is not None else min(60.0, timeout_s / 2)
    allowed = set(allow_exit)
    ctx = _context()
    port = free_port()
    procs, conns = [], []
    saved = _server_environment()   # the server is started by the first call
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if saved["PYTHONPATH"] is not None:   # the children: the caller's own
        env["PYTHONPATH"] = saved["PYTHONPATH"]
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            # not daemonic: a rank may start children (its checkpoint writer process); every
            # rank is killed in the `finally` below if it outlives the run
            proc = ctx.Process(target=_child, daemon=False, name=f"autopar-rank{rank}",
                               args=(child_end, fn, rank, world_size, port, pg_timeout_s,
                                     backend, env, args, kwargs))
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
    finally:
        _restore(saved)
    grace_s = 2.0
    try:
        return _collect(procs, conns, time.monotonic() + timeout_s, timeout_s, allowed)
    except TimeoutError:
        grace_s = 0.0   # the unfinished ranks are stuck: no point waiting for them to exit
        raise
    finally:
        for c in conns:
            c.close()  # finished children exit on EOF; the rest are terminated
        _kill_all(procs, grace_s)


def _last_line(exc: BaseException) -> str:
    """A rank's error in one line: the last line of its traceback text (the exception), not
    the "rank N raised:" heading."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _collect(procs, conns, deadline: float, timeout_s: float, allowed: set[int]) -> list[Any]:
    n = len(procs)
    results: dict[int, Any] = {}
    errors: list[SpawnError] = []
    pending = set(range(n))
    while pending:
        now = time.monotonic()
        if errors:
            deadline = min(deadline, errors[0].at + _GRACE_S)
        if now >= deadline:
            break
        waitables = {conns[r]: r for r in pending}
        waitables.update({procs[r].sentinel: r for r in pending})
        for obj in connection.wait(list(waitables), timeout=deadline - now):
            rank = waitables[obj]
            if rank not in pending:
                continue
            outcome = _read(rank, conns[rank], procs[rank])
            if outcome is None:  # the process ended but its message is not readable yet
                continue
            pending.discard(rank)
            kind, value = outcome
            if kind == "ok":
                results[rank] = value
            elif kind == "died" and rank in allowed:
                results[rank] = None
            else:
                value.at = time.monotonic()
                errors.append(value)
    if errors:
        first = errors[0]
        others = "".join(f"\n(also rank {e.rank}: {_last_line(e)})" for e in errors[1:])
        raise SpawnError(first.rank, f"{first}{others}", first.remote_traceback) \
            from first.__cause__
    if pending:
        done = sorted(set(range(n)) - pending)
        raise TimeoutError(
            f"spawn: ranks {sorted(pending)} of {n} had not finished after {timeout_s:.0f} s "
            f"(finished: {done}); all ranks were killed. A rank is stuck (deadlock or a "
            f"collective only some ranks entered); raise timeout_s if it is only slow.")
    return [results[r] for r in range(n)]


def _read(rank: int, conn, proc) -> tuple[str, Any] | None:
    try:
        if conn.poll():
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "ok":
                return "ok", msg[1]
            text, exc = msg[1], None
            try:
                exc = pickle.loads(msg[2]) if msg[2] is not None else None
            except Exception:  # noqa: BLE001 - e.g. an exception class with required args
                pass
            err = SpawnError(rank, f"rank {rank} raised:\n{text}", text)
            err.__cause__ = exc
            return "err", err
    except (EOFError, OSError):
        pass
    proc.join(timeout=1.0)
    if proc.exitcode is None:
        return None
    return "died", SpawnError(
        rank, f"rank {rank} exited with code {proc.exitcode} without returning a result "
              f"(crashed, killed, or called os._exit; if it never started, check that the function "
              f"is defined at module level of an importable module); its stderr is above")


def _kill_all(procs, grace_s: float) -> None:
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def refuse_reduce_scatter() -> list[tuple]:
    """Make this process's torch.distributed refuse reduce-scatter, as a backend without it
    does (NotImplementedError), so autopar's collectives take their all-reduce + slice
    fallback; returns the list the refused calls are appended to (to check the fallback ran).
    For spawned test ranks only: it rebinds the functions in torch.distributed."""
    refused: list[tuple] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        refused.append(args)
        raise NotImplementedError("reduce_scatter is not supported by this backend (test)")
    dist.reduce_scatter_tensor = refuse
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single = refuse
    return refused


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null for the block: what C++ prints there (torch 2.13's
    kineto announces every profiler start and stop, at any KINETO_LOG_LEVEL that keeps its
    errors) is dropped; Python's own stderr is flushed first and unchanged after."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_tensor_bytes(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """(fn(), peak, end): the most CPU tensor bytes live at once while `fn` ran, and those
    still live when it returned, both counted from its start (torch.profiler's allocator
    events, profile_memory=True). Unlike the process's resident size this ignores the
    allocator's cached and fragmented pages and the interpreter, so it measures what `fn`
    materialised; benchmarks/compile_memory.py reports both. A block allocated before the
    start frees as 0 bytes (in_window): `step_peak_tensor_bytes` for what a repeated step
    holds."""
    result, events = _memory_events(fn, marked=False)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak, live


def step_peak_tensor_bytes(step: Callable[[], Any]) -> int:
    """The most CPU tensor bytes one call of `step` holds at once above what was live when it
    started. `step` runs twice under the profiler and the second call is read: what it frees
    of the first call's allocations (last step's gradients) is then counted, which
    peak_tensor_bytes cannot do for blocks allocated before it started."""
    from torch.profiler import record_function

    def twice() -> None:
        step()
        with record_function(_MARK):
            step()
    _, events = _memory_events(twice, marked=True)
    start, end = events.pop()
    live = peak = at_start = 0
    for t, nbytes in events:
        if t > end:
            break
        live += nbytes
        if t < start:
            at_start = peak = live
        else:
            peak = max(peak, live)
    return peak - at_start


_MARK = "autopar::measured_call"


def in_window(events: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(ns, bytes) of the allocator's (ns, bytes, address) events in time order, a free counted
    only when its block was allocated inside the window, at its own size; other frees are 0.
    Two things make the profiler's own sizes wrong for such a block. c10's CPU allocator
    reporter keeps an address -> size table while profiling and does not erase an entry
    whose block is freed with profiling off: a later block at that address frees under the
    stale size (test_held_bytes failed so in CI, 2026-11-28, 8 KiB read for 12). And a block
    allocated before any profiling frees as 0 bytes. Events of one nanosecond keep the order
    they were recorded in (a stable sort): an allocation before a free stamped alike."""
    live: dict[int, int] = {}
    out = []
    for ns, nbytes, address in sorted(events, key=lambda ev: ev[0]):
        if nbytes > 0:
            live[address] = nbytes
            out.append((ns, nbytes))
        elif address in live:
            out.append((ns, -live.pop(address)))
    return out


def _memory_events(fn: Callable[[], Any], *, marked: bool) -> tuple[Any, list]:
    """(fn(), [(ns, bytes) of each CPU allocator event, in time order, see in_window]);
    `marked`: fn ran a call under record_function(_MARK), whose (start, end) ns is appended
    last."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with collector_paused(collect_first=True):   # no other objects' finalizers in the window
        with _quiet_native_stderr():   # kineto's "USDT: profiler_start" lines, one per call
            prof.start()
        try:
            result = fn()
        finally:
            with _quiet_native_stderr():
                prof.stop()
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    allocs = [(n.start_time_ns, n.extra_fields) for n in nodes
              if type(n.extra_fields).__name__ == "_ExtraFields_Allocation"]
    out = in_window([(ns, f.alloc_size, f.ptr) for ns, f in allocs if f.device.type == "cpu"])
    if marked:
        mark = next(n for n in nodes if n.name == _MARK)
        out.append((mark.start_time_ns, mark.end_time_ns))
    return result, out


def _walk(nodes: list) -> Iterator[Any]:
    """The profiler's event tree in pre-order: each event before its children, siblings in
    time order, so allocator events of one nanosecond come in the order they were recorded."""
    for node in nodes:
        yield node
        yield from _walk(node.children)


def held_tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages (CPU or not) reachable from `root` through its
    attributes, containers and closures, each tensor's `.grad` and `.main_grad` included; not
    through modules, classes or a function's globals, which lead to other objects' tensors.
    What an object holds between steps where no allocator keeps a count (a CPU): views and
    tied weights count once; a released weight (0-byte storage, zero=3) counts nothing."""
    import gc
    import types
    opaque = (types.ModuleType, type, types.BuiltinFunctionType)
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, opaque):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            grad = obj.grad if obj.is_leaf else None      # a non-leaf's .grad only warns
            for t in (obj, grad, getattr(obj, "main_grad", None)):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    try:
                        s = t.untyped_storage()
                    except (RuntimeError, NotImplementedError):   # a wrapper subclass: its
                        stack.extend(gc.get_referents(t))         # inner tensors instead
                        continue
                    storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(obj, types.FunctionType):
            stack.extend(obj.__closure__ or ())
        else:
            stack.extend(gc.get_referents(obj))
    storages.pop(0, None)   # empty storages share the null pointer
    return sum(storages.values())
