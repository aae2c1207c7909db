"""A lower bound of an iteration's time from the batch and the cost model alone.

Whatever strategy, dispatch and packing a planner chooses on ``G`` GPUs, the iteration takes at least

* **longest**: the longest sequence alone on its fastest scheme. The micro-batch holding sequence
  ``l`` costs ``T(mb) >= a·l² + b·l + c`` per stage, and the 1F1B time ``Σ T + (pp − 1)·max T`` of its
  pipeline is at least ``pp · T(mb)``; so ``min over schemes of pp · (a·l² + b·l + c)``;
* **gpu_time**: the total GPU-time over the GPUs. A pipeline of ``g`` GPUs busy for ``t`` ms spends
  ``g·t`` GPU-ms, at least ``g · (a·l² + b·l + c·l/MaxLen)`` for each of its sequences (a micro-batch
  pays ``c`` once and holds at most MaxLen tokens), and the pipelines use at most ``G`` GPUs; so
  ``Σ_i min over schemes of g · (a·l_i² + b·l_i + c·l_i/MaxLen) / G``;

and hence their maximum. ``ms`` strengthens that maximum. In an iteration of ``T`` ms, a sequence can
only sit on a scheme where it alone takes at most ``T``, and a pipeline of ``pp > 1`` stages does at
most ``W_max = (sqrt(T) − sqrt((pp − 1)·c))²`` of work (``W + v·c + (pp − 1)·(W/v + c) <= T``, the
1F1B time with ``v`` even micro-batches, minimised over ``v``), so each of its GPUs spends at least
``T / W_max`` GPU-ms per ms of work. ``ms`` is the smallest ``T >= longest`` at which the batch's
GPU-time, each sequence on its cheapest allowed scheme at those rates, fits into ``G·T`` (the
GPU-time only falls as ``T`` grows; found by bisection). The minimum runs over every scheme of the cost model that fits on ``G`` GPUs
and holds the sequence within its MaxLen (counted for a ``G``-GPU world), so the bound holds for every
candidate set drawn from that cost model. It counts compute only: Pull/Push exposure only adds to a
plan's predicted time. With ``split_long`` the bound is that of the pieces the plan holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hgraph.errors import PlanError
from hgraph.planner.cost import CostModel


@dataclass(frozen=True)
class LowerBound:
    """The bound ``ms``, its two plain terms (ms) and the GPU count they were computed for."""

    ms: float
    longest_ms: float
    gpu_time_ms: float
    gpus: int

    def ratio(self, predicted_ms: float) -> float:
        """``predicted_ms / bound`` (1.0 is optimal)."""
        return predicted_ms / self.ms if self.ms > 0 else 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "ms": round(self.ms, 3),
            "longest_ms": round(self.longest_ms, 3),
            "gpu_time_ms": round(self.gpu_time_ms, 3),
            "gpus": self.gpus,
        }

    def __str__(self) -> str:
        return (
            f"lower bound {self.ms:.1f} ms (longest sequence alone {self.longest_ms:.1f} ms, "
            f"GPU-time {self.gpu_time_ms:.1f} ms over {self.gpus} GPUs)"
        )


class BoundModel:
    """The per-scheme constants of the bound (built once): ``for_cost_model`` for every scheme of a
    cost model on ``gpus`` GPUs (the bound of the module docstring), ``for_pipelines`` for the
    pipelines of one strategy (a bound of that strategy's plans: the same argument over its schemes)."""

    def __init__(self, rows: Sequence[tuple[float, float, float, int, int, int]], gpus: int) -> None:
        """``rows``: ``(a, b, c, pp, gpus, max_len)`` per scheme; ``gpus``: the GPUs to spread over."""
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise PlanError(f"gpus={gpus!r}; the lower bound needs a positive number of GPUs")
        if not rows:
            raise PlanError(f"no scheme to bound with on {gpus} GPUs")
        self.gpus = gpus
        a, b, c, pp, g, cap = (np.array(col, dtype=np.float64)[:, None] for col in zip(*rows))
        self._a, self._b, self._c, self._pp, self._g, self._cap = a, b, c, pp, g, cap

    @classmethod
    def for_cost_model(cls, cost_model: CostModel, gpus: int) -> BoundModel:
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise PlanError(f"gpus={gpus!r}; the lower bound needs a positive number of GPUs")
        model = cost_model.with_world_size(gpus)
        schemes = [s for s in model.schemes if s.size <= gpus and model.max_len(s) > 0]
        if not schemes:
            raise PlanError(f"no scheme of cost model {model.name!r} fits on {gpus} GPUs")
        rows = []
        for s in schemes:
            cost = model.stage_cost(s)
            rows.append((cost.a, cost.b, cost.c, s.pp, s.size, model.max_len(s)))
        return cls(rows, gpus)

    @classmethod
    def for_pipelines(cls, costs: Sequence[Any], gpus_each: Sequence[int]) -> BoundModel:
        """``costs``: a ``PipelineCost`` per pipeline; ``gpus_each``: its GPU count."""
        rows = {(c.a, c.b, c.c, c.pp, g, c.max_len) for c, g in zip(costs, gpus_each)}
        return cls(sorted(rows), int(sum(gpus_each)))

    def __call__(self, lengths: Sequence[int]) -> LowerBound:
        values, counts = np.unique(np.asarray(lengths, dtype=np.float64), return_counts=True)
        return self.of_histogram(values, counts)

    def of_histogram(self, values: np.ndarray, counts: np.ndarray) -> LowerBound:
        """The bound of a batch given as sorted distinct lengths and their counts."""
        if values.size == 0:
            raise PlanError("cannot bound an empty batch; give at least one sequence")
        work = self._a * values**2 + self._b * values  # (scheme, length) per-stage ms
        fits = self._cap >= values
        if not fits.any(axis=0).all():
            longest = int(values[~fits.any(axis=0)][-1])
            raise PlanError(
                f"a sequence of {longest} tokens exceeds the MaxLen of every scheme on {self.gpus} GPUs"
            )
        alone = np.where(fits, self._pp * (work + self._c), np.inf)  # (scheme, length)
        # a micro-batch holds at most MaxLen tokens, so each token carries at least c / MaxLen of its c
        flat = np.where(fits, self._g * (work + self._c * values / np.maximum(self._cap, 1.0)), np.inf)
        gpu_work = np.where(fits, self._g * work, np.inf)
        deep = (self._pp > 1)[:, 0]
        bubble = np.sqrt((self._pp - 1) * self._c)  # (scheme, 1)
        longest = float(alone.min(axis=0).max())

        def spread(t: float) -> float:
            """GPU-time / G with every sequence on a scheme where it alone takes <= t; a pipeline of
            pp > 1 stages busy for t ms does at most (sqrt(t) - sqrt((pp-1)·c))² of work."""
            cost = flat.copy()
            if deep.any():
                room = np.maximum(np.sqrt(t) - bubble[deep], 0.0) ** 2
                with np.errstate(divide="ignore", invalid="ignore"):
                    cost[deep] = np.where(room > 0, gpu_work[deep] * (t / room), np.inf)
            return float(np.dot(np.where(alone <= t, cost, np.inf).min(axis=0), counts)) / self.gpus

        plain = float(np.dot(flat.min(axis=0), counts)) / self.gpus
        lo = hi = max(longest, plain)
        while spread(hi) > hi:  # spread() does not increase with t: find an iteration time that fits
            lo, hi = hi, 2 * hi
        while hi - lo > 1e-7 * hi:
            mid = (lo + hi) / 2
            if spread(mid) > mid:
                lo = mid
            else:
                hi = mid
        return LowerBound(hi, longest, plain, self.gpus)


def lower_bound(cost_model: CostModel, gpus: int, lengths: Sequence[int]) -> LowerBound:
    """The lower bound (module docstring) of a batch of ``lengths`` on ``gpus`` GPUs."""
    return BoundModel.for_cost_model(cost_model, gpus)(lengths)
