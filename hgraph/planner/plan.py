"""Plan types: what the planner decides for one iteration, in a form the runtime can route.

Micro-batches hold indices into ``IterationPlan.lengths`` (the planned *pieces*); ``sources`` maps
each piece back to ``(sequence index in the batch, first token)``. Without splitting, piece ``i`` is
sequence ``i`` whole (``sources[i] == (i, 0)``). ``bound`` is the lower bound of ``hgraph.planner.bound``
for the pieces on the strategy's GPUs (set by the planner and the baselines).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Optional

from hgraph.core.batch import one_document_per_micro_batch
from hgraph.errors import PlanError
from hgraph.core.strategy import Pipeline, Strategy
from hgraph.planner.bound import LowerBound
from hgraph.planner.timing import IterationPrediction, PipelineCost


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
        return str(self.pipeline)

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

    def dispatch(self, strategy_index: int) -> "Dispatch":
        """The plan as the runtime runs it (``strategy_index``: the strategy's index in the compiled
        model); ``PlanError`` when the plan split sequences (the runtime runs whole sequences)."""
        if any(src[1] != 0 for src in self.sources) or len({src[0] for src in self.sources}) != len(self.sources):
            raise PlanError("the planner split sequences; the trainer needs whole sequences (split_long=False)")
        micro_batches = tuple(
            tuple(tuple(self.sources[i][0] for i in mb) for mb in p.micro_batches) for p in self.pipelines
        )
        return Dispatch(strategy_index, micro_batches, self.predicted_ms, self.prediction)

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


@dataclass(frozen=True)
class Dispatch:
    """Which sequences each pipeline of ``strategy_index`` runs, as micro-batches of sequence indices:
    what the Trainer executes, from ``IterationPlan.dispatch`` or ``dispatch.default_dispatch``."""

    strategy_index: int
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    predicted_ms: Optional[float] = None
    prediction: Optional[IterationPrediction] = None  # the planner's terms before correction, if any

    def one_document_per_micro_batch(self) -> "Dispatch":
        """This dispatch with every document in a micro-batch of its own (a model whose packing is not
        proved exact); the planner's prediction no longer applies."""
        return Dispatch(self.strategy_index, one_document_per_micro_batch(self.micro_batches))

    def encode(self) -> bytes:
        """Bytes rank 0 broadcasts, so every rank runs the same dispatch."""
        pred = None if self.prediction is None else asdict(self.prediction)
        return json.dumps([self.strategy_index, self.micro_batches, self.predicted_ms, pred]).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Dispatch":
        index, mbs, predicted, pred = json.loads(data)
        prediction = None if pred is None else IterationPrediction(**{**pred, "pipeline_ms": tuple(pred["pipeline_ms"])})
        return cls(index, tuple(tuple(tuple(mb) for mb in p) for p in mbs), predicted, prediction)

    def __str__(self) -> str:
        parts = [
            f"p{i}: " + " ".join("[" + ",".join(map(str, mb)) + "]" for mb in mbs)
            for i, mbs in enumerate(self.micro_batches)
        ]
        return f"strategy {self.strategy_index}: " + "; ".join(parts)
