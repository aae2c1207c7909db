"""Baselines, run side by side with hgraph's planner on the same batches and the same simulator.

* ``megatron``: what Megatron-LM/DeepSpeed users run today: one homogeneous strategy for the whole
  run, each batch packed best-fit-decreasing into micro-batches of a fixed token budget (the
  context length, or the scheme's MaxLen when smaller), micro-batches dealt to the data-parallel
  replicas balanced by time (largest first, to the least-loaded replica).
* ``homogeneous-tuned``: one homogeneous strategy for the whole run, with hgraph's own dispatch and
  packing per batch (the micro-batch count tuned per batch and pipeline).
* ``hydraulis-reference``: the reference planner of DESIGN.md A7 on hgraph's candidates: greedy
  dispatch over 100 seeded random orders minimising the proxy ``max_p Σ T'(l) + (pp − 1)·max T'(l)``
  (``T' = a·l² + b·l``, no ``c``, no token cap), then per pipeline an exact min-max packing MILP with a
  0.5 s limit for each of up to 16 micro-batch counts ``V`` (from ``ceil(tokens / MaxLen)`` to
  ``tokens / utilization_seqlen``), choosing ``V`` by ``(max T' + c)·(pp − 1 + V)`` and the strategy by
  that proxy. A ``V`` whose MILP finds no solution in time is skipped, as in the reference.

Each returns one ``IterationPlan`` per batch, predicted by the same simulator as hgraph's plans. The
homogeneous baselines choose their strategy once, by total predicted time over all batches.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hgraph.errors import PlanError
from hgraph.core.strategy import Strategy, homogeneous
from hgraph.planner.assign import Planner, check_lengths
from hgraph.planner.cost import CostModel
from hgraph.planner.exact import solve_min_max_packing
from hgraph.planner.plan import IterationPlan, PipelinePlan
from hgraph.planner.timing import PipelineCost

NAMES = ("megatron", "homogeneous-tuned", "hydraulis-reference")


def homogeneous_strategies(cost_model: CostModel, gpus: int) -> list[Strategy]:
    """Every homogeneous strategy of ``gpus`` GPUs over the schemes of the cost model."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"gpus={gpus!r}; the planner needs a positive number of GPUs")
    out = []
    for s in cost_model.schemes:
        if gpus % s.size == 0 and cost_model.max_len(s, gpus) > 0:
            out.append(Strategy(homogeneous(gpus, s.tp, s.pp, s.cp, s.ep).pipelines, gpus_per_node=cost_model.gpus_per_node))
    if not out:
        raise PlanError(f"no scheme of cost model {cost_model.name!r} divides {gpus} GPUs")
    return out


def _longest(batches: Sequence[Sequence[int]]) -> int:
    return max(max(check_lengths(b)) for b in batches)


def megatron(
    cost_model: CostModel, gpus: int, batches: Sequence[Sequence[int]], max_len: int, comm="default"
) -> list[IterationPlan]:
    """Best homogeneous strategy, best-fit-decreasing packing to a fixed token budget."""

    def plan_run(planner: Planner, longest: int) -> Optional[list[IterationPlan]]:
        budget = min(max_len, planner.pipeline_costs[0][0].max_len)
        return None if budget < longest else [_megatron_plan(planner, b, budget) for b in batches]

    return _best_homogeneous_run(cost_model, gpus, batches, comm, plan_run)


def _best_homogeneous_run(
    cost_model: CostModel,
    gpus: int,
    batches: Sequence[Sequence[int]],
    comm: Any,
    plan_run: Callable[[Planner, int], Optional[list[IterationPlan]]],
) -> list[IterationPlan]:
    """The plans of the homogeneous strategy whose whole run ``plan_run`` predicts fastest
    (``plan_run`` returns None for a strategy that cannot hold the longest sequence)."""
    longest = _longest(batches)
    best: Optional[tuple[float, list[IterationPlan]]] = None
    for strategy in homogeneous_strategies(cost_model, gpus):
        plans = plan_run(Planner(cost_model, [strategy], comm=comm), longest)
        if plans is None:
            continue
        total = sum(p.predicted_ms for p in plans)
        if best is None or total < best[0]:
            best = (total, plans)
    if best is None:
        raise PlanError(f"no homogeneous strategy on {gpus} GPUs holds a {longest}-token sequence")
    return best[1]


def _megatron_plan(planner: Planner, lengths: Sequence[int], budget: int) -> IterationPlan:
    start = time.perf_counter()
    lengths = check_lengths(lengths)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        l = lengths[i]
        fits = [k for k, r in enumerate(room) if r >= l]
        if fits:
            k = min(fits, key=room.__getitem__)
            bins[k].append(i)
            room[k] -= l
        else:
            bins.append([i])
            room.append(budget - l)
    costs = planner.pipeline_costs[0]
    cost = costs[0]
    replicas: list[list[list[int]]] = [[] for _ in costs]
    load = [0.0] * len(costs)
    for b in sorted(bins, key=lambda b: -cost.micro_batch_time([lengths[i] for i in b])):
        r = min(range(len(costs)), key=load.__getitem__)
        replicas[r].append(b)
        load[r] += cost.micro_batch_time([lengths[i] for i in b])
    return _plan(planner, 0, lengths, replicas, start)


def _plan(planner: Planner, k: int, lengths: Sequence[int], packs, start: float) -> IterationPlan:
    strategy = planner.candidates[k]
    costs = planner.pipeline_costs[k]
    pipelines = tuple(
        PipelinePlan(p, c, tuple(tuple(mb) for mb in mbs), tuple(tuple(lengths[i] for i in mb) for mb in mbs))
        for p, c, mbs in zip(strategy.pipelines, costs, packs)
    )
    predicted = planner.predicted(k, [pl.compute_ms for pl in pipelines])
    plan_ms = (time.perf_counter() - start) * 1e3
    sources = tuple((i, 0) for i in range(len(lengths)))
    return IterationPlan(strategy, pipelines, tuple(lengths), sources, predicted, plan_ms, planner.bound(lengths))


def homogeneous_tuned(
    cost_model: CostModel, gpus: int, batches: Sequence[Sequence[int]], comm="default"
) -> list[IterationPlan]:
    """Best single homogeneous strategy for the run, hgraph's dispatch and packing per batch."""

    def plan_run(planner: Planner, longest: int) -> Optional[list[IterationPlan]]:
        return None if planner.largest_max_len < longest else [planner.plan(b) for b in batches]

    return _best_homogeneous_run(cost_model, gpus, batches, comm, plan_run)


class HydraulisReference:
    """The reference planner of DESIGN.md A7 (see the module docstring); slow by design."""

    def __init__(
        self, cost_model: CostModel, candidates: Sequence[Strategy], comm="default",
        orders: int = 100, max_v: int = 16, time_limit: float = 0.5,
    ) -> None:
        self.planner = Planner(cost_model, candidates, comm=comm)
        table = cost_model.to_table().get("cluster_config", {})
        self.util = {int(k[2:]): int(v) for k, v in table.get("utilization_seqlen", {}).items()}
        self.orders, self.max_v, self.time_limit = orders, max_v, time_limit
        self._packs: dict[tuple[PipelineCost, tuple[int, ...]], tuple[float, list[list[int]]]] = {}

    def plan(self, lengths: Sequence[int]) -> IterationPlan:
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        longest = max(lengths)
        best = None
        for k, costs in enumerate(self.planner.pipeline_costs):
            if max(c.max_len for c in costs) < longest:
                continue
            members = self._dispatch(costs, lengths)
            proxy, packs = 0.0, []
            for p, (cost, m) in enumerate(zip(costs, members)):
                e2e, bins = self._pack(cost, self.planner.candidates[k].pipelines[p].tp, [lengths[i] for i in m])
                proxy = max(proxy, e2e)
                packs.append([[m[j] for j in b] for b in bins])
            if best is None or proxy < best[0]:
                best = (proxy, k, packs)
        if best is None:
            raise PlanError(f"a sequence of {longest} tokens exceeds every candidate's MaxLen")
        return _plan(self.planner, best[1], lengths, best[2], start)

    def _dispatch(self, costs: Sequence[PipelineCost], lengths: Sequence[int]) -> list[list[int]]:
        """Greedy over seeded random orders; each sequence goes where the proxy's maximum grows least
        (ties: an empty pipeline first). Vectorised over pipelines with numpy."""
        a = np.array([c.a for c in costs])
        b = np.array([c.b for c in costs])
        bubble = np.array([c.pp - 1.0 for c in costs])
        cap = np.array([c.max_len for c in costs])
        best: tuple[float, list[int]] = (math.inf, [])
        for seed in range(self.orders):
            order = list(range(len(lengths)))
            random.Random(seed).shuffle(order)
            acc = np.zeros(len(costs))
            tail = np.zeros(len(costs))
            owner = [0] * len(lengths)
            top = 0.0
            for i in order:
                l = lengths[i]
                t = a * l * l + b * l
                new_top = np.maximum(top, acc + t + np.maximum(tail, bubble * t))
                new_top[cap < l] = math.inf
                low = new_top.min()
                ties = np.flatnonzero(new_top == low)
                empty = ties[acc[ties] == 0]
                p = int(empty[0] if len(empty) else ties[0])
                acc[p] += t[p]
                tail[p] = max(tail[p], bubble[p] * t[p])
                owner[i] = p
                top = float(low)
            if top < best[0]:
                best = (top, owner)
        members: list[list[int]] = [[] for _ in costs]
        for i, p in enumerate(best[1]):
            members[p].append(i)
        return members

    def _pack(self, cost: PipelineCost, tp: int, lengths: list[int]) -> tuple[float, list[list[int]]]:
        """Reference packing: (proxy ``(max T' + c)·(pp − 1 + V)``, micro-batches as positions)."""
        if not lengths:
            return 0.0, []
        key = (cost, tuple(lengths))
        if key in self._packs:
            return self._packs[key]
        tokens = sum(lengths)
        times = [cost.seq_time(l) for l in lengths]
        v_lo = max(1, math.ceil(tokens / cost.max_len))
        v_hi = max(v_lo, min(len(lengths), tokens // self.util.get(tp, 1)))
        best: tuple[float, list[list[int]]] = (math.inf, [])
        for v in range(v_lo, min(v_hi, v_lo + self.max_v - 1) + 1):
            if v == 1:
                found = (sum(times), [list(range(len(lengths)))]) if tokens <= cost.max_len else None
            elif v == len(lengths):
                found = (max(times), [[i] for i in range(len(lengths))])
            else:
                found = solve_min_max_packing(times, lengths, v, cost.max_len, self.time_limit)
            if found is not None:
                proxy = (found[0] + cost.c) * (cost.pp - 1 + v)
                if proxy < best[0]:
                    best = (proxy, found[1])
        if not best[1]:
            raise PlanError(f"reference packing found no micro-batches for {len(lengths)} sequences on {cost}")
        self._packs[key] = best
        return best


def hydraulis_reference(
    cost_model: CostModel, candidates: Sequence[Strategy], batches: Sequence[Sequence[int]], **options
) -> list[IterationPlan]:
    """The reference planner on every batch (see ``HydraulisReference`` for ``options``)."""
    ref = HydraulisReference(cost_model, candidates, **options)
    return [ref.plan(b) for b in batches]

