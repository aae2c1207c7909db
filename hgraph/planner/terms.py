"""Measured iteration terms: what an iteration costs beyond the per-stage compute ``T(l)``.

``hgraph profile --strategies`` (``hgraph.profiling.profile_iteration``) measures them on real ranks
through the real runtime; the simulator (``hgraph.planner.timing.predict_iteration``) adds them up:

* ``activation``: one pipeline send/receive step of an activation (header exchange + payload
  exchange, as the runtime does it), ``alpha_ms + beta_ms_per_byte · bytes``; a micro-batch of ``n``
  tokens moves ``n · bytes_per_token`` bytes.
* per strategy and schedule (``StrategyTerms``): Pull Parameter and Push Gradient with the blocking
  schedule, the fraction of them left exposed under ``schedule="overlap"``, the optimizer step, and
  ``fixed_ms``: the rest of the iteration (loss and gradient-norm reductions, packing, the gap
  between ranks), and ``compute_scale``: how much longer (or shorter) the strategy's stages compute
  inside a real iteration than the profiled ``T(l)`` says (other ranks' Pull/Push and the trainer
  share the cores). Both are fitted to the measured profile iterations: the scale by a grid search
  minimising the median relative error, ``fixed_ms`` as the median of measured minus modelled time.

Each term keeps how well it was measured: ``noise`` (median relative deviation of repeated
measurements of one iteration) and ``residual`` (median relative error of the fitted model on the
profile iterations). The terms travel in the cost table under ``"_iteration_terms"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from hgraph.errors import CostModelError
from hgraph.planner.cost import CostModel, StageCost
from hgraph.schedule.lowerings import PLACEMENTS

TABLE_KEY = "_iteration_terms"


@dataclass(frozen=True)
class AlphaBeta:
    """``alpha_ms + beta_ms_per_byte · bytes``: one point-to-point step of ``bytes`` bytes."""

    alpha_ms: float
    beta_ms_per_byte: float
    residual: float = 0.0  # max relative error of the fit on its points

    def ms(self, nbytes: float) -> float:
        return self.alpha_ms + self.beta_ms_per_byte * nbytes

    def __str__(self) -> str:
        gbps = 1e-6 / self.beta_ms_per_byte if self.beta_ms_per_byte > 0 else float("inf")
        return f"{self.alpha_ms:.3f} ms + bytes / {gbps:.2f} GB/s (max rel. error {self.residual:.1%})"


@dataclass(frozen=True)
class StrategyTerms:
    """Measured per-iteration terms of one strategy under one schedule (milliseconds)."""

    strategy: str
    schedule: str
    pull_ms: float  # every Pull Parameter of the slowest rank, blocking
    push_ms: float  # every Push Gradient, blocking, on the rank that waited least
    exposed_fraction: float  # of pull + push left on the critical path (1 under schedule="none")
    optimizer_ms: float  # gradient norm + AdamW on the shards (inside fixed_ms)
    fixed_ms: float  # the rest of the iteration (see the module docstring)
    compute_scale: float = 1.0  # measured / profiled T(l) of this strategy's stages in real iterations
    noise: float = 0.0
    residual: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in PLACEMENTS:
            raise CostModelError(f"schedule {self.schedule!r}; expected one of {', '.join(PLACEMENTS)}")

    @property
    def pull_push_ms(self) -> float:
        return self.pull_ms + self.push_ms

    def exposed_comm_ms(self, compute_ms: float) -> float:
        """Pull + Push left exposed next to ``compute_ms`` of a pipeline: all of it when blocking;
        under overlap the measured floor, or what the compute is too short to hide."""
        total = self.pull_push_ms
        if self.schedule == "none":
            return total
        return max(self.exposed_fraction * total, total - compute_ms)

    def __str__(self) -> str:
        return (
            f"{self.strategy} [{self.schedule}]: pull {self.pull_ms:.1f} + push {self.push_ms:.1f} ms "
            f"({self.exposed_fraction:.0%} exposed), optimizer {self.optimizer_ms:.1f} ms, fixed "
            f"{self.fixed_ms:.1f} ms, T(l) ×{self.compute_scale:.2f}; noise {self.noise:.1%}, residual {self.residual:.1%} ({self.samples} its)"
        )


@dataclass(frozen=True)
class IterationTerms:
    """Everything the simulator adds to ``T(l)``: the activation step model and per-strategy terms."""

    activation: AlphaBeta
    bytes_per_token: float  # activation bytes one token sends across a stage boundary
    layers: int
    strategies: Mapping[tuple[str, str], StrategyTerms] = field(default_factory=dict)

    def of(self, strategy: Any, schedule: str) -> StrategyTerms:
        """The terms of ``strategy`` (a ``Strategy`` or its string) under ``schedule``."""
        key = (str(strategy), schedule)
        if key not in self.strategies:
            known = "; ".join(f"{s} [{sc}]" for s, sc in self.strategies) or "none"
            raise CostModelError(
                f"no measured iteration terms for strategy {key[0]} with schedule={schedule!r} (known: {known}); "
                "profile it: hgraph profile --world-size N --strategies '...' --schedule " + schedule
            )
        return self.strategies[key]

    def has(self, strategy: Any, schedule: str) -> bool:
        return (str(strategy), schedule) in self.strategies

    def stage_cost(self, cost: StageCost, pp: int) -> StageCost:
        """``T(l)`` of a stage plus its activation steps: a stage of a ``pp > 1`` pipeline sends or
        receives each micro-batch once forward and once backward on the critical path."""
        if pp <= 1:
            return cost
        a = self.activation
        return StageCost(cost.a, cost.b + 2 * a.beta_ms_per_byte * self.bytes_per_token, cost.c + 2 * a.alpha_ms)

    def merged(self, other: IterationTerms) -> IterationTerms:
        """These terms with ``other``'s strategies added (``other``'s activation model wins)."""
        return IterationTerms(other.activation, other.bytes_per_token, other.layers,
                              {**self.strategies, **other.strategies})

    def to_json(self) -> dict[str, Any]:
        return {
            "activation": asdict(self.activation),
            "bytes_per_token": self.bytes_per_token,
            "layers": self.layers,
            "strategies": [asdict(t) for t in self.strategies.values()],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IterationTerms:
        try:
            terms = [StrategyTerms(**t) for t in data["strategies"]]
            return cls(AlphaBeta(**data["activation"]), float(data["bytes_per_token"]), int(data["layers"]),
                       {(t.strategy, t.schedule): t for t in terms})
        except (KeyError, TypeError, ValueError) as exc:
            raise CostModelError(f"cost table field {TABLE_KEY}: malformed ({exc})") from None

    def __str__(self) -> str:
        lines = [f"activation step: {self.activation}; {self.bytes_per_token:g} bytes/token, {self.layers} layers"]
        lines += [f"  {t}" for t in self.strategies.values()]
        return "\n".join(lines)


def terms_of(cost_model: CostModel) -> Optional[IterationTerms]:
    """The iteration terms a cost table carries, or None."""
    data = cost_model.extra.get(TABLE_KEY)
    return None if data is None else IterationTerms.from_json(data)


def with_terms(cost_model: CostModel, terms: IterationTerms) -> CostModel:
    """A copy of ``cost_model`` whose table carries ``terms``."""
    table = cost_model.to_table()
    table[TABLE_KEY] = terms.to_json()
    return CostModel.from_table(table, name=cost_model.name)
