"""Process groups for a (t, p, d) layout, built once and passed around (never a global).

    device = init_distributed(world_size=plan.t * plan.p * plan.d, timeout_s=300)
    pg = ProcessGroups.create(plan.t, plan.p, plan.d, timeout_s=300)
    reduce_from_tp(x, pg.tensor); send_tensor(y, pg.next_pp_rank, pg.world)

Dead peers become errors, not hangs: every group gets a timeout, and gloo honours it (torch
2.13, measured): a recv from a live but silent peer raises after the group timeout ("Timed out
waiting N ms for recv"), a recv from a dead peer raises at once ("Connection reset by peer").
`PeerError` wraps both and names the peer. A group that timed out is unusable afterwards: the
job must exit (torchrun restarts it from the last checkpoint).
"""
from __future__ import annotations

import datetime
import socket
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from autopar.runtime import groups as G

DEFAULT_TIMEOUT_S = 300.0

_PEER_FAILURE_MARKERS = (
    "timed out", "timeout", "connection reset", "connection closed", "read error",
    "write error", "broken pipe", "socket closed", "connection refused", "peer",
    "communicator was aborted", "nccl error",
)


class PeerError(RuntimeError):
    """A collective or point-to-point operation failed because a peer rank died or stalled."""

    def __init__(self, message: str, peers: tuple[int, ...] = ()):
        super().__init__(message)
        self.peers = peers


def is_peer_failure(exc: BaseException) -> bool:
    """True if `exc` is what torch.distributed raises when a peer dies or a timeout expires."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _PEER_FAILURE_MARKERS)


def peer_error(op: str, peers: Iterable[int], exc: BaseException) -> PeerError:
    """A PeerError naming this rank, the operation and the peer(s), wrapping `exc`'s reason.

    `op` reads before the peer: "receive from", "send to", "all-reduce with".
    """
    peers = tuple(peers)
    me = dist.get_rank() if dist.is_initialized() else "?"
    who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {list(peers)}"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return PeerError(
        f"rank {me}: {op} {who} failed: {reason}. {who.capitalize()} has died or stopped "
        f"participating, so this job cannot continue; check that rank's log for the first error "
        f"(raise timeout_s if it was only slow; under torchrun --max-restarts the job resumes "
        f"from the last checkpoint).", peers)


@contextmanager
def peer_guard(op: str, group: Any, peers: Iterable[int] | None = None) -> Iterator[None]:
    """Turn a peer failure inside the block into a PeerError naming `op` and the peers (the
    other ranks of `group` unless `peers` is given); other errors pass through unchanged."""
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as exc:
        if not is_peer_failure(exc):
            raise
        others = list(peers) if peers is not None else [
            r for r in _group_ranks(group) if r != dist.get_rank()]
        raise peer_error(op, others, exc) from exc


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of `group`, or [] when they cannot be read (only words a message)."""
    try:
        return dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError):
        return []


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind to port 0, read it back); host ""
    binds every interface (a rendezvous other nodes reach through MASTER_ADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def timeout(timeout_s: float) -> datetime.timedelta:
    """timeout_s as the timedelta torch.distributed wants, validated."""
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s!r}: a process-group timeout must be > 0 seconds "
                         f"(nothing may hang); pass e.g. timeout_s=300")
    return datetime.timedelta(seconds=float(timeout_s))


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} in the environment is not an integer; "
                         f"launch with torchrun, which sets it") from None


def init_distributed(world_size: int | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     backend: str | None = None) -> torch.device:
    """Make sure the default process group exists; return this rank's device.

    Uses the caller's default group if there is one; else creates it from the torchrun
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the GPU) with
    nccl when CUDA is available and gloo otherwise. `world_size`, if given, is the plan's
    t*p*d and must equal the launched world size; this is checked before anything blocks.
    """
    td = timeout(timeout_s)
    if dist.is_initialized():
        _check_world(world_size, dist.get_world_size())
        return _device(dist.get_backend())
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        n = world_size or "N"
        raise ValueError(
            f"no default process group and {', '.join(missing)} not set in the environment: "
            f"autopar needs to run under torchrun; launch with "
            f"`torchrun --nproc_per_node={n} your_script.py` (or call "
            f"torch.distributed.init_process_group yourself first)")
    _check_world(world_size, _env_int("WORLD_SIZE"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = _device(backend)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    store = _restart_store(td)
    if store is not None:
        kwargs.update(store=store, rank=_env_int("RANK"), world_size=_env_int("WORLD_SIZE"))
    dist.init_process_group(backend, timeout=td, **kwargs)
    return device


def _restart_store(td: datetime.timedelta) -> Any:
    """Under a torchrun restart, the agent's store under a prefix of this attempt; else None.

    torchrun (torch 2.13, --standalone / c10d rendezvous) hands restarted workers the same
    agent TCPStore, which still holds the previous attempt's gloo addresses: a restarted rank
    can read a dead rank's address and fail with "Connection refused" (measured). Prefixing
    the store with TORCHELASTIC_RESTART_COUNT gives every attempt fresh keys.
    """
    restart = _env_int("TORCHELASTIC_RESTART_COUNT")
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          _env_int("WORLD_SIZE"), is_master=False, timeout=td)
    return dist.PrefixStore(f"autopar/attempt{restart}", store)


def _check_world(expected: int | None, actual: int) -> None:
    if expected is not None and expected != actual:
        raise ValueError(
            f"WORLD_SIZE={actual} but the plan needs t*p*d={expected} ranks: the launched "
            f"process count must equal the plan's GPU count; launch with "
            f"`torchrun --nproc_per_node={expected}` (or plan for gpus={actual})")


def _device(backend: str) -> torch.device:
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", _env_int("LOCAL_RANK") or 0)
    return torch.device("cpu")


def shared_stages(name: str, p: int) -> tuple[int, ...]:
    """The pipeline stages holding a shared weight of group `name` (ParamInfo.shared_with):
    "embedding" -> (0, p-1), "pipeline" -> 0..p-1, "stages:1,2" -> (1, 2)."""
    if name == "embedding":
        return tuple(sorted({0, p - 1}))
    if name == "pipeline":
        return tuple(range(p))
    return tuple(int(x) for x in name.partition(":")[2].split(","))


@dataclass(frozen=True, eq=False)
class ProcessGroups:
    """This rank's process groups and coordinates for a (t, p, d) layout (see groups.py).

    Ranks are global. `prev_pp_rank` / `next_pp_rank` wrap around the pipeline (the interleaved
    schedule sends from the last stage to the first); check `is_first_stage`/`is_last_stage`.
    """

    t: int
    p: int
    d: int                   # ranks holding the same weights: c·d (the gradient group)
    rank: int
    world_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    world: Any
    tensor: Any
    data: Any
    pipeline: Any
    embedding: Any
    model_parallel: Any
    tensor_ranks: tuple[int, ...]
    data_ranks: tuple[int, ...]
    pipeline_ranks: tuple[int, ...]
    embedding_ranks: tuple[int, ...]
    model_parallel_ranks: tuple[int, ...]
    prev_pp_rank: int
    next_pp_rank: int
    timeout_s: float
    # context parallelism (groups.py): c ranks split each sequence; `data` / `d` / `dp_rank`
    # are then the c·d ranks holding the same weights (gradients, ZeRO shards, the loss
    # average), and `replica_rank` / `replicas` the data-parallel share this rank loads
    c: int = 1
    cp_rank: int = 0
    context: Any = None
    context_ranks: tuple[int, ...] = ()
    replica_rank: int = 0
    replicas: int = 1
    # expert parallelism (groups.py): the experts spread over `ep` consecutive ranks of the
    # c·d (`expert`, this rank holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep)); `expert_data`:
    # the c·d/ep ranks holding the same experts (their gradients are reduced there)
    ep: int = 1
    ep_rank: int = 0
    expert: Any = None
    expert_data: Any = None
    expert_ranks: tuple[int, ...] = ()
    expert_data_ranks: tuple[int, ...] = ()
    # the hybrid context method (plan.cp_attention "hybrid"): per inner degree k the node
    # allows (groups.hybrid_candidates), this rank's (inner group, outer group)
    context_subgroups: dict = field(default_factory=dict)
    context_node_ranks: int = 1
    # a block called at several depths held by some pipeline stages only (not the first and
    # last, not all): stages -> this rank's group of those stages' ranks (add_stage_groups)
    stage_subgroups: dict = field(default_factory=dict)
    # purpose -> the gloo group over every rank for checkpoint traffic
    # (autopar.runtime.ckpt_store.checkpoint_group), made at the first save / preemption vote
    checkpoint_subgroups: dict = field(default_factory=dict)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.p - 1

    @classmethod
    def create(cls, t: int, p: int, d: int, *, c: int = 1, ep: int = 1,
               timeout_s: float = DEFAULT_TIMEOUT_S,
               hybrid_node_ranks: int | None = None) -> "ProcessGroups":
        """Create every group of the layout (collective: all ranks must call it, same args).
        hybrid_node_ranks (the hybrid context method): the context ranks one node holds; the
        inner and outer groups of every inner degree it allows are made too.

        torch requires every rank to enter `new_group` for every group, in the same order,
        members or not; the order here is groups.py's, so it is the same on all ranks.
        """
        if not dist.is_initialized():
            raise ValueError("ProcessGroups.create needs a default process group; call "
                             "autopar.runtime.dist.init_distributed() first (or run under "
                             "autopar.testing.spawn / torchrun)")
        n = G.world_size(t, p, d, c=c)
        _check_world(n, dist.get_world_size())
        td = timeout(timeout_s)
        rank = dist.get_rank()
        mine: dict[str, tuple[Any, tuple[int, ...]]] = {}
        families = (("tensor", G.tensor_groups), ("data", G.gradient_groups),
                    ("pipeline", G.pipeline_groups), ("embedding", G.embedding_groups),
                    ("model_parallel", G.model_parallel_groups))
        if c > 1:
            families += (("context", G.context_groups),)
        if ep > 1:
            families += (("expert", lambda *a, c: G.expert_groups(*a, c=c, ep=ep)),
                         ("expert_data", lambda *a, c: G.expert_data_groups(*a, c=c, ep=ep)))
        for name, family in families:
            for ranks in family(t, p, d, c=c):
                group = dist.new_group(ranks, timeout=td)
                if rank in ranks:
                    mine[name] = (group, tuple(ranks))
        subgroups = _hybrid_groups(t, p, d, c, hybrid_node_ranks, td, rank)
        mine.setdefault("embedding", (None, ()))  # middle pipeline stages hold no embedding
        mine.setdefault("context", (None, (rank,)))
        mine.setdefault("expert", (None, (rank,)))
        mine.setdefault("expert_data", mine["data"])
        tp, cp, dp, pp = G.rank_coords4(rank, t, p, d, c=c)
        prev_rank, next_rank = G.pipeline_neighbours(rank, t, p, d, c=c)
        return cls(
            t=t, p=p, d=c * d, rank=rank, world_size=n, tp_rank=tp, dp_rank=dp * c + cp,
            pp_rank=pp, c=c, cp_rank=cp, context=mine["context"][0],
            context_ranks=mine["context"][1], replica_rank=dp, replicas=d,
            world=dist.group.WORLD,
            tensor=mine["tensor"][0], data=mine["data"][0], pipeline=mine["pipeline"][0],
            embedding=mine["embedding"][0], model_parallel=mine["model_parallel"][0],
            tensor_ranks=mine["tensor"][1], data_ranks=mine["data"][1],
            pipeline_ranks=mine["pipeline"][1], embedding_ranks=mine["embedding"][1],
            model_parallel_ranks=mine["model_parallel"][1],
            prev_pp_rank=prev_rank, next_pp_rank=next_rank, timeout_s=float(timeout_s),
            ep=ep, ep_rank=G.expert_rank(rank, t, p, d, c=c, ep=ep), expert=mine["expert"][0],
            expert_data=mine["expert_data"][0], expert_ranks=mine["expert"][1],
            expert_data_ranks=mine["expert_data"][1], context_subgroups=subgroups,
            context_node_ranks=hybrid_node_ranks or 1)

    def add_stage_groups(self, subsets: Iterable[tuple[int, ...]]) -> None:
        """Make the group of every pipeline's stages `s` for each s in `subsets` (collective:
        every rank calls it with the same subsets; compile takes them from the chunk graphs,
        which every rank sees alike), keeping this rank's in `stage_subgroups`."""
        td = timeout(self.timeout_s)
        for stages in sorted(set(subsets)):
            for ranks in G.stage_subset_groups(stages, self.t, self.p, self.d // self.c,
                                               c=self.c):
                group = dist.new_group(ranks, timeout=td)
                if self.rank in ranks:
                    self.stage_subgroups[stages] = group

    def destroy_subgroups(self) -> None:
        """Destroy this rank's groups of the layout, not the default group: a runner released
        while the job goes on (`autopar tune` on a GPU, one candidate after another) frees
        their communicators. Every rank calls it at the same point, nothing in flight; the
        groups are unusable after."""
        groups = [self.tensor, self.data, self.pipeline, self.embedding, self.model_parallel,
                  self.context, self.expert, self.expert_data, *self.stage_subgroups.values(),
                  *self.checkpoint_subgroups.values(),
                  *(g for pair in self.context_subgroups.values() for g in pair)]
        seen: set[int] = set()
        for group in groups:
            if group is None or group is self.world or id(group) in seen \
                    or group is dist.GroupMember.NON_GROUP_MEMBER:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)

    def shared_group(self, name: str) -> Any:
        """The group a shared weight's gradients are summed over (ParamInfo.shared_with):
        "embedding", "pipeline" or "stages:1,2" (add_stage_groups)."""
        if name.startswith("stages:"):
            return self.stage_subgroups[shared_stages(name, self.p)]
        return getattr(self, name)

    def shared_ranks(self, name: str) -> tuple[int, ...]:
        """The global ranks of `shared_group(name)`, in stage order (this pipeline's ranks of
        the stages holding the shared weight)."""
        return tuple(self.pipeline_ranks[s] for s in shared_stages(name, self.p))

    def __repr__(self) -> str:
        return (f"ProcessGroups(rank={self.rank}, t={self.t}, p={self.p}, d={self.d}, "
                f"tp={self.tp_rank}, dp={self.dp_rank}, pp={self.pp_rank}, "
                f"tensor={list(self.tensor_ranks)}, data={list(self.data_ranks)}, "
                f"pipeline={list(self.pipeline_ranks)})")


def _hybrid_groups(t: int, p: int, d: int, c: int, node_ranks: int | None, td: Any,
                   rank: int) -> dict:
    """{k: (inner group, outer group)} of this rank for every inner degree k of the hybrid
    context method the node allows (groups.hybrid_candidates), made on every rank in
    groups.py's order; empty without `node_ranks` or with c = 1."""
    out: dict = {}
    for k in (G.hybrid_candidates(c, node_ranks) if node_ranks and c > 1 else ()):
        pair = []
        for family in (G.context_inner_groups, G.context_outer_groups):
            for ranks in family(t, p, d, c=c, k=k):
                group = dist.new_group(ranks, timeout=td)
                if rank in ranks:
                    pair.append(group)
        out[k] = tuple(pair)
    return out

