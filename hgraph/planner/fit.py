"""The per-scheme stage-cost fit ``T(l) = a·l² + b·l + c`` of measured times, shared by the
one-process profiler (``profile.py``) and the profiler on local ranks (``profile_ranks.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import nnls

from hgraph.errors import CostModelError
from hgraph.planner.cost import StageCost


@dataclass(frozen=True)
class Fit:
    """Least-squares ``T(l) = a*l^2 + b*l + c`` (a, b, c >= 0) and how well it matches the points."""

    cost: StageCost
    r2: float
    max_rel_error: float

    def __str__(self) -> str:
        return f"{self.cost}  (R² {self.r2:.4f}, max relative error {self.max_rel_error:.1%})"


def fit_stage_cost(lengths: Sequence[float], times_ms: Sequence[float]) -> Fit:
    """Fit ``a, b, c >= 0`` to measured ``(l, ms)`` pairs by non-negative least squares on relative error."""
    l = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(times_ms, dtype=np.float64)
    if l.shape != t.shape or l.ndim != 1:
        raise CostModelError(f"fit needs as many times as lengths, got {l.shape} and {t.shape}")
    if np.unique(l).size < 3:
        raise CostModelError(
            f"fitting a, b, c needs at least 3 distinct lengths, got {sorted(set(l.tolist()))}"
        )
    if np.any(l <= 0) or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise CostModelError("fit needs positive lengths and positive, finite times")
    design = np.stack([l * l, l, np.ones_like(l)], axis=1)
    # Rows weighted by 1/t: relative errors count alike at short and long lengths (timings are
    # noisy in proportion to their size); columns equilibrated because l^2 dwarfs 1.
    weighted = design / t[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    coef, _ = nnls(weighted / scale, np.ones_like(t))
    a, b, c = (coef / scale).tolist()
    predicted = design @ np.array([a, b, c])
    total = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((t - predicted) ** 2)) / total if total > 0 else 1.0
    return Fit(StageCost(a, b, c), r2, float(np.max(np.abs(predicted - t) / t)))
