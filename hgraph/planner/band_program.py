"""The band dynamic program of the strategy proposal (``hgraph.planner.proposal``, DESIGN.md A6).

``bucketize`` groups a length histogram into geometric buckets (every MaxLen a boundary too);
``BandProgram`` holds the DP tables over (GPU units n, bucket j) with the choices needed to trace
strategies back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel

BUCKET_RATIO = 1.25
MIN_BUCKET = 128
MAX_UNITS = 64
TIE_WEIGHT = 0.1


@dataclass(frozen=True)
class Buckets:
    """Length buckets of a sample, with prefix sums over buckets (index 0 = the empty prefix)."""

    upper: np.ndarray  # upper length bound of each bucket
    longest: np.ndarray  # longest sequence in each bucket
    # prefix sums over buckets, index 0 = empty prefix
    count: np.ndarray
    tokens: np.ndarray
    squares: np.ndarray


def bucketize(values: np.ndarray, counts: np.ndarray, caps: Sequence[int]) -> Buckets:
    """Group lengths into geometric buckets whose bounds also include every MaxLen."""
    top = float(values[-1])
    bounds = {float(MIN_BUCKET)}
    b = float(MIN_BUCKET)
    while b < top:
        b = math.ceil(b * BUCKET_RATIO / 64) * 64
        bounds.add(float(b))
    bounds.update(float(c) for c in caps if c < top)
    upper = np.array(sorted(x for x in bounds if x < top) + [top])
    index = np.searchsorted(upper, values, side="left")
    present = np.unique(index)
    longest = np.zeros(len(upper))
    np.maximum.at(longest, index, values)
    cnt = np.bincount(index, weights=counts, minlength=len(upper))
    tok = np.bincount(index, weights=counts * values, minlength=len(upper))
    sq = np.bincount(index, weights=counts * values * values, minlength=len(upper))

    def prefix(x: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(x[present])])

    return Buckets(upper[present], longest[present], prefix(cnt), prefix(tok), prefix(sq))


class BandProgram:
    """The DP tables (GPU units x buckets) with the choices needed to trace strategies back.

    Each state keeps the slowest group's time ``M`` (the objective of A6) and the GPU-time of all
    groups ``S``; states are compared by ``M + TIE_WEIGHT * S / gpus``, so among strategies with
    the same slowest group (often the one holding the longest sequence) the DP keeps the one whose
    other GPUs carry the least load instead of an arbitrary one.
    """

    def __init__(
        self,
        model: CostModel,
        schemes: list[Degrees],
        caps: Mapping[Degrees, int],
        gpus: int,
        buckets: Buckets,
    ) -> None:
        self.model, self.schemes, self.caps, self.buckets = model, schemes, caps, buckets
        unit = math.gcd(*(s.size for s in schemes), gpus)
        while gpus // unit > MAX_UNITS and gpus % (2 * unit) == 0:
            unit *= 2
        self.unit = unit
        self.units = gpus // unit
        # replicas of scheme k are added in steps whose GPU count is a whole number of units
        self.step = [unit // math.gcd(unit, s.size) for s in schemes]
        nb = len(buckets.upper)
        self.slowest = np.full((self.units + 1, nb + 1), np.inf)
        self.load = np.full((self.units + 1, nb + 1), np.inf)  # sum of time x units over groups
        self.slowest[0, 0] = self.load[0, 0] = 0.0
        self.choice = np.full((self.units + 1, nb + 1, 3), -1, dtype=np.int64)  # (i, k, d)

    def key(self, slowest: np.ndarray, load: np.ndarray) -> np.ndarray:
        return slowest + TIE_WEIGHT * load / self.units

    def band_time(self, k: int, i: np.ndarray, j: int, d: np.ndarray) -> np.ndarray:
        """Predicted 1F1B time of one of ``d`` replicas of scheme k sharing buckets ``i+1..j``.

        Broadcasts over ``i`` (column) and ``d`` (row). Infinite where a sequence exceeds MaxLen.
        """
        scheme = self.schemes[k]
        bk = self.buckets
        if bk.longest[j - 1] > self.caps[scheme]:
            return np.full(np.broadcast(i, d).shape, np.inf)
        cost = self.model.stage_cost(scheme)
        count = bk.count[j] - bk.count[i]
        tokens = bk.tokens[j] - bk.tokens[i]
        work = cost.a * (bk.squares[j] - bk.squares[i]) + cost.b * tokens
        longest = bk.longest[j - 1]
        longest_work = cost.seq_time(longest)
        w = np.maximum(work / d, longest_work)  # the replica holding the longest sequence
        v_min = np.maximum(1.0, np.ceil(tokens / d / self.caps[scheme]))
        v_max = np.maximum(v_min, np.ceil(count / d))
        pp = scheme.pp
        if pp == 1 or cost.c == 0:
            v = v_min
        else:
            v = np.clip(np.round(np.sqrt(w * (pp - 1) / cost.c)), v_min, v_max)
        micro = np.maximum(w / v, longest_work) + cost.c
        return w + v * cost.c + (pp - 1) * micro

    def run(self) -> None:
        nb = len(self.buckets.upper)
        n = np.arange(self.units + 1)
        for j in range(1, nb + 1):
            i = np.arange(j)
            for k, scheme in enumerate(self.schemes):
                if self.buckets.longest[j - 1] > self.caps[scheme]:
                    continue
                per = self.step[k] * scheme.size // self.unit  # units per replica step
                steps = np.arange(1, self.units // per + 1)
                if steps.size == 0:
                    continue
                d, u = steps * self.step[k], steps * per
                times = self.band_time(k, i[None, :], j, d[:, None])  # (step, i)
                # from state (n - u, i) give buckets i+1..j to d replicas: all steps, n and i at once
                source = n[None, :] - u[:, None]  # (step, n)
                valid = source >= 0
                source = np.maximum(source, 0)
                slowest = np.maximum(self.slowest[source, :j], times[:, None, :])  # (step, n, i)
                load = self.load[source, :j] + (times * u[:, None])[:, None, :]
                key = np.where(valid[:, :, None], self.key(slowest, load), np.inf)
                flat = key.transpose(1, 0, 2).reshape(n.size, -1)  # (n, step * i)
                arg = np.argmin(flat, axis=1)
                better = flat[n, arg] < self.key(self.slowest[:, j], self.load[:, j])
                if np.any(better):
                    rows = n[better]
                    step_index, start = np.divmod(arg[better], j)
                    self.slowest[rows, j] = slowest[step_index, rows, start]
                    self.load[rows, j] = load[step_index, rows, start]
                    self.choice[rows, j] = np.stack([start, np.full(rows.size, k), d[step_index]], axis=1)

    def trace(self, n: int, j: int) -> list[tuple[Degrees, int]]:
        """The (scheme, replicas) groups of the optimum at ``(n, j)``."""
        groups = []
        while j > 0:
            i, k, d = (int(x) for x in self.choice[n, j])
            groups.append((self.schemes[k], d))
            n -= d * self.schemes[k].size // self.unit
            j = i
        assert n == 0, "DP traceback must use every GPU unit"
        return groups

    def best_tail(self, k: int, d: int) -> tuple[float, list[tuple[Degrees, int]]] | None:
        """Best strategy giving the longest band to exactly ``d`` replicas of scheme ``k``."""
        scheme = self.schemes[k]
        if (d * scheme.size) % self.unit or d * scheme.size > self.units * self.unit:
            return None
        u = d * scheme.size // self.unit
        nb = len(self.buckets.upper)
        rest = self.units - u
        times = self.band_time(k, np.arange(nb), nb, np.array(d, dtype=np.float64))
        slowest = np.maximum(self.slowest[rest, :nb], times)
        key = self.key(slowest, self.load[rest, :nb] + times * u)
        start = int(np.argmin(key))
        if not np.isfinite(key[start]):
            return None
        return float(slowest[start]), [(scheme, d)] + (self.trace(rest, start) if rest else [])

    def evaluate(self, k: int, d: int, j: int) -> float:
        """Predicted time of ``d`` replicas of scheme ``k`` holding buckets ``1..j`` together."""
        return float(self.band_time(k, np.array(0), j, np.array(d, dtype=np.float64)))
