"""Checks of a pipeline schedule (`autopar.schedules`' lists of actions): `validate` raises
ValueError naming the rank, the action and the rule when a list is incomplete, out of
dependency order, has unmatched communication, or deadlocks under rendezvous (blocking)
send/recv; `infer_dims` reads (p, v, m) off the compute actions. The semantics checked are
the schedules module's docstring's ("Blocking semantics")."""
from __future__ import annotations

from typing import Sequence

from autopar.schedules import COMPUTE, Action


def infer_dims(per_rank: Sequence[Sequence[Action]]) -> tuple[int, int, int]:
    """(p, v, m) of a schedule, read off its compute actions."""
    p = len(per_rank)
    comp = [a for acts in per_rank for a in acts if a.kind in COMPUTE]
    if not p or not comp:
        raise ValueError("schedule has no ranks or no compute actions")
    C = max(a.chunk for a in comp) + 1
    return p, -(-C // p), max(a.mb for a in comp) + 1


def validate(per_rank: Sequence[Sequence[Action]], p: int, v: int, m: int) -> None:
    """Raise ValueError if the schedule is incomplete, out of dependency order, has unmatched
    communication, or deadlocks under rendezvous (blocking) send/recv semantics. W actions:
    all B's have their W (after the B, same rank) or none has."""
    if len(per_rank) != p:
        raise ValueError(f"schedule has {len(per_rank)} ranks; p={p} expected")
    C = p * v
    _check_actions(per_rank, p, C, m)
    _check_complete(per_rank, p, C, m)
    has_w = any(a.kind == "W" for acts in per_rank for a in acts)
    for r, acts in enumerate(per_rank):
        _check_order(r, acts, p, C, m, has_w)
    _check_deadlock(per_rank)


def _where(r: int, n: int, a: Action) -> str:
    return f"rank {r} action #{n} {a}"


def _check_actions(per_rank, p: int, C: int, m: int) -> None:
    for r, acts in enumerate(per_rank):
        for n, a in enumerate(acts):
            if not 0 <= a.chunk < C:
                raise ValueError(f"{_where(r, n, a)}: chunk {a.chunk} outside 0..{C - 1}")
            if a.kind != "REDUCE" and not 0 <= a.mb < m:
                raise ValueError(f"{_where(r, n, a)}: micro-batch {a.mb} outside 0..{m - 1}")
            if a.kind in COMPUTE + ("REDUCE",) and a.chunk % p != r:
                raise ValueError(f"{_where(r, n, a)}: chunk {a.chunk} lives on rank "
                                 f"{a.chunk % p} (c mod p), not rank {r}")
            if a.is_comm:
                _check_comm(r, n, a, p, C)


def _check_comm(r: int, n: int, a: Action, p: int, C: int) -> None:
    kind = a.kind[-1]
    dst_chunk = a.chunk + 1 if kind == "F" else a.chunk - 1
    if not 0 <= dst_chunk < C:
        what = "output" if kind == "F" else "input-gradient"
        raise ValueError(f"{_where(r, n, a)}: chunk {a.chunk}'s {what} "
                         f"has no consumer (no chunk {dst_chunk}); remove this action")
    src, dst = a.chunk % p, dst_chunk % p
    if src == dst:
        raise ValueError(f"{_where(r, n, a)}: chunks {a.chunk} and {dst_chunk} share rank {src}; "
                         f"the hand-off is local, no send/recv")
    me, peer = (src, dst) if a.kind.startswith("SEND") else (dst, src)
    if (r, a.peer) != (me, peer):
        raise ValueError(f"{_where(r, n, a)}: this message goes from rank {src} to rank {dst}; "
                         f"expected on rank {me} with peer {peer}")


def _check_complete(per_rank, p: int, C: int, m: int) -> None:
    seen: dict[Action, int] = {}
    for r, acts in enumerate(per_rank):
        for a in acts:
            if a in seen:
                raise ValueError(f"duplicated action {a} (rank {r})")
            seen[a] = r
    ws = [a for a in seen if a.kind == "W"]
    if ws and len(ws) != C * m:
        missing = [f"W{c}.{i}" for c in range(C) for i in range(m) if Action("W", c, i) not in seen]
        raise ValueError(f"schedule mixes backwards with and without a weight-gradient W: "
                         f"{len(ws)} W action(s) for {C * m} B's (missing {', '.join(missing[:6])}"
                         f"{', ...' if len(missing) > 6 else ''}); either every B{{c}}.{{i}} "
                         f"has its W{{c}}.{{i}} (B = input gradient only) or none has "
                         f"(B = whole backward)")
    for c in range(C):
        for i in range(m):
            for kind in (COMPUTE if ws else ("F", "B")):
                if Action(kind, c, i) not in seen:
                    raise ValueError(f"missing action {kind}{c}.{i} on rank {c % p}")
            if p == 1:
                continue
            for kind, dst_chunk in (("F", c + 1), ("B", c - 1)):
                if 0 <= dst_chunk < C:
                    s = Action("SEND_" + kind, c, i, dst_chunk % p)
                    rv = Action("RECV_" + kind, c, i, c % p)
                    if (s in seen) != (rv in seen) or s not in seen:
                        found = (f"only {s}" if s in seen else f"only {rv}" if rv in seen
                                 else "neither")
                        raise ValueError(f"message {kind}{c}.{i} (rank {c % p} → rank "
                                         f"{dst_chunk % p}) needs both {s} and {rv}; found "
                                         f"{found}")
    reduces = [a for a in seen if a.kind == "REDUCE"]
    if reduces and len(reduces) != C:
        have = sorted(a.chunk for a in reduces)
        raise ValueError(f"REDUCE present for chunks {have} but not all {C}; emit one R{{c}} "
                         f"per chunk or none")


def _check_order(r: int, acts: Sequence[Action], p: int, C: int, m: int,
                 has_w: bool = False) -> None:
    done: set[tuple] = set()
    b_left = {c: m for c in range(r, C, p)}   # backwards (their W's when has_w) still to run
    last = "W" if has_w else "B"
    for n, a in enumerate(acts):
        c, i = a.chunk, a.mb
        need: list[tuple[tuple, str]] = []
        if a.kind == "F" and c > 0:
            need.append((("F", c - 1, i) if (c - 1) % p == r else ("RECV_F", c - 1, i),
                         f"the forward of chunk {c - 1} for micro-batch {i}"))
        elif a.kind == "B":
            need.append((("F", c, i), f"its forward F{c}.{i}"))
            if c < C - 1:
                need.append((("B", c + 1, i) if (c + 1) % p == r else ("RECV_B", c + 1, i),
                             f"the backward of chunk {c + 1} for micro-batch {i}"))
        elif a.kind.startswith("SEND"):
            need.append(((a.kind[-1], c, i), f"the {a.kind[-1]}{c}.{i} that produces it"))
        elif a.kind == "W":
            need.append((("B", c, i), f"its input-gradient backward B{c}.{i}"))
        elif a.kind == "REDUCE" and b_left[c]:
            what = "weight-gradient W" if has_w else "backward"
            raise ValueError(f"{_where(r, n, a)}: chunk {c} still has {b_left[c]} {what}(s) "
                             f"to run; REDUCE must follow its last {what}")
        for key, what in need:
            if key not in done:
                how = "has been received" if key[0].startswith("RECV") else "has run"
                raise ValueError(f"{_where(r, n, a)} runs before {what} {how} on this rank")
        done.add((a.kind, c, i))
        if a.kind == last:
            b_left[c] -= 1


def _check_deadlock(per_rank: Sequence[Sequence[Action]]) -> None:
    """Step the ranks under rendezvous semantics; report each rank's head if none can move."""
    pos = [0] * len(per_rank)
    progressed = True
    while progressed:
        progressed = False
        for r, acts in enumerate(per_rank):
            while pos[r] < len(acts) and not acts[pos[r]].is_comm:
                pos[r] += 1
                progressed = True
            if pos[r] == len(acts):
                continue
            a = acts[pos[r]]
            peer = per_rank[a.peer]
            pa = peer[pos[a.peer]] if pos[a.peer] < len(peer) else None
            if (pa is not None and pa.is_comm and pa.peer == r and pa.message() == a.message()
                    and pa.kind != a.kind):
                pos[r] += 1
                pos[a.peer] += 1
                progressed = True
    stuck = [f"rank {r} waits at #{pos[r]} {acts[pos[r]]}"
             for r, acts in enumerate(per_rank) if pos[r] < len(acts)]
    if stuck:
        raise ValueError("deadlock under blocking (rendezvous) send/recv: " + "; ".join(stuck))
