"""Plan types: what the planner decides for one iteration, in a form the runtime can route.

Micro-batches hold indices into ``IterationPlan.lengths`` (the planned *pieces*); ``sources`` maps
each piece back to ``(sequence index in the batch, first token)``. Without splitting, piece ``i`` is
sequence ``i`` whole (``sources[i] == (i, 0)``). ``bound`` is the lower bound of ``hgraph.planner.bound``
for the pieces on the strategy's GPUs (set by the planner and the baselines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hgraph.planner.bound import LowerBound
from hgraph.planner.simulate import IterationPrediction, PipelineCost
from hgraph.strategy import Pipeline, Strategy


@dataclass(frozen=True)
class PipelinePlan:
    """One pipeline's share of the batch, packed into micro-batches (run in this order)."""

    pipeline: Pipeline
    cost: PipelineCost
    micro_batches: tuple[tuple[int, ...], ...]
    micro_batch_lengths: tuple[tuple[int, ...], ...]

    @property
    def scheme(self) -> str:
        """``"tp2,pp4"``: the pipeline's degrees."""
        return str(self.pipeline).strip("()")

    @property
    def max_len(self) -> int:
        return self.cost.max_len

    @property
    def compute_ms(self) -> float:
        """1F1B time of the micro-batches, without Pull/Push."""
        return self.cost.time(self.micro_batch_lengths)

    def to_json(self) -> dict[str, Any]:
        p = self.pipeline
        return {
            "tp": p.tp,
            "pp": p.pp,
            "cp": p.cp,
            "ranks": list(p.ranks or ()),
            "max_len": self.max_len,
            "micro_batches": [list(mb) for mb in self.micro_batches],
        }

    def __str__(self) -> str:
        ranks = self.pipeline.ranks or ()
        span = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no ranks"
        mbs = " ".join(f"[{'+'.join(map(str, mb))}]" for mb in self.micro_batch_lengths)
        return (
            f"{self.pipeline} {span} MaxLen {self.max_len}: {len(self.micro_batches)} micro-batches, "
            f"{self.compute_ms:.1f} ms: {mbs or '(idle)'}"
        )


@dataclass(frozen=True)
class IterationPlan:
    """The chosen strategy, every pipeline's micro-batches, the predicted time, the planning time and
    a lower bound of the iteration's time; ``prediction`` splits ``predicted_ms`` (before correction)
    into the simulator's terms when the planner has measured iteration terms."""

    strategy: Strategy
    pipelines: tuple[PipelinePlan, ...]
    lengths: tuple[int, ...]
    sources: tuple[tuple[int, int], ...]
    predicted_ms: float
    plan_ms: float
    bound: LowerBound | None = None
    prediction: IterationPrediction | None = None

    @property
    def num_micro_batches(self) -> int:
        return sum(len(p.micro_batches) for p in self.pipelines)

    @property
    def ratio_to_bound(self) -> float | None:
        """``predicted_ms / bound.ms`` (>= 1; None without a bound)."""
        return None if self.bound is None else self.bound.ratio(self.predicted_ms)

    def to_json(self) -> dict[str, Any]:
        """The per-iteration object of ``hgraph plan --json``: micro-batches index ``lengths``."""
        out: dict[str, Any] = {
            "strategy": str(self.strategy),
            "lengths": list(self.lengths),
            "pipelines": [p.to_json() for p in self.pipelines],
            "predicted_ms": round(self.predicted_ms, 3),
            "plan_ms": round(self.plan_ms, 3),
        }
        if any(src != (i, 0) for i, src in enumerate(self.sources)):  # split_long cut sequences
            out["sources"] = [list(s) for s in self.sources]
        if self.bound is not None:
            out["lower_bound"] = self.bound.to_json()
            out["ratio_to_bound"] = round(self.bound.ratio(self.predicted_ms), 4)
        if self.prediction is not None:
            out["prediction"] = {"compute_ms": self.prediction.compute_ms, "comm_ms": self.prediction.comm_ms,
                                 "fixed_ms": self.prediction.fixed_ms}
        return out

    def __str__(self) -> str:
        head = (
            f"IterationPlan {self.strategy}: {len(self.lengths)} sequences, {sum(self.lengths)} tokens, "
            f"predicted {self.predicted_ms:.1f} ms (planned in {self.plan_ms:.1f} ms)"
        )
        if self.bound is not None:
            head += f", {self.ratio_to_bound:.3f}x the {self.bound}"
        return "\n".join([head] + [f"  {p}" for p in self.pipelines])
