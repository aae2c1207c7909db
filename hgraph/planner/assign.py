"""Per-iteration assignment: choose the candidate strategy, dispatch the batch, pack micro-batches.

``Planner.plan(lengths)`` minimises the predicted iteration time (``timing.predict``):

1. Keep the candidates whose largest MaxLen takes the longest sequence (longer sequences raise
   ``PlanError``, or are cut into MaxLen-sized pieces with ``split_long=True``).
2. Order them by a valid lower bound (``hgraph.planner.bound`` over the candidate's own pipelines;
   the total work spread evenly); skip every candidate whose bound cannot beat the best plan found.
3. Greedy dispatch + packing (``dispatch``) for the rest, then local search on the ``refine`` best
   (those within ``REFINE_WITHIN`` of the best greedy plan).
4. The smallest predicted time (compute plus exposed Pull/Push) wins.

With ``terms`` (measured ``IterationTerms``, ``hgraph profile --strategies``) a prediction is the
simulator's ``iteration_from_compute``: activation steps in every stage's ``T(l)``, the measured
Pull/Push (exposed part only under ``schedule="overlap"``) and fixed cost of each candidate; with a
``correction`` (``OnlineCorrection``) the corrected time, refitted by ``observe`` after each iteration.

Every plan carries the lower bound of ``hgraph.planner.bound`` for the candidates' GPU count.

``exact=True`` replaces 3 by the joint MILP of ``exact.solve_joint`` (small batches only).

With a ``correction`` the planner also *settles* (``hgraph.planner.settling``): it probes every
homogeneous candidate, keeps an incumbent, and replaces it on a batch only when another candidate's
predicted time is shorter by more than the correction's measured error
(``OnlineCorrection.measured_error``, before any measurement ``SETTLE_PRIOR_ERROR``). Only candidates
whose greedy plan is predicted faster than the incumbent's are searched.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from hgraph.errors import PlanError
from hgraph.planner.bound import BoundModel
from hgraph.planner.cost import CostModel
from hgraph.planner.dispatch import Assigner
from hgraph.planner.exact import solve_joint
from hgraph.planner.plan import IterationPlan, PipelinePlan
from hgraph.planner.correction import OnlineCorrection
from hgraph.planner.settling import EXPLORE_EVERY, PROBE_ROUNDS, SETTLE_PRIOR_ERROR, Settling
from hgraph.planner.timing import (
    CommModel, IterationPrediction, PipelineCost, comm_model_for, exposed_comm_ms, iteration_from_compute,
)
from hgraph.planner.terms import IterationTerms
from hgraph.core.strategy import Strategy, as_strategies

EXACT_MAX_VARIABLES = 4000
REFINE_WITHIN = 0.03  # local search only for greedy plans within 3% of the best greedy plan
DEFAULT = "default"


def pipeline_costs(
    cost_model: CostModel, strategy: Strategy, terms: Optional[IterationTerms] = None,
    pipeline_schedule: str = "1f1b",
) -> list[PipelineCost]:
    """``PipelineCost`` of every pipeline of ``strategy``, MaxLen for the strategy's world size (with
    ``terms``: the activation steps of ``pp > 1`` stages included), timed under ``pipeline_schedule``
    (interleaved 1F1B for pipelines with ``vpp > 1``)."""
    model = cost_model
    if model.world_size != strategy.world_size:
        model = model.with_world_size(strategy.world_size)
    out, cache = [], {}
    for p in strategy.pipelines:
        if p.degrees not in cache:
            sc = model.stage_cost(p.stage_key)
            if terms is not None:
                sc = terms.stage_cost(sc, p.pp)
            cache[p.degrees] = PipelineCost(sc.a, sc.b, sc.c, p.pp, model.max_len(p.stage_key), pipeline_schedule, p.vpp)
        out.append(cache[p.degrees])
    return out


def split_pieces(lengths: Sequence[int], cap: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Cut every sequence longer than ``cap`` into ``cap``-token pieces: (piece lengths, sources)."""
    pieces, sources = [], []
    for i, l in enumerate(lengths):
        for start in range(0, l, cap):
            pieces.append(min(cap, l - start))
            sources.append((i, start))
    return pieces, sources


def check_lengths(lengths: Iterable[Any]) -> list[int]:
    """The batch as a list of positive ints, else ``PlanError`` naming the bad entry."""
    out = []
    for i, l in enumerate(lengths):
        if isinstance(l, bool) or not isinstance(l, numbers.Integral):
            raise PlanError(f"sequence {i} has length {l!r}; lengths must be positive integers")
        l = int(l)
        if l < 1:
            raise PlanError(f"sequence {i} has length {l}; lengths must be positive integers")
        out.append(l)
    if not out:
        raise PlanError("cannot plan an empty batch; give at least one sequence")
    return out


class Planner:
    """Plans iterations for a fixed cost model and candidate set (candidates compiled once).

    ``comm`` is the Pull/Push model of the simulator: ``"default"`` (``AlphaBetaComm`` from the
    table's model config), None (compute only) or any ``CommModel``. ``refine`` is how many of the
    best greedy plans get the local search; ``budget_ms`` is a safety net on its time per iteration
    (the search normally ends well before it, so plans do not depend on the machine's speed).
    ``pipeline_costs[k]`` holds the ``PipelineCost`` of every pipeline of ``candidates[k]``;
    ``pipeline_schedule`` (as compiled: ``"1f1b"`` or ``"zb1p"``; ``vpp > 1`` pipelines interleave) sets
    the bubble of each (``timing.pipeline_time``).
    """

    def __init__(
        self,
        cost_model: CostModel,
        candidates: Iterable[Union[Strategy, str]],
        comm: Union[CommModel, str, None] = DEFAULT,
        budget_ms: float = 60.0,
        refine: int = 3,
        terms: Optional[IterationTerms] = None,
        schedule: str = "none",
        correction: Optional[OnlineCorrection] = None,
        pipeline_schedule: str = "1f1b",
        explore_every: int = EXPLORE_EVERY,
        probe_rounds: int = PROBE_ROUNDS,
    ) -> None:
        self.cost_model = cost_model
        self.candidates = as_strategies(candidates)
        if not self.candidates:
            raise PlanError("the planner needs at least one candidate strategy")
        self.terms, self.schedule, self.correction = terms, schedule, correction
        if terms is not None:
            for s in self.candidates:
                terms.of(s, schedule)  # every candidate needs its measured terms
        self.comm: Optional[CommModel] = comm_model_for(cost_model) if comm == DEFAULT else comm  # type: ignore[assignment]
        self.budget_ms = budget_ms
        self.refine = refine
        self.pipeline_costs = [pipeline_costs(cost_model, s, terms, pipeline_schedule) for s in self.candidates]
        self._comm_ms = [
            [self.comm.pull_push_ms(s, i) if self.comm else 0.0 for i in range(len(s.pipelines))]
            for s in self.candidates
        ]
        self.largest_max_len = max(c.max_len for costs in self.pipeline_costs for c in costs)
        self.bound = BoundModel.for_cost_model(cost_model, max(s.world_size for s in self.candidates))
        self._bounds = [
            BoundModel.for_pipelines(costs, [p.tp * p.pp * p.cp for p in s.pipelines])
            for s, costs in zip(self.candidates, self.pipeline_costs)
        ]
        self.homogeneous = tuple(k for k, s in enumerate(self.candidates) if len({p.degrees for p in s.pipelines}) == 1)
        self.settling = Settling(self.homogeneous, probe_rounds, explore_every)
        self._index = {str(s): k for k, s in enumerate(self.candidates)}

    @property
    def homogeneous_ms(self) -> dict[int, float]:
        """Running total of predicted ms of each homogeneous candidate (``Settling.totals``)."""
        return self.settling.totals

    @property
    def incumbent(self) -> Optional[int]:
        """The homogeneous candidate the planner settles on (None without a correction, while
        probing, or when none took every batch)."""
        return self.settling.incumbent if self.correction is not None else None

    @property
    def probe_iterations(self) -> int:
        """Batches probing takes (with a correction) when every batch fits every homogeneous candidate."""
        return self.settling.probe_iterations if self.correction is not None else 0

    def probing(self) -> bool:
        """Whether the planner still probes its homogeneous candidates (``Settling.probing``)."""
        return self.correction is not None and self.settling.probing()

    def switch_margin(self) -> float:
        """The relative predicted gain a switch away from the incumbent needs: the correction's
        measured error (``SETTLE_PRIOR_ERROR`` before any measurement)."""
        error = self.correction.measured_error() if self.correction is not None else None
        return SETTLE_PRIOR_ERROR if error is None else error

    def prediction(self, k: int, compute: Sequence[float]) -> Optional[IterationPrediction]:
        """The simulator's terms for candidate ``k`` with per-pipeline compute (None without ``terms``)."""
        if self.terms is None:
            return None
        return iteration_from_compute(self.candidates[k], compute, self.terms, self.schedule)

    def observe(self, prediction: Optional[IterationPrediction], measured_ms: float) -> None:
        """Feed one measured iteration to the correction (no-op without one or without terms)."""
        if self.correction is not None and prediction is not None:
            self.correction.observe(prediction, measured_ms)
            self.settling.observe(self._index.get(str(prediction.strategy)), self.switch_margin())

    def state_dict(self) -> dict[str, Any]:
        """What the planner learns while it runs (the online correction), as JSON-able data; the
        cost model, terms and candidates are inputs, rebuilt by whoever constructs the planner."""
        return {"candidates": [str(s) for s in self.candidates],
                "correction": self.correction.state_dict() if self.correction is not None else None,
                **self.settling.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` (same candidates; a correction only if saved with one)."""
        mine = [str(s) for s in self.candidates]
        if state.get("candidates") != mine:
            raise PlanError(f"the planner state was saved for the candidates {state.get('candidates')}, this "
                            f"planner has {mine}; resume with the same strategies")
        saved = state.get("correction")
        if (saved is None) != (self.correction is None):
            raise PlanError("the planner state was saved " + ("without" if saved is None else "with")
                            + " an online correction; construct the Planner the same way to resume")
        if self.correction is not None:
            self.correction.load_state_dict(saved)
        self.settling.load_state_dict(state, self.switch_margin())

    def predicted(self, k: int, compute: Sequence[float]) -> float:
        """Predicted time of candidate ``k`` with per-pipeline compute times (adds exposed Pull/Push;
        with ``terms`` the measured terms, corrected when there is a ``correction``)."""
        found = self.prediction(k, compute)
        if found is not None:
            return self.correction.apply(found) if self.correction is not None else found.total_ms
        out = 0.0
        for cost, t, comm in zip(self.pipeline_costs[k], compute, self._comm_ms[k]):
            layers = self.comm.layers / cost.pp if self.comm else 1.0
            out = max(out, t + (exposed_comm_ms(comm, t, layers) if t > 0 else 0.0))
        return out

    def _lower_bound(self, k: int, values: np.ndarray, counts: np.ndarray) -> float:
        """A lower bound of candidate ``k``'s time: ``hgraph.planner.bound`` over its own pipelines, and
        the total work on its cheapest pipelines spread over all of them."""
        costs = self.pipeline_costs[k]
        groups = sorted(set(costs), key=lambda c: (c.a, c.b, c.c, c.pp, c.max_len))
        work = np.array([c.a * values**2 + c.b * values for c in groups])
        cap = np.array([c.max_len for c in groups], dtype=np.float64)[:, None]
        spread = float(np.dot(np.where(cap >= values, work, np.inf).min(axis=0), counts)) / len(costs)
        return max(self._bounds[k].of_histogram(values, counts).ms, spread)

    def plan(
        self, lengths: Sequence[int], split_long: bool = False, exact: bool = False,
        time_limit: Optional[float] = 60.0, only: Optional[Sequence[int]] = None,
        max_piece: Optional[int] = None,
    ) -> IterationPlan:
        """The best plan for one batch of sequence ``lengths`` (see the module docstring); ``only``
        restricts the choice to those candidate indices (e.g. to predict one strategy). With
        ``split_long`` a sequence longer than the largest MaxLen, or than ``max_piece`` (the context
        length) when that is shorter, is cut into pieces of at most that many tokens."""
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        longest = max(lengths)
        cap = self.largest_max_len if max_piece is None else min(self.largest_max_len, max_piece)
        if longest > self.largest_max_len and not split_long:
            raise PlanError(
                f"a sequence of {longest} tokens exceeds the largest MaxLen {self.largest_max_len} of every "
                "candidate strategy; truncate it or pass split_long=True"
            )
        if split_long:
            pieces, sources = split_pieces(lengths, cap)
        else:
            pieces, sources = lengths, [(i, 0) for i in range(len(lengths))]
        longest = max(pieces)
        eligible = [k for k, costs in enumerate(self.pipeline_costs) if max(c.max_len for c in costs) >= longest
                    and (only is None or k in only)]
        if not eligible:
            raise PlanError(f"no candidate among {list(only or [])} takes a sequence of {longest} tokens")
        if exact:
            best = self._exact(eligible, pieces, time_limit)
        else:
            settled = self._settle(eligible, pieces, longest, start) if only is None else None
            best = settled if settled is not None else self._heuristic(eligible, pieces, longest, start)
        predicted, k, packs = best
        strategy = self.candidates[k]
        pipelines = tuple(
            PipelinePlan(
                p, cost, tuple(tuple(mb) for mb in mbs), tuple(tuple(pieces[i] for i in mb) for mb in mbs)
            )
            for p, cost, mbs in zip(strategy.pipelines, self.pipeline_costs[k], packs)
        )
        plan_ms = (time.perf_counter() - start) * 1e3
        prediction = self.prediction(k, [p.compute_ms for p in pipelines])
        return IterationPlan(
            strategy, pipelines, tuple(pieces), tuple(sources), predicted, plan_ms, self.bound(pieces), prediction
        )

    def _settle(self, eligible: list[int], pieces: list[int], longest: int, start: float) -> Optional[tuple]:
        """With a correction: a probe while probing; the runner-up when exploration is due; else the
        incumbent's plan unless another candidate's beats it by more than the margin. Only candidates
        whose greedy plan is predicted faster than the incumbent's are searched, so a settled planner
        plans about as fast as one with a single candidate. Records every homogeneous candidate's
        greedy predicted time for ``observe`` (inf where it cannot take the batch). None: no
        incumbent (before the first measurement, or one that cannot take this batch); plan as usual."""
        if self.correction is None:
            return None
        greedy = {k: self._greedy_ms(k, pieces) for k in eligible}
        probe = self.settling.plan_batch(greedy)
        if probe is not None:
            return self._heuristic([probe], pieces, longest, start)  # measure it before choosing the incumbent
        incumbent = self.settling.incumbent
        if incumbent is None or incumbent not in eligible:
            return None
        others = [k for k in self.settling.ranked() if k in eligible and k != incumbent]
        if others and self.settling.exploring():
            return self._heuristic([others[0]], pieces, longest, start)  # the correction learns only what runs
        kept = self._heuristic([incumbent], pieces, longest, start)
        challengers = [k for k in eligible if k != incumbent and greedy[k] < greedy[incumbent]]
        if not challengers:
            return kept
        best = self._heuristic(challengers, pieces, longest, start)
        return best if best[0] < kept[0] * (1.0 - self.switch_margin()) else kept

    def _greedy_ms(self, k: int, pieces: list[int]) -> float:
        """Candidate ``k``'s predicted time with the greedy dispatch and packing (no search)."""
        assigner = Assigner(self.pipeline_costs[k], pieces)
        members = assigner.greedy()
        return self.predicted(k, [assigner.time_of(p, m) for p, m in enumerate(members)])

    def _heuristic(self, eligible: list[int], pieces: list[int], longest: int, start: float):
        values, counts = np.unique(np.asarray(pieces, dtype=np.float64), return_counts=True)
        bounds = sorted((self._lower_bound(k, values, counts), k) for k in eligible)
        greedy: list[tuple[float, int, Assigner, list[list[int]]]] = []
        best = math.inf
        for bound, k in bounds:
            if bound >= best:
                break
            assigner = Assigner(self.pipeline_costs[k], pieces)
            members = assigner.greedy()
            predicted = self.predicted(k, [assigner.time_of(p, m) for p, m in enumerate(members)])
            greedy.append((predicted, k, assigner, members))
            best = min(best, predicted)
        greedy.sort(key=lambda g: g[0])
        results = []
        top = [g for g in greedy[: self.refine] if g[0] <= greedy[0][0] + abs(greedy[0][0]) * REFINE_WITHIN]
        for n, (_, k, assigner, members) in enumerate(top):
            left = self.budget_ms - (time.perf_counter() - start) * 1e3
            share = max(left, 1.0) / (len(top) - n)
            # the search lowers the slowest pipeline's compute; keep the greedy plan too, in case
            # Pull/Push exposure makes it the better one after all
            for found in (members, assigner.search(time.perf_counter() + share / 1e3, start=[list(m) for m in members])):
                packs = [assigner.packed(p, m) for p, m in enumerate(found)]
                results.append((self.predicted(k, [t for _, t in packs]), k, [b for b, _ in packs]))
        return min(results, key=lambda r: r[0])

    def _exact(self, eligible: list[int], pieces: list[int], time_limit: Optional[float]):
        results = []
        for k in eligible:
            size = len(pieces) ** 2 * len(self.pipeline_costs[k])
            if size > EXACT_MAX_VARIABLES:
                raise PlanError(
                    f"exact mode needs {size} binaries for {len(pieces)} sequences on strategy "
                    f"{self.candidates[k]}; it is meant for at most {EXACT_MAX_VARIABLES} (small batches)"
                )
            packs, _ = solve_joint(self.pipeline_costs[k], pieces, time_limit)
            compute = [c.time([[pieces[i] for i in mb] for mb in mbs]) for c, mbs in zip(self.pipeline_costs[k], packs)]
            results.append((self.predicted(k, compute), k, packs))
        return min(results, key=lambda r: r[0])


def plan_iteration(
    cost_model: CostModel,
    candidates: Iterable[Union[Strategy, str]],
    lengths: Sequence[int],
    split_long: bool = False,
    exact: bool = False,
    comm: Union[CommModel, str, None] = DEFAULT,
) -> IterationPlan:
    """One-shot form of ``Planner(cost_model, candidates, comm).plan(lengths, split_long, exact)``."""
    return Planner(cost_model, candidates, comm).plan(lengths, split_long=split_long, exact=exact)
