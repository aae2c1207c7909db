"""Settling: a planner with an online correction is never worse than the best homogeneous strategy.

``Settling`` holds what the ``Planner`` learns about its homogeneous candidates (every pipeline the
same degrees) while it runs, in three phases:

1. *Probing*: each homogeneous candidate runs ``probe_rounds`` times (the rounds interleaved, each on
   the first batch it can take), so the correction has measured every one before an incumbent is
   chosen. A profiled cost model can rank two strategies wrongly by more than their difference (a
   one-scheme ``T(l)`` misses how ranks share a machine); only their own measurements can tell.
2. *The incumbent*: every batch the planner also plans each homogeneous candidate greedily; once the
   batch has run, their corrected predicted times join running totals (decayed by ``SETTLE_DECAY``,
   restarted when probing ends; inf once a candidate could not take a batch). The smallest total
   becomes the incumbent and stays until another is smaller by more than the switch margin (the
   correction's measured error) or it cannot take a batch.
3. *Exploring*: the runner-up runs once ``explore_every`` batches after settling, then after gaps
   that double, so the correction keeps measuring it at a cost that fades over a long run.

The planner replaces the incumbent on a batch only when another candidate's predicted time is
shorter by more than the switch margin (``hgraph.planner.assign.Planner``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from hgraph.errors import PlanError

SETTLE_PRIOR_ERROR = 0.05  # the margin a switch away from the incumbent needs before any measurement
SETTLE_DECAY = 0.9  # weight of the past in the homogeneous candidates' running totals, per batch
EXPLORE_EVERY = 16  # the runner-up runs once this many batches after settling, then after gaps that double
PROBE_ROUNDS = 2  # every homogeneous candidate is measured this many times before the incumbent is chosen


def _count(name: str, value: Any, zero: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(f"{name}={value!r}; expected an integer >= 0 (0: {zero})")
    return value


class Settling:
    """The settling state of a planner over candidates whose homogeneous ones are ``homogeneous``
    (candidate indices); the planner calls ``plan_batch`` when it plans and ``observe`` once the
    batch has run."""

    def __init__(self, homogeneous: tuple[int, ...], probe_rounds: int = PROBE_ROUNDS,
                 explore_every: int = EXPLORE_EVERY) -> None:
        self.homogeneous = homogeneous
        self.probe_rounds = _count("probe_rounds", probe_rounds, "never probe")
        self.explore_every = _count("explore_every", explore_every, "never explore")
        self.totals: dict[int, float] = {k: 0.0 for k in homogeneous}  # decayed predicted ms (inf: did not fit)
        self.runs: dict[int, int] = {k: 0 for k in homogeneous}  # measured iterations of each
        self.incumbent: Optional[int] = None
        self.settled_batches = 0  # batches measured since the incumbent was first chosen (exploration's clock)
        self._pending: dict[int, float] = {}  # this batch's greedy predicted ms, committed by ``observe``
        self._probed = False  # this batch is a probe (``observe`` then restarts the totals)

    @property
    def probe_iterations(self) -> int:
        """Batches probing takes when every batch fits every homogeneous candidate."""
        return self.probe_rounds * len(self.homogeneous)

    def probing(self) -> bool:
        """Whether a homogeneous candidate that took every batch so far has fewer than ``probe_rounds``
        measurements."""
        return any(n < self.probe_rounds and math.isfinite(self.totals[k]) for k, n in self.runs.items())

    def ranked(self) -> list[int]:
        """The homogeneous candidates that took every batch so far, smallest running total first."""
        return [k for ms, k in sorted((ms, k) for k, ms in self.totals.items() if math.isfinite(ms))]

    def plan_batch(self, greedy_ms: dict[int, float]) -> Optional[int]:
        """Record this batch's greedy predicted times (candidate index -> ms, only those that take it);
        the homogeneous candidate to probe on it, or None once probing is over (or none takes it)."""
        self._pending = {k: greedy_ms.get(k, math.inf) for k in self.homogeneous}
        todo = [k for k in self.homogeneous if k in greedy_ms and self.runs[k] < self.probe_rounds
                and math.isfinite(self.totals[k])]
        probe = min(todo, key=lambda k: (self.runs[k], self.totals[k] + self._pending[k], k)) if todo else None
        self._probed = probe is not None
        return probe

    def exploring(self) -> bool:
        """Whether the runner-up runs now: ``explore_every`` batches after settling, then after gaps
        that double (2x, 4x, ...)."""
        n, every = self.settled_batches, self.explore_every
        return bool(every) and n >= every and n % every == 0 and (n // every) & (n // every - 1) == 0

    def observe(self, ran: Optional[int], margin: float) -> None:
        """The batch planned last ran on candidate ``ran``: commit its figures, then keep or replace
        the incumbent (``margin``: the relative gain a replacement needs)."""
        if ran in self.runs:
            self.runs[ran] += 1
        for k in self.homogeneous:
            self.totals[k] = SETTLE_DECAY * self.totals[k] + self._pending.get(k, math.inf)
        if self._probed:  # the totals restart from this batch: the incumbent is chosen on corrected predictions
            self.totals = {k: self._pending.get(k, math.inf) if math.isfinite(ms) else ms for k, ms in self.totals.items()}
        self._pending, self._probed = {}, False
        self._elect(margin)
        if self.incumbent is not None:
            self.settled_batches += 1

    def _elect(self, margin: float) -> None:
        ranked = self.ranked()
        if not ranked or self.probing():
            self.incumbent = None
        elif self.incumbent is None or self.incumbent not in ranked:
            self.incumbent = ranked[0]
        elif self.totals[ranked[0]] < self.totals[self.incumbent] * (1.0 - margin):
            self.incumbent = ranked[0]

    def state_dict(self) -> dict[str, Any]:
        return {"homogeneous_ms": {str(k): ms for k, ms in self.totals.items()},
                "runs": {str(k): n for k, n in self.runs.items()}, "incumbent": self.incumbent,
                "settled_batches": self.settled_batches}

    def load_state_dict(self, state: dict[str, Any], margin: float) -> None:
        """Continue from the planner state's settling entries (states saved before 0.3 lack some: a
        missing total is 0, missing runs mean probing was over, a missing incumbent is elected)."""
        totals = state.get("homogeneous_ms") or {}
        self.totals = {k: float(totals.get(str(k), 0.0)) for k in self.homogeneous}
        runs = state.get("runs")
        self.runs = {k: int(runs.get(str(k), 0)) if runs is not None else self.probe_rounds for k in self.homogeneous}
        incumbent = state.get("incumbent")
        self.incumbent = int(incumbent) if incumbent is not None else None
        if "incumbent" not in state:
            self._elect(margin)
        self.settled_batches = int(state.get("settled_batches", 0))
