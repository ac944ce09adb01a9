"""Spawn harness, ProcessGroups and fault handling on local gloo ranks (tiny: 2-4 processes)."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from autopar.runtime import groups as G
from autopar.runtime.collectives import recv_tensor, send_tensor
from autopar.runtime.dist import PeerError, ProcessGroups, init_distributed
from autopar.testing import SpawnError, spawn

pytestmark = pytest.mark.distributed


# ---- workers (module level: the spawned children import them from this file) --------------

def _echo(rank, world_size, base, scale=1):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return base + scale * rank, t.item()


def _raise_on_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_on_1(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def _env_and_threads(rank, world_size):
    return os.environ.get("AUTOPAR_TEST_MARK"), torch.get_num_threads(), os.getpid()


def test_spawned_ranks_see_the_environment_of_the_call(monkeypatch):
    """The ranks fork from a server started by an earlier spawn: they still get the caller's
    environment as it is at this call, one thread each, and a process of their own."""
    spawn(_env_and_threads, 1)                  # the fork server runs from here on
    monkeypatch.setenv("AUTOPAR_TEST_MARK", "set-after-the-server-started")
    out = spawn(_env_and_threads, 2)
    assert [o[:2] for o in out] == [("set-after-the-server-started", 1)] * 2
    assert len({o[2] for o in out} | {os.getpid()}) == 3


def _groups_worker(rank, world_size, t, p, d):
    pg = ProcessGroups.create(t, p, d, timeout_s=30)
    # sum of global ranks over each group must equal the sum of its declared members
    sums = {}
    for name in ("tensor", "data", "pipeline", "embedding", "model_parallel"):
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=getattr(pg, name))
        sums[name] = x.item()
    fields = {k: getattr(pg, k) for k in (
        "rank", "tp_rank", "dp_rank", "pp_rank", "tensor_ranks", "data_ranks", "pipeline_ranks",
        "embedding_ranks", "model_parallel_ranks", "prev_pp_rank", "next_pp_rank",
        "is_first_stage", "is_last_stage")}
    return fields, sums, init_distributed(world_size=t * p * d).type


def _wrong_world(rank, world_size):
    try:
        init_distributed(world_size=world_size * 2)
    except ValueError as e:
        return str(e)
    return None


def _recv_from_rank_1():
    """Rank 0 waits for a tensor rank 1 never sends: (outcome, seconds, message, peers)."""
    start = time.monotonic()
    try:
        recv_tensor((4,), torch.float32, src=1, group=dist.group.WORLD)
    except PeerError as e:
        return "peer", time.monotonic() - start, str(e), e.peers
    return "no error", time.monotonic() - start, "", ()


def _dead_peer(rank, world_size):
    if rank == 1:
        os._exit(3)  # abrupt death: no cleanup, no message
    return _recv_from_rank_1()


def _silent_peer(rank, world_size, flag):
    """Rank 1 stays alive without sending until rank 0's receive has given up (it writes
    `flag`), at most 60 s: no fixed sleep to outlast the group timeout."""
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.02)
        return "waited"
    try:
        return _recv_from_rank_1()
    finally:
        open(flag, "w").close()


def _p2p(rank, world_size):
    if rank == 0:
        send_tensor(torch.arange(6.0).view(2, 3).t(), dst=1, group=dist.group.WORLD)  # non-contig
        return None
    return recv_tensor((3, 2), torch.float32, src=0, group=dist.group.WORLD).tolist()


# ---- harness ------------------------------------------------------------------------------

def test_spawn_returns_results_in_rank_order():
    assert spawn(_echo, 2, 10, scale=100, timeout_s=60) == [(10, 1.0), (110, 1.0)]


def test_spawn_reraises_with_remote_traceback():
    start = time.monotonic()
    with pytest.raises(SpawnError) as e:
        spawn(_raise_on_1, 2, timeout_s=60)
    assert e.value.rank == 1
    assert "boom from rank one" in str(e.value) and "_raise_on_1" in e.value.remote_traceback
    assert isinstance(e.value.__cause__, ValueError)
    assert time.monotonic() - start < 30


def test_spawn_deadline_kills_and_names_ranks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 had not finished"):
        spawn(_hang_on_1, 2, timeout_s=8)  # rank 0 must start and finish first (~1 s)
    assert time.monotonic() - start < 25


def test_spawn_reports_dead_rank_unless_allowed():
    with pytest.raises(SpawnError, match=r"rank 1 exited with code 3"):
        spawn(_dead_peer, 2, timeout_s=60, pg_timeout_s=10)


# ---- process groups -----------------------------------------------------------------------

@pytest.mark.parametrize("t,p,d", [(2, 2, 1), (1, 2, 2)])
def test_process_groups_match_rank_math(t, p, d):
    out = spawn(_groups_worker, t * p * d, t, p, d, timeout_s=120)
    for rank, (fields, sums, device) in enumerate(out):
        assert device == "cpu"
        tp, dp, pp = G.rank_coords(rank, t, p, d)
        assert (fields["rank"], fields["tp_rank"], fields["dp_rank"], fields["pp_rank"]) == \
            (rank, tp, dp, pp)
        expect = {"tensor": G.tensor_groups, "data": G.data_groups, "pipeline": G.pipeline_groups,
                  "embedding": G.embedding_groups, "model_parallel": G.model_parallel_groups}
        for name, family in expect.items():
            ranks = G.group_of(rank, family(t, p, d))
            assert list(fields[f"{name}_ranks"]) == ranks
            assert sums[name] == sum(ranks)  # the real group has exactly these members
        assert (fields["prev_pp_rank"], fields["next_pp_rank"]) == \
            G.pipeline_neighbours(rank, t, p, d)
        assert fields["is_first_stage"] == (pp == 0) and fields["is_last_stage"] == (pp == p - 1)


def test_wrong_world_size_is_a_clear_error():
    msgs = spawn(_wrong_world, 2, timeout_s=60)
    assert all("WORLD_SIZE=2" in m and "t*p*d=4" in m and "--nproc_per_node=4" in m
               for m in msgs)


def test_init_distributed_outside_torchrun(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"torchrun --nproc_per_node=8"):
        init_distributed(world_size=8)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 but the plan needs t\*p\*d=8"):
        init_distributed(world_size=8)  # refused before anything blocks
    with pytest.raises(ValueError, match=r"timeout_s=0"):
        init_distributed(timeout_s=0)


# ---- point to point and dead peers --------------------------------------------------------

def test_send_recv_noncontiguous():
    assert spawn(_p2p, 2, timeout_s=60)[1] == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


def test_dead_peer_raises_peer_error_not_hang():
    res = spawn(_dead_peer, 2, timeout_s=60, pg_timeout_s=10, allow_exit=[1])
    kind, elapsed, msg, peers = res[0]
    assert res[1] is None
    assert kind == "peer" and peers == (1,)
    assert "rank 0: receive from rank 1 failed" in msg and "died" in msg
    assert elapsed < 10


def test_silent_peer_times_out_with_peer_error(tmp_path):
    res = spawn(_silent_peer, 2, str(tmp_path / "rank0-gave-up"), timeout_s=60, pg_timeout_s=2)
    assert res[1] == "waited"
    kind, elapsed, msg, peers = res[0]
    assert kind == "peer" and peers == (1,)
    assert "rank 1" in msg and "imed out" in msg
    assert 1.5 < elapsed < 10
