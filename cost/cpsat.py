"""The planner's CP-SAT model: the surviving combinations' selection and stage split.

Variables
    sel[k]        Boolean, one per surviving knob combination k (t, c, ep, p, d, v, micro-batch b,
                  schedule, recompute, sequence_parallel, zero); exactly one is true.
    x[p,v][c]     integer layers of chunk c (1 <= x <= l), one vector per distinct (p, v) shared by
                  all combinations with that chunk layout; y_r = sum of x over chunks c = r mod p.
    M[k], D[k]    integer ns: max per-micro-batch rank load, and max rank tail (exposed
                  data-parallel reduction + optimizer), 0 unless k is selected.
Objective (integer, ns · W, W = lcm of the V_k = cost.model.step_scale of the candidates:
v_k · bubble_div_k, bubble_div = 1 except for zero-bubble schedules)
    minimise sum_k (W / V_k) · scaled_step_ns(cfg_k, M[k], sel[k]·S_k, D[k])
    = W · step time of the selected combination (cost.model.scaled_step_ns is V · step time;
    S_k = total_load_ns, the sum of the rank loads, does not depend on the partition).
Constraint families (one method each; every cost is a cost.model function of y_r, affine, so
the same function prices ints in predict and builds the linear expressions here)
    _add_selection       exactly one combination
    _add_partition       sum_c x[c] = l for every chunk layout
    _add_load_max        M[k] >= rank_load_ns(y_r) for every rank r, if sel[k]
    _add_tail_max        D[k] >= each of rank_tail_terms_ns(y_r), if sel[k]
    _add_memory          rank_memory_bytes(y_r) <= capacity, if sel[k]
"""
from __future__ import annotations

import math
import os
from typing import Any

from ortools.sat.python import cp_model

from autopar.cost.bounds import chunk_minimums, chunks_from_ranks
from autopar.cost.model import (ConfigCosts, rank_load_ns, rank_memory_bytes, rank_tail_terms_ns,
                                scaled_step_ns, step_scale, total_load_ns)

SOLVER_TIME_LIMIT_S = 20.0


class PlanModel:
    """One CP-SAT model over the surviving combinations; see the module docstring."""

    def __init__(self, candidates: list[ConfigCosts], num_layers: int,
                 hint: tuple[int, list[int]] | None) -> None:
        self.cands, self.l = candidates, num_layers
        self.model = cp_model.CpModel()
        self.W = math.lcm(*[step_scale(cc.cfg) for cc in candidates])
        self.sel = [self.model.NewBoolVar(f"sel{k}") for k in range(len(candidates))]
        self.x: dict[tuple[int, int], list[cp_model.IntVar]] = {}
        self.y: dict[tuple[int, int], list[Any]] = {}
        self.M: list[cp_model.IntVar] = []
        self.D: list[cp_model.IntVar] = []
        self._add_selection()
        self._add_partition()
        self._add_load_max()
        self._add_tail_max()
        self._add_memory()
        self._set_objective()
        if hint is not None:
            self._add_hint(*hint)

    def _add_selection(self) -> None:
        self.model.AddExactlyOne(self.sel)

    def _add_partition(self) -> None:
        for cc in self.cands:
            key = (cc.cfg.p, cc.cfg.v)
            if key in self.x:
                continue
            p, v = key
            mins = chunk_minimums(p, v, self.l)
            xs = [self.model.NewIntVar(lo, self.l - sum(mins) + lo, f"x{p}_{v}_{c}")
                  for c, lo in enumerate(mins)]
            self.model.Add(sum(xs) == self.l)
            self.x[key] = xs
            self.y[key] = [sum(xs[j * p + r] for j in range(v)) for r in range(p)]

    def _ub(self, cc: ConfigCosts) -> tuple[int, int]:
        p = cc.cfg.p
        load = max(rank_load_ns(cc, r, self.l) for r in range(p))
        tail = max(max(abs(q) for q in rank_tail_terms_ns(cc, r, self.l)) for r in range(p))
        return load, tail

    def _add_load_max(self) -> None:
        for k, cc in enumerate(self.cands):
            y = self.y[(cc.cfg.p, cc.cfg.v)]
            ub_load, _ = self._ub(cc)
            mk = self.model.NewIntVar(0, ub_load, f"M{k}")
            for r in range(cc.cfg.p):
                self.model.Add(mk >= rank_load_ns(cc, r, y[r])).OnlyEnforceIf(self.sel[k])
            self.M.append(mk)

    def _add_tail_max(self) -> None:
        for k, cc in enumerate(self.cands):
            y = self.y[(cc.cfg.p, cc.cfg.v)]
            _, ub_tail = self._ub(cc)
            dk = self.model.NewIntVar(0, ub_tail, f"D{k}")
            for r in range(cc.cfg.p):
                for term in rank_tail_terms_ns(cc, r, y[r]):
                    self.model.Add(dk >= term).OnlyEnforceIf(self.sel[k])
            self.D.append(dk)

    def _add_memory(self) -> None:
        for k, cc in enumerate(self.cands):
            y = self.y[(cc.cfg.p, cc.cfg.v)]
            for r in range(cc.cfg.p):
                self.model.Add(rank_memory_bytes(cc, r, y[r])
                               <= cc.capacity_bytes).OnlyEnforceIf(self.sel[k])

    def _set_objective(self) -> None:
        terms = []
        for k, cc in enumerate(self.cands):
            # Σ load does not depend on the split; it counts only if k is selected
            total = total_load_ns(cc, self.l) * self.sel[k]
            scaled = scaled_step_ns(cc.cfg, self.M[k], total, self.D[k])  # V_k · step
            terms.append(self.W // step_scale(cc.cfg) * scaled)
        self.model.Minimize(sum(terms))

    def _add_hint(self, k: int, y_hint: list[int]) -> None:
        cc = self.cands[k]
        x = chunks_from_ranks(y_hint, cc.cfg.p, cc.cfg.v)
        for var, val in zip(self.x[(cc.cfg.p, cc.cfg.v)], x):
            self.model.AddHint(var, val)
        for j, s in enumerate(self.sel):
            self.model.AddHint(s, j == k)

    def solve(self) -> tuple[int, list[int], int, bool]:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = SOLVER_TIME_LIMIT_S
        solver.parameters.num_workers = max(1, min(8, os.cpu_count() or 1))
        status = solver.Solve(self.model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return -1, [], 0, False
        k = next(j for j, s in enumerate(self.sel) if solver.Value(s))
        cc = self.cands[k]
        x = [solver.Value(var) for var in self.x[(cc.cfg.p, cc.cfg.v)]]
        return k, x, int(solver.ObjectiveValue()), status == cp_model.OPTIMAL

