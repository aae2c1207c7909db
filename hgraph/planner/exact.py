"""Exact assignment through a MILP solver (scipy.optimize.milp, HiGHS): small instances only.

``solve_joint`` optimises dispatch and packing together for one strategy, with the true objective
(max over pipelines of ``Σ T(mb) + (pp − 1)·max T(mb)``); the tests use it to measure the heuristic's
gap. ``solve_min_max_packing`` is the reference planner's packing step for one ``V`` (DESIGN.md A7).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Iterator, Optional, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from hgraph.errors import PlanError
from hgraph.planner.timing import PipelineCost

Assignment = list[list[list[int]]]  # per pipeline, micro-batches of positions into lengths


class _Model:
    """A small sparse MILP builder: variables by index, constraints as rows ``lo <= a·x <= hi``."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.integral: list[int] = []
        self.upper: list[float] = []
        self.rows: list[tuple[list[tuple[int, float]], float, float]] = []

    def var(self, obj: float = 0.0, binary: bool = False, upper: float = math.inf) -> int:
        self.cost.append(obj)
        self.integral.append(1 if binary else 0)
        self.upper.append(1.0 if binary else upper)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        self.rows.append((terms, lo, hi))

    def solve(self, time_limit: Optional[float]) -> Optional[np.ndarray]:
        r, c, v = [], [], []
        for k, (terms, _, _) in enumerate(self.rows):
            for j, coef in terms:
                r.append(k)
                c.append(j)
                v.append(coef)
        a = coo_matrix((v, (r, c)), shape=(len(self.rows), len(self.cost))).tocsr()
        lo = np.array([row[1] for row in self.rows])
        hi = np.array([row[2] for row in self.rows])
        # HiGHS's presolve returned non-optimal "optimal" assignments on some small instances (an
        # idle pp=4 pipeline opened, up to 23% slower); found by benchmarks/planner_gap_bench.py.
        options = {"disp": False, "presolve": False}
        if time_limit is not None:
            options["time_limit"] = time_limit
        with _quiet_stdout():
            res = milp(
                np.array(self.cost),
                constraints=LinearConstraint(a, lo, hi),
                integrality=np.array(self.integral),
                bounds=Bounds(np.zeros(len(self.cost)), np.array(self.upper)),
                options=options,
            )
        return None if res.x is None else res.x


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS sometimes writes to file descriptor 1 even with ``disp=False``; keep it off stdout
    (``hgraph plan --json`` must print exactly one JSON object)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_joint(
    costs: Sequence[PipelineCost], lengths: Sequence[int], time_limit: Optional[float] = 60.0
) -> tuple[Assignment, float]:
    """Optimal dispatch + packing of ``lengths`` onto pipelines ``costs``: (assignment, time ms).

    Binary ``x[i,p,m]`` puts sequence i in micro-batch m of pipeline p, ``u[p,m]`` opens that
    micro-batch (opened in order, so ``u[p,0]`` says the pipeline is used), ``z[p]`` bounds the
    pipeline's heaviest micro-batch work, and ``T`` bounds every pipeline's 1F1B time.
    """
    n, pcount = len(lengths), len(costs)
    if n == 0:
        raise PlanError("cannot plan an empty batch; give at least one sequence")
    for i, l in enumerate(lengths):
        if all(l > c.max_len for c in costs):
            raise PlanError(
                f"sequence {i} of {l} tokens exceeds every MaxLen (largest {max(c.max_len for c in costs)})"
            )
    m = _Model()
    top = m.var(obj=1.0)
    x: dict[tuple[int, int, int], int] = {}
    u = [[m.var(binary=True) for _ in range(n)] for _ in range(pcount)]
    z = [m.var() for _ in range(pcount)]
    for p, c in enumerate(costs):
        for i, l in enumerate(lengths):
            if l <= c.max_len:
                for k in range(n):
                    x[i, p, k] = m.var(binary=True)
    for i in range(n):
        m.row([(x[i, p, k], 1.0) for p in range(pcount) for k in range(n) if (i, p, k) in x], 1.0, 1.0)
    for p, c in enumerate(costs):
        busy = []
        for k in range(n):
            members = [(i, x[i, p, k]) for i in range(n) if (i, p, k) in x]
            m.row([(j, float(lengths[i])) for i, j in members] + [(u[p][k], -float(c.max_len))], -math.inf, 0.0)
            m.row([(z[p], 1.0)] + [(j, -c.seq_time(lengths[i])) for i, j in members], 0.0, math.inf)
            if k + 1 < n:
                m.row([(u[p][k + 1], 1.0), (u[p][k], -1.0)], -math.inf, 0.0)
            busy += [(j, -c.seq_time(lengths[i])) for i, j in members]
        terms = [(top, 1.0)] + busy + [(u[p][k], -c.c) for k in range(n)]
        terms += [(z[p], -(c.pp - 1.0)), (u[p][0], -(c.pp - 1.0) * c.c)]
        m.row(terms, 0.0, math.inf)
    sol = m.solve(time_limit)
    if sol is None:
        raise PlanError(f"the MILP found no assignment within {time_limit} s; use the heuristic planner")
    out: Assignment = []
    for p in range(pcount):
        mbs = [[i for i in range(n) if (i, p, k) in x and sol[x[i, p, k]] > 0.5] for k in range(n)]
        out.append([mb for mb in mbs if mb])
    time = max(c.time([[lengths[i] for i in mb] for mb in a]) for c, a in zip(costs, out))
    return out, time


def solve_min_max_packing(
    times: Sequence[float], lengths: Sequence[int], v: int, cap: int, time_limit: Optional[float] = 0.5
) -> Optional[tuple[float, list[list[int]]]]:
    """Split sequences into ``v`` micro-batches minimising the heaviest one's work, each within
    ``cap`` tokens: (heaviest work, micro-batches) or None when no solution was found in time."""
    n = len(lengths)
    m = _Model()
    top = m.var(obj=1.0)
    o = [[m.var(binary=True) for _ in range(v)] for _ in range(n)]
    for i in range(n):
        m.row([(o[i][k], 1.0) for k in range(v)], 1.0, 1.0)
    for k in range(v):
        m.row([(top, 1.0)] + [(o[i][k], -float(times[i])) for i in range(n)], 0.0, math.inf)
        m.row([(o[i][k], float(lengths[i])) for i in range(n)], -math.inf, float(cap))
    sol = m.solve(time_limit)
    if sol is None:
        return None
    bins = [[i for i in range(n) if sol[o[i][k]] > 0.5] for k in range(v)]
    bins = [b for b in bins if b]
    return max(sum(times[i] for i in b) for b in bins), bins
