"""Online correction of the cost model from measured iteration times.

The simulator splits every prediction into terms ``x = (compute, exposed comm, fixed)``
(``IterationPrediction.terms``). After each iteration the trainer reports the measured time ``y``;
``OnlineCorrection`` then refits

* per-term scales ``s`` (``y ≈ s · x``): Huber-weighted least squares on the relative residual
  ``(y − s·x) / y`` over the last ``window`` iterations (iteratively reweighted, so a burst of load on
  a shared machine counts linearly, not squared), with a ridge pull toward ``s = 1`` of weight
  ``prior`` that keeps terms the measurements cannot tell apart at their profiled value;
* a common offset: the median of all the window's residuals ``y − s·x`` (what the scales cannot
  explain about the machine, e.g. a load that came after profiling);
* a per-strategy offset: the common offset plus the median of the strategy's own residuals beyond
  it, shrunk toward 0 by ``n / (n + shrink)`` (what is particular to one strategy, e.g. its fixed
  cost). A strategy not measured in the window gets the common offset, so a slowdown seen only on
  the strategies that ran does not make the others look faster than they are.

``apply(prediction)`` is the corrected time ``s · x + offset`` (at least the smallest scale times the
prediction: a negative offset never makes a time negative); the planner decides with it.
``measured_error()`` is how wrong those corrected times have been: the median of
``|y − apply(x)| / y`` over the window, each prediction made *before* its own measurement was
added (out of sample), so the planner can tell a real predicted gain from the model's noise.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any, Optional, Sequence

import numpy as np

from hgraph.errors import CostModelError

TERMS = ("compute", "comm", "fixed")


class OnlineCorrection:
    """Per-term scales and per-strategy offsets fitted to (predicted terms, measured ms) pairs."""

    def __init__(self, window: int = 48, prior: float = 0.5, huber: float = 0.1, shrink: float = 0.5,
                 bounds: tuple[float, float] = (0.2, 5.0)) -> None:
        if window < 1 or prior < 0 or huber <= 0 or shrink < 0 or not 0 < bounds[0] < 1 < bounds[1]:
            raise CostModelError(
                f"OnlineCorrection(window={window}, prior={prior}, huber={huber}, shrink={shrink}, "
                f"bounds={bounds}): need window >= 1, prior >= 0, huber > 0, shrink >= 0, bounds around 1"
            )
        self.window, self.prior, self.huber, self.shrink, self.bounds = window, prior, huber, shrink, bounds
        self._seen: deque[tuple[str, tuple[float, ...], float]] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=window)
        self.scales: tuple[float, ...] = (1.0,) * len(TERMS)
        self.offsets: dict[str, float] = {}
        self.common_offset = 0.0
        self.observations = 0

    def apply(self, prediction: Any) -> float:
        """Corrected time (ms) of an ``IterationPrediction`` (anything with ``terms`` and ``strategy``)."""
        raw = float(np.dot(self.scales, prediction.terms))
        corrected = raw + self.offsets.get(str(prediction.strategy), self.common_offset)
        return max(corrected, self.bounds[0] * float(sum(prediction.terms)))  # never below the smallest scale

    def observe(self, prediction: Any, measured_ms: float) -> None:
        """Add one measured iteration and refit."""
        if not measured_ms > 0:
            raise CostModelError(f"measured iteration time {measured_ms!r} ms; expected a positive number")
        terms = tuple(float(t) for t in prediction.terms)
        if len(terms) != len(TERMS):
            raise CostModelError(f"prediction terms {terms}; expected {len(TERMS)} ({', '.join(TERMS)})")
        self._errors.append(abs(float(measured_ms) - self.apply(prediction)) / float(measured_ms))
        self._seen.append((str(prediction.strategy), terms, float(measured_ms)))
        self.observations += 1
        self.scales = self._fit_scales()
        self.common_offset, self.offsets = self._fit_offsets()

    def measured_error(self) -> Optional[float]:
        """Median out-of-sample relative error of the corrected predictions over the window (None
        before the first measurement)."""
        return statistics.median(self._errors) if self._errors else None

    def _fit_scales(self) -> tuple[float, ...]:
        x = np.array([t for _, t, _ in self._seen], dtype=np.float64)
        y = np.array([m for _, _, m in self._seen], dtype=np.float64)
        a = x / y[:, None]  # relative residual: 1 - a @ s
        lo, hi = self.bounds
        s = np.ones(len(TERMS))
        ridge = self.prior * np.eye(len(TERMS))
        for _ in range(20):
            r = np.abs(1.0 - a @ s)
            w = np.where(r <= self.huber, 1.0, self.huber / np.maximum(r, 1e-12))
            lhs = (a * w[:, None]).T @ a + ridge
            rhs = (a * w[:, None]).T @ np.ones_like(y) + ridge @ np.ones(len(TERMS))
            new = np.clip(np.linalg.solve(lhs, rhs), lo, hi)
            if np.allclose(new, s, rtol=1e-9, atol=1e-12):
                break
            s = new
        return tuple(float(v) for v in s)

    def _fit_offsets(self) -> tuple[float, dict[str, float]]:
        residuals: dict[str, list[float]] = {}
        for strategy, terms, measured in self._seen:
            residuals.setdefault(strategy, []).append(measured - float(np.dot(self.scales, terms)))
        common = statistics.median(r for v in residuals.values() for r in v)
        return common, {k: common + (statistics.median(v) - common) * len(v) / (len(v) + self.shrink)
                        for k, v in residuals.items()}

    def state_dict(self) -> dict[str, Any]:
        """Everything ``observe`` has learnt, as JSON-able data (for checkpoints): with
        ``load_state_dict`` a resumed run corrects exactly as the uninterrupted one would."""
        return {"settings": {"window": self.window, "prior": self.prior, "huber": self.huber,
                             "shrink": self.shrink, "bounds": list(self.bounds)},
                "seen": [[strategy, list(terms), measured] for strategy, terms, measured in self._seen],
                "scales": list(self.scales), "offsets": dict(self.offsets), "common_offset": self.common_offset,
                "observations": self.observations, "errors": list(self._errors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``; ``CostModelError`` if it came from other settings."""
        mine = self.state_dict()["settings"]
        saved = state.get("settings") if isinstance(state, dict) else None
        if saved != mine:
            raise CostModelError(f"the online correction state was saved with settings {saved}, this "
                                 f"correction has {mine}; construct OnlineCorrection the same way to resume")
        try:
            seen = [(str(s), tuple(float(t) for t in terms), float(m)) for s, terms, m in state["seen"]]
            scales = tuple(float(v) for v in state["scales"])
            offsets = {str(k): float(v) for k, v in state["offsets"].items()}
            observations = int(state["observations"])
            errors = [float(e) for e in state.get("errors", [])]  # absent in states saved before 0.3
            common = float(state.get("common_offset", 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CostModelError(f"malformed online correction state ({type(exc).__name__}: {exc})") from None
        if len(scales) != len(TERMS) or any(len(t) != len(TERMS) for _, t, _ in seen):
            raise CostModelError(f"online correction state has {len(scales)} scales; expected {len(TERMS)}")
        self._seen = deque(seen, maxlen=self.window)
        self._errors = deque(errors, maxlen=self.window)
        self.scales, self.offsets, self.observations = scales, offsets, observations
        self.common_offset = common

    def state(self) -> dict[str, Any]:
        """Scales and offsets as plain data (logged with every iteration)."""
        return {"scales": dict(zip(TERMS, self.scales)), "offsets_ms": dict(self.offsets),
                "common_offset_ms": self.common_offset,
                "observations": self.observations, "measured_error": self.measured_error()}

    def __str__(self) -> str:
        scales = ", ".join(f"{n} ×{v:.3f}" for n, v in zip(TERMS, self.scales))
        offsets = ", ".join(f"{k} {v:+.1f} ms" for k, v in self.offsets.items()) or "none"
        return (f"OnlineCorrection after {self.observations} iterations: {scales}; common offset "
                f"{self.common_offset:+.1f} ms; offsets {offsets}")


def fidelity(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """How well predictions match measurements: the median and 90th percentile of
    ``|predicted − measured| / measured``, Spearman's rank correlation, and the totals."""
    from scipy.stats import spearmanr

    if len(predicted) != len(measured) or not measured:
        raise CostModelError(f"{len(predicted)} predictions for {len(measured)} measurements; need equal, non-zero")
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    rel = np.abs(p - m) / m
    rho = float(spearmanr(p, m).statistic) if len(p) > 2 and np.ptp(p) > 0 and np.ptp(m) > 0 else float("nan")
    return {"median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.quantile(rel, 0.9)),
            "rank_correlation": rho, "predicted_total_ms": float(p.sum()), "measured_total_ms": float(m.sum()),
            "pairs": int(len(p))}
