"""Dispatch a batch's sequences to a strategy's pipelines, minimising the slowest pipeline.

1. **Greedy** (earliest finish time): longest sequence first, each onto the pipeline whose estimated
   time grows least, among the pipelines whose MaxLen takes it. The estimate ``lower_bound`` is a
   true lower bound of the packed 1F1B time (it relaxes the number of micro-batches and assumes
   perfectly even ones), so it counts ``c`` and the bubble, unlike the reference's proxy.
   Identical pipelines form a group; only the least-loaded member of each group is tried.
2. **Local search** on true packed times: move or swap sequences out of the slowest pipeline while
   that lowers the slower of the two pipelines involved (by at least ``MIN_GAIN``), until no move
   helps or the deadline passes;
   then restarts from perturbed greedy orders (many for small batches, few or none for large ones).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from typing import Optional, Protocol, Sequence

import numpy as np

from hgraph.errors import PlanError
from hgraph.planner.packing import Packing, first_fit_decreasing, pack
from hgraph.planner.timing import PipelineCost

MAX_RESTARTS = 64
RESTART_WORK = 2000
MIN_GAIN = 1e-4  # a local-search step must lower the slowest pipeline by this fraction


def lower_bound(cost: PipelineCost, work: float, tokens: int, t_max: float, count: int) -> float:
    """A lower bound of the 1F1B time of ``count`` sequences of total work ``work`` (ms),
    ``tokens`` tokens and heaviest sequence ``t_max``, over every packing."""
    if count == 0:
        return 0.0
    v_min = max(1, math.ceil(tokens / cost.max_len))
    if cost.pp == 1:
        return work + v_min * cost.c
    bubble = cost.pp - 1
    best_v = work / t_max if t_max > 0 else count
    if cost.c > 0:
        best_v = min(best_v, math.sqrt(bubble * work / cost.c))
    best = math.inf
    for v in {math.floor(best_v), math.ceil(best_v)}:
        v = min(max(v, v_min), max(count, v_min))
        best = min(best, work + v * cost.c + bubble * (max(t_max, work / v) + cost.c))
    return best


class Assigner:
    """Dispatch + packing for one strategy's pipelines (``costs``, one per pipeline)."""

    def __init__(self, costs: Sequence[PipelineCost], lengths: Sequence[int]) -> None:
        if not lengths:
            raise PlanError("cannot plan an empty batch; give at least one sequence")
        self.costs = list(costs)
        self.lengths = list(lengths)
        self._cache: dict[tuple[int, tuple[int, ...]], tuple[Packing, float]] = {}
        self._group_of: list[int] = []
        groups: dict[PipelineCost, int] = {}
        for c in self.costs:
            self._group_of.append(groups.setdefault(c, len(groups)))
        self._group_cost = list(groups)
        self._times: Optional[list[list[float]]] = None

    # -- packing with a cache keyed by (group, sorted lengths) --------------------------------------

    def packed(self, p: int, members: Sequence[int]) -> tuple[Packing, float]:
        """Packing of ``members`` (sequence indices) on pipeline ``p``, as sequence indices, and its time."""
        ordered = sorted(members, key=lambda i: -self.lengths[i])
        key = (self._group_of[p], tuple(self.lengths[i] for i in ordered))
        hit = self._cache.get(key)
        if hit is None:
            hit = pack(self.costs[p], key[1])
            self._cache[key] = hit
        bins, t = hit
        return [[ordered[k] for k in b] for b in bins], t

    def time_of(self, p: int, members: Sequence[int]) -> float:
        return self.packed(p, members)[1]

    # -- stage 1: greedy ---------------------------------------------------------------------------

    def greedy(self, order: Optional[Sequence[int]] = None) -> list[list[int]]:
        """Earliest-finish-time dispatch, longest sequence first (or in ``order``)."""
        lengths = self.lengths
        if order is None:
            order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        n_groups = len(self._group_cost)
        heaps: list[list[tuple[float, int]]] = [[] for _ in range(n_groups)]
        for p, g in enumerate(self._group_of):
            heaps[g].append((0.0, p))
        work = [0.0] * len(self.costs)
        tokens = [0] * len(self.costs)
        t_max = [0.0] * len(self.costs)
        members: list[list[int]] = [[] for _ in self.costs]
        largest = max(c.max_len for c in self.costs)
        times = self._seq_times()
        groups = list(enumerate(self._group_cost))
        for i in order:
            l = lengths[i]
            best: Optional[tuple[float, int, int]] = None
            for g, cost in groups:
                if l > cost.max_len:
                    continue
                p = heaps[g][0][1]
                t = times[g][i]
                w, n = work[p] + t, tokens[p] + l
                if cost.pp == 1:  # lower_bound() inlined for the common case
                    new = w + max(1, -(-n // cost.max_len)) * cost.c
                else:
                    new = lower_bound(cost, w, n, max(t_max[p], t), len(members[p]) + 1)
                if best is None or new < best[0]:
                    best = (new, g, p)
            if best is None:
                raise PlanError(
                    f"sequence {i} has {l} tokens, more than the largest MaxLen {largest} of this strategy"
                )
            new, g, p = best
            heapq.heapreplace(heaps[g], (new, p))
            t = times[g][i]
            work[p] += t
            tokens[p] += l
            t_max[p] = max(t_max[p], t)
            members[p].append(i)
        return members

    def _seq_times(self) -> list[list[float]]:
        """``seq_time`` of every sequence on every group's pipelines (computed once)."""
        if self._times is None:
            values = np.asarray(self.lengths, dtype=np.float64)
            self._times = [(c.a * values * values + c.b * values).tolist() for c in self._group_cost]
        return self._times

    # -- stage 2: local search ---------------------------------------------------------------------

    def improve(self, members: list[list[int]], deadline: float, targets_per_group: int = 4) -> list[list[int]]:
        """Moves and swaps out of the slowest pipeline while they help (see the module docstring)."""
        times = [self.time_of(p, m) for p, m in enumerate(members)]
        while time.perf_counter() < deadline:
            h = max(range(len(times)), key=times.__getitem__)
            step = self._first_step(h, members, times, targets_per_group, deadline)
            if step is None:
                break
            q, i, r, new_h, new_q = step
            members[h].remove(i)
            members[q].append(i)
            if r is not None:
                members[q].remove(r)
                members[h].append(r)
            times[h], times[q] = new_h, new_q
        return members

    def _targets(self, h: int, times: list[float], per_group: int) -> list[int]:
        if len(times) <= 4 * per_group:
            return [q for q in range(len(times)) if q != h]
        by_group: dict[int, list[int]] = {}
        for q in sorted(range(len(times)), key=times.__getitem__):
            if q != h:
                chosen = by_group.setdefault(self._group_of[q], [])
                if len(chosen) < per_group:
                    chosen.append(q)
        return [q for qs in by_group.values() for q in qs]

    def _first_step(self, h, members, times, per_group, deadline):
        """The first move (``r`` None) or swap that lowers pipeline ``h`` and keeps its partner below
        it: ``(q, i, r, new time of h, new time of q)``, or None."""
        top = times[h] * (1 - MIN_GAIN)
        lengths = self.lengths
        targets = self._targets(h, times, per_group)
        for i in sorted(members[h], key=lambda i: -lengths[i]):
            l = lengths[i]
            rest = [j for j in members[h] if j != i]
            new_h = None
            for q in targets:
                cost = self.costs[q]
                if l > cost.max_len:
                    continue
                t = cost.seq_time(l)
                q_work = sum(cost.seq_time(lengths[j]) for j in members[q])
                q_tokens = sum(lengths[j] for j in members[q])
                q_max = max([cost.seq_time(lengths[j]) for j in members[q]] + [t])
                if lower_bound(cost, q_work + t, q_tokens + l, q_max, len(members[q]) + 1) < top:
                    new_q = self.time_of(q, members[q] + [i])
                    if new_q < top:
                        if new_h is None:
                            new_h = self.time_of(h, rest)
                        if new_h < top:
                            return q, i, None, new_h, new_q
                for r in members[q]:
                    if lengths[r] >= l or lengths[r] > self.costs[h].max_len:
                        continue
                    q_with = [j for j in members[q] if j != r] + [i]
                    new_q = self.time_of(q, q_with)
                    if new_q >= top:
                        continue
                    new_h2 = self.time_of(h, rest + [r])
                    if new_h2 < top:
                        return q, i, r, new_h2, new_q
                if time.perf_counter() > deadline:
                    return None
        return None

    def search(
        self, deadline: float, start: Optional[list[list[int]]] = None, restarts: Optional[int] = None,
        seed: int = 0,
    ) -> list[list[int]]:
        """Local search from ``start`` (default: the greedy dispatch), then from ``restarts`` greedy
        dispatches in perturbed orders (lengths scaled by a seeded random factor in [0.5, 1.5]); the
        best result wins. By default small batches get up to 64 restarts, large ones few or none
        (``RESTART_WORK // (sequences · pipelines)``), so results do not depend on the machine's speed
        unless ``deadline`` (a safety net) passes first."""
        best = self.improve(start if start is not None else self.greedy(), deadline)
        best_t = max(self.time_of(p, m) for p, m in enumerate(best))
        rng = random.Random(seed)
        n = len(self.lengths)
        if restarts is None:
            restarts = min(MAX_RESTARTS, RESTART_WORK // (n * len(self.costs)))
        for _ in range(restarts):
            if time.perf_counter() >= deadline:
                break
            noise = [rng.uniform(0.5, 1.5) for _ in range(n)]
            order = sorted(range(n), key=lambda i: -self.lengths[i] * noise[i])
            members = self.improve(self.greedy(order), deadline)
            t = max(self.time_of(p, m) for p, m in enumerate(members))
            if t < best_t:
                best, best_t = members, t
        return best

    def run(self, budget_ms: float = 1000.0) -> tuple[list[Packing], list[float]]:
        """Greedy, local search and restarts: per pipeline its micro-batches (sequence indices) and time."""
        members = self.search(time.perf_counter() + budget_ms / 1e3)
        packs = [self.packed(p, m) for p, m in enumerate(members)]
        return [b for b, _ in packs], [t for _, t in packs]


class PipelineShape(Protocol):
    """What ``default_dispatch`` reads of a pipeline (``hgraph.core.strategy.Pipeline``)."""

    size: int
    pp: int
    vpp: int


def default_dispatch(
    pipelines: Sequence[PipelineShape], lengths: Sequence[int], micro_batch_tokens: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The dispatch without a cost model: longest sequence first to the pipeline with the least tokens
    per rank, then each pipeline's sequences packed by ``first_fit_decreasing`` into micro-batches of
    at most ``micro_batch_tokens`` (a longer sequence gets a micro-batch of its own), at least ``pp``
    of them when there are enough sequences so the pipeline fills. An interleaved pipeline (``vpp >
    1``) gets whole rounds of ``pp`` where micro-batches of several sequences can be split (else its
    schedule leaves the missing ones out, ``hgraph.schedule.lowerings.interleaved_1f1b``)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    load = [0.0] * len(pipelines)
    assigned: list[list[int]] = [[] for _ in pipelines]
    for i in order:
        p = min(range(len(pipelines)), key=lambda j: (load[j] + lengths[i]) / pipelines[j].size)
        assigned[p].append(i)
        load[p] += lengths[i]
    out = []
    for p, seqs in zip(pipelines, assigned):
        budget = micro_batch_tokens
        if p.pp > 1 and len(seqs) >= p.pp:
            total = sum(lengths[i] for i in seqs)
            budget = min(budget, max(max(lengths[i] for i in seqs), math.ceil(total / p.pp)))
        bins = first_fit_decreasing(lengths, seqs, budget)
        if p.vpp > 1:
            bins = whole_rounds(bins, lengths, p.pp)
        out.append(tuple(tuple(b) for b in bins))
    return tuple(out)


def whole_rounds(bins: list[list[int]], lengths: Sequence[int], pp: int) -> list[list[int]]:
    """``bins`` split until their number is a multiple of ``pp``: the fullest micro-batch of several
    sequences is cut in two (longest-first into the lighter half) while any is left."""
    bins = [list(b) for b in bins]
    while len(bins) % pp:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        fullest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        halves: tuple[list[int], list[int]] = ([], [])
        for i in sorted(fullest, key=lambda i: -lengths[i]):
            min(halves, key=lambda h: sum(lengths[j] for j in h)).append(i)
        bins[bins.index(fullest)] = halves[0]
        bins.append(halves[1])
    return bins
