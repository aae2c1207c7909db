"""Strategy proposal: the candidate heterogeneous strategies for a dataset's length distribution.

The dynamic program of DESIGN.md A6 runs over (GPUs n, length bucket j): ``t[n][j]`` is the best
predicted time for all sequences in buckets ``<= j`` on exactly ``n`` GPUs, and a transition gives the
length band of buckets ``i+1..j`` to ``d`` replicas of one scheme ``k`` (``MaxLen_k`` >= the band's
longest sequence)::

    t[n][j] = min over i < j, k, d of  max(t[n - d*g_k][i], band_time_k(i+1..j, d))

Two changes to the reference make the candidates cover what decides an iteration's time:

* ``band_time`` is the 1F1B time of one replica, not the band's cost divided by ``d``: the replica
  holding the band's longest sequence does at least that sequence's work, micro-batch overhead ``c``
  is paid per micro-batch (the count chosen to minimise ``(w/v + c)(pp - 1 + v)`` within MaxLen) and
  the pipeline bubble is not shared between replicas. A tp4 pipeline holding one 28K-token sequence
  is no longer predicted to finish in a quarter of that sequence's time.
* Besides the optimum for every length bound, the candidates contain, for every scheme that holds the
  longest sequences and a few replica counts, the best strategy that dedicates those replicas to the
  long tail (the rest filled optimally), and every homogeneous strategy of the world, so choosing per
  iteration can never do worse than a fixed homogeneous strategy.
* The distribution's expected batch hides how batches differ: one iteration may draw six 32K
  sequences where the average holds two. When ``lengths`` is a sample of several iterations'
  worth of tokens, the optimum of ``scenarios`` batches drawn from it (``batches.make_batches``,
  seeded) joins the candidates too.
* With context parallelism (cp > 1 schemes next to cp = 1 ones) the proposal for the cp = 1 schemes
  alone joins as well (origin ``"cp1:..."``), so enabling cp never removes a candidate.

Cost: buckets (geometric, ratio ``BUCKET_RATIO``, plus every MaxLen as a boundary) keep ``j`` small;
GPUs are counted in units of ``q`` GPUs with ``gpus / q <= MAX_UNITS``; the DP is vectorised over
``n`` and ``i`` with numpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hgraph.errors import PlanError
from hgraph.core.strategy import Pipeline, Strategy
from hgraph.planner.batches import make_batches
from hgraph.planner.context import with_context_parallel
from hgraph.planner.cost import CostModel, Scheme

BUCKET_RATIO = 1.25
MIN_BUCKET = 128
MAX_UNITS = 64
TAIL_REPLICAS = (1, 2, 3, 4)
TIE_WEIGHT = 0.1
SCENARIOS = 4
SCENARIO_SEED = 12345

Lengths = Sequence[int] | Mapping[int, float] | np.ndarray


@dataclass(frozen=True)
class Candidate:
    """A proposed strategy and why: its DP-predicted time for the sequences of length <= ``covers``.

    ``origin`` is ``"dp"`` (the optimum for that length bound), ``"tail:<scheme>x<d>"`` (``d``
    replicas of a scheme dedicated to the longest sequences), ``"homogeneous"`` (one scheme on every
    GPU, however it was found) or ``"batch<k>"`` (the optimum of the k-th drawn batch; its predicted
    time is for that batch).
    """

    strategy: Strategy
    predicted_ms: float
    covers: int
    origin: str

    def __str__(self) -> str:
        return f"{self.strategy}  ~{self.predicted_ms:.1f} ms for lengths <= {self.covers}  [{self.origin}]"


_Layout = tuple[tuple[Scheme, int], ...]


class _Found(NamedTuple):
    layout: _Layout
    predicted_ms: float
    covers: int
    origin: str


@dataclass(frozen=True)
class _Buckets:
    upper: np.ndarray  # upper length bound of each bucket
    longest: np.ndarray  # longest sequence in each bucket
    # prefix sums over buckets, index 0 = empty prefix
    count: np.ndarray
    tokens: np.ndarray
    squares: np.ndarray


def propose(
    cost_model: CostModel,
    gpus: int,
    lengths: Lengths,
    max_len: int | None = None,
    tokens_per_iteration: float | None = None,
    max_candidates: int = 24,
    scenarios: int = SCENARIOS,
) -> list[Strategy]:
    """Candidate strategies for ``gpus`` GPUs and a length sample or histogram ``{length: count}``.

    ``lengths`` should describe one iteration's batch; give ``tokens_per_iteration`` to rescale a
    larger sample to one iteration. Lengths above ``max_len`` are truncated to it. The result holds
    every homogeneous strategy plus at most ``max_candidates`` heterogeneous ones, plus the optimum of
    each of ``scenarios`` batches drawn from a sample (module docstring), deduplicated.
    """
    return [
        c.strategy
        for c in propose_candidates(
            cost_model, gpus, lengths, max_len, tokens_per_iteration, max_candidates, scenarios
        )
    ]


def propose_candidates(
    cost_model: CostModel,
    gpus: int,
    lengths: Lengths,
    max_len: int | None = None,
    tokens_per_iteration: float | None = None,
    max_candidates: int = 24,
    scenarios: int = SCENARIOS,
) -> list[Candidate]:
    """Like ``propose`` but with each candidate's predicted time and origin, best first."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"gpus={gpus!r}; the planner needs a positive number of GPUs")
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 0:
        raise PlanError(f"max_candidates={max_candidates!r}; it must be an integer >= 0")
    model = cost_model.with_world_size(gpus)
    schemes = [s for s in model.schemes if s.gpus <= gpus and model.max_len(s) >= MIN_BUCKET]
    if not schemes:
        raise PlanError(f"no scheme of cost model {model.name!r} fits on {gpus} GPUs with a usable MaxLen")
    caps = {s: model.max_len(s) for s in schemes}
    values, counts = _histogram(lengths, max_len, tokens_per_iteration)
    if values[-1] > max(caps.values()):
        raise PlanError(
            f"sequence length {int(values[-1])} exceeds the largest MaxLen {max(caps.values())} "
            f"({max(caps, key=caps.__getitem__)}) on {gpus} GPUs; pass max_len to truncate"
        )
    buckets = _bucketize(values, counts, sorted(set(caps.values())))
    dp = _Program(model, schemes, caps, gpus, buckets)
    dp.run()

    # Proposals are keyed by their multiset of pipelines; Strategy objects (rank placement, slow
    # for 1024 GPUs) are built only for the ones kept.
    found: dict[_Layout, _Found] = {}

    def add(groups: list[tuple[Scheme, int]], predicted: float, j: int, origin: str) -> None:
        layout = _layout(groups)
        covers = int(buckets.longest[j - 1])
        old = found.get(layout)
        if old is None or (old.covers, -old.predicted_ms) < (covers, -predicted):
            found[layout] = _Found(layout, predicted, covers, origin)

    nb = len(buckets.upper)
    for j in range(1, nb + 1):
        if np.isfinite(dp.slowest[dp.units, j]):
            add(dp.trace(dp.units, j), float(dp.slowest[dp.units, j]), j, "dp")
    for k, scheme in enumerate(schemes):
        if caps[scheme] < buckets.longest[-1]:
            continue
        for d in TAIL_REPLICAS:
            tail = dp.best_tail(k, d)
            if tail is not None:
                predicted, groups = tail
                add(groups, predicted, nb, f"tail:{scheme}x{d}")
    # Drop proposals another one beats on both coverage and predicted time; then those that hold
    # every length come first (fastest first), then those for shorter bounds.
    ranked = sorted(_pareto(found.values()), key=lambda f: (-f.covers, f.predicted_ms))[:max_candidates]
    kept = {f.layout: f for f in ranked}
    for k, scheme in enumerate(schemes):
        if gpus % scheme.gpus == 0:
            layout = _layout([(scheme, gpus // scheme.gpus)])
            if layout in kept:
                kept[layout] = kept[layout]._replace(origin="homogeneous")
            else:
                # it covers the buckets up to its MaxLen (possibly none: then it has no prediction)
                j = int(np.searchsorted(buckets.longest, caps[scheme], side="right"))
                predicted = dp.evaluate(k, gpus // scheme.gpus, j) if j else math.inf
                covers = int(buckets.longest[j - 1]) if j else 0
                kept[layout] = _Found(layout, predicted, covers, "homogeneous")
    for k, batch in enumerate(_scenario_batches(lengths, max_len, tokens_per_iteration, scenarios)):
        values, counts = _histogram(batch, max_len, None)
        if values[-1] > max(caps.values()):
            continue
        drawn = _bucketize(values, counts, sorted(set(caps.values())))
        program = _Program(model, schemes, caps, gpus, drawn)
        program.run()
        nb = len(drawn.upper)
        if np.isfinite(program.slowest[program.units, nb]):
            layout = _layout(program.trace(program.units, nb))
            if layout not in kept:
                predicted = float(program.slowest[program.units, nb])
                kept[layout] = _Found(layout, predicted, int(drawn.longest[-1]), f"batch{k}")
    if any(s.cp > 1 for s in schemes) and any(s.cp == 1 for s in schemes):
        # context parallelism widens the choice, it must not narrow it: the proposal without cp joins
        plain = with_context_parallel(cost_model, (1,))
        for c in propose_candidates(plain, gpus, lengths, max_len, tokens_per_iteration, max_candidates, scenarios):
            layout = _layout([(Scheme.of(p), 1) for p in c.strategy.pipelines])
            if layout not in kept:
                kept[layout] = _Found(layout, c.predicted_ms, c.covers, f"cp1:{c.origin}")
    result = [
        Candidate(_strategy(f.layout, model.gpus_per_node), f.predicted_ms, f.covers, f.origin)
        for f in kept.values()
    ]
    return sorted(result, key=lambda c: (-c.covers, c.predicted_ms))


def _scenario_batches(
    lengths: Lengths, max_len: int | None, tokens_per_iteration: float | None, scenarios: int
) -> list[list[int]]:
    """``scenarios`` seeded batches of a sample holding at least two iterations' tokens, else none."""
    if isinstance(scenarios, bool) or not isinstance(scenarios, int) or scenarios < 0:
        raise PlanError(f"scenarios={scenarios!r}; it must be an integer >= 0")
    if not scenarios or tokens_per_iteration is None or isinstance(lengths, Mapping):
        return []
    sample = [int(l) for l in np.asarray(lengths).ravel()]
    tokens = int(math.ceil(tokens_per_iteration))
    if sum(sample) < 2 * tokens:
        return []
    return make_batches(sample, tokens, int(max_len or max(sample)), scenarios, seed=SCENARIO_SEED)


def _pareto(proposals: Iterable[_Found]) -> list[_Found]:
    """Proposals not strictly beaten: no other covers as much and is predicted faster."""
    kept: list[_Found] = []
    best_so_far = math.inf
    for f in sorted(proposals, key=lambda f: (-f.covers, f.predicted_ms)):
        if f.predicted_ms <= best_so_far:
            kept.append(f)
            best_so_far = f.predicted_ms
    return kept


def _histogram(
    lengths: Lengths, max_len: int | None, tokens_per_iteration: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct lengths and their (possibly fractional) counts, truncated and rescaled."""
    if isinstance(lengths, Mapping):
        values = np.array(list(lengths.keys()), dtype=np.float64)
        counts = np.array(list(lengths.values()), dtype=np.float64)
        order = np.argsort(values)
        values, counts = values[order], counts[order]
    else:
        values, raw = np.unique(np.asarray(lengths, dtype=np.float64), return_counts=True)
        counts = raw.astype(np.float64)
    if values.size == 0 or counts.sum() <= 0:
        raise PlanError("empty length sample; the proposal needs at least one sequence length")
    bad = values[(values < 1) | (values != np.round(values))]
    if bad.size:
        raise PlanError(f"sequence lengths must be positive integers, got {bad[:3].tolist()}")
    if np.any(counts < 0):
        raise PlanError("histogram counts must be >= 0")
    if max_len is not None:
        if max_len < 1:
            raise PlanError(f"max_len={max_len!r}; it must be a positive token count")
        values = np.minimum(values, max_len)
        values, inverse = np.unique(values, return_inverse=True)
        counts = np.bincount(inverse, weights=counts).astype(np.float64)
    if tokens_per_iteration is not None:
        if tokens_per_iteration <= 0:
            raise PlanError(f"tokens_per_iteration={tokens_per_iteration!r}; it must be positive")
        counts = counts * (tokens_per_iteration / float(np.dot(values, counts)))
    keep = counts > 0
    return values[keep], counts[keep]


def _bucketize(values: np.ndarray, counts: np.ndarray, caps: Sequence[int]) -> _Buckets:
    """Group lengths into geometric buckets whose bounds also include every MaxLen."""
    top = float(values[-1])
    bounds = {float(MIN_BUCKET)}
    b = float(MIN_BUCKET)
    while b < top:
        b = math.ceil(b * BUCKET_RATIO / 64) * 64
        bounds.add(float(b))
    bounds.update(float(c) for c in caps if c < top)
    upper = np.array(sorted(x for x in bounds if x < top) + [top])
    index = np.searchsorted(upper, values, side="left")
    present = np.unique(index)
    longest = np.zeros(len(upper))
    np.maximum.at(longest, index, values)
    cnt = np.bincount(index, weights=counts, minlength=len(upper))
    tok = np.bincount(index, weights=counts * values, minlength=len(upper))
    sq = np.bincount(index, weights=counts * values * values, minlength=len(upper))

    def prefix(x: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(x[present])])

    return _Buckets(upper[present], longest[present], prefix(cnt), prefix(tok), prefix(sq))


class _Program:
    """The DP tables (GPU units x buckets) with the choices needed to trace strategies back.

    Each state keeps the slowest group's time ``M`` (the objective of A6) and the GPU-time of all
    groups ``S``; states are compared by ``M + TIE_WEIGHT * S / gpus``, so among strategies with
    the same slowest group (often the one holding the longest sequence) the DP keeps the one whose
    other GPUs carry the least load instead of an arbitrary one.
    """

    def __init__(
        self,
        model: CostModel,
        schemes: list[Scheme],
        caps: Mapping[Scheme, int],
        gpus: int,
        buckets: _Buckets,
    ) -> None:
        self.model, self.schemes, self.caps, self.buckets = model, schemes, caps, buckets
        unit = math.gcd(*(s.gpus for s in schemes), gpus)
        while gpus // unit > MAX_UNITS and gpus % (2 * unit) == 0:
            unit *= 2
        self.unit = unit
        self.units = gpus // unit
        # replicas of scheme k are added in steps whose GPU count is a whole number of units
        self.step = [unit // math.gcd(unit, s.gpus) for s in schemes]
        nb = len(buckets.upper)
        self.slowest = np.full((self.units + 1, nb + 1), np.inf)
        self.load = np.full((self.units + 1, nb + 1), np.inf)  # sum of time x units over groups
        self.slowest[0, 0] = self.load[0, 0] = 0.0
        self.choice = np.full((self.units + 1, nb + 1, 3), -1, dtype=np.int64)  # (i, k, d)

    def key(self, slowest: np.ndarray, load: np.ndarray) -> np.ndarray:
        return slowest + TIE_WEIGHT * load / self.units

    def band_time(self, k: int, i: np.ndarray, j: int, d: np.ndarray) -> np.ndarray:
        """Predicted 1F1B time of one of ``d`` replicas of scheme k sharing buckets ``i+1..j``.

        Broadcasts over ``i`` (column) and ``d`` (row). Infinite where a sequence exceeds MaxLen.
        """
        scheme = self.schemes[k]
        bk = self.buckets
        if bk.longest[j - 1] > self.caps[scheme]:
            return np.full(np.broadcast(i, d).shape, np.inf)
        cost = self.model.stage_cost(scheme)
        count = bk.count[j] - bk.count[i]
        tokens = bk.tokens[j] - bk.tokens[i]
        work = cost.a * (bk.squares[j] - bk.squares[i]) + cost.b * tokens
        longest = bk.longest[j - 1]
        longest_work = cost.seq_time(longest)
        w = np.maximum(work / d, longest_work)  # the replica holding the longest sequence
        v_min = np.maximum(1.0, np.ceil(tokens / d / self.caps[scheme]))
        v_max = np.maximum(v_min, np.ceil(count / d))
        pp = scheme.pp
        if pp == 1 or cost.c == 0:
            v = v_min
        else:
            v = np.clip(np.round(np.sqrt(w * (pp - 1) / cost.c)), v_min, v_max)
        micro = np.maximum(w / v, longest_work) + cost.c
        return w + v * cost.c + (pp - 1) * micro

    def run(self) -> None:
        nb = len(self.buckets.upper)
        n = np.arange(self.units + 1)
        for j in range(1, nb + 1):
            i = np.arange(j)
            for k, scheme in enumerate(self.schemes):
                if self.buckets.longest[j - 1] > self.caps[scheme]:
                    continue
                per = self.step[k] * scheme.gpus // self.unit  # units per replica step
                steps = np.arange(1, self.units // per + 1)
                if steps.size == 0:
                    continue
                d, u = steps * self.step[k], steps * per
                times = self.band_time(k, i[None, :], j, d[:, None])  # (step, i)
                # from state (n - u, i) give buckets i+1..j to d replicas: all steps, n and i at once
                source = n[None, :] - u[:, None]  # (step, n)
                valid = source >= 0
                source = np.maximum(source, 0)
                slowest = np.maximum(self.slowest[source, :j], times[:, None, :])  # (step, n, i)
                load = self.load[source, :j] + (times * u[:, None])[:, None, :]
                key = np.where(valid[:, :, None], self.key(slowest, load), np.inf)
                flat = key.transpose(1, 0, 2).reshape(n.size, -1)  # (n, step * i)
                arg = np.argmin(flat, axis=1)
                better = flat[n, arg] < self.key(self.slowest[:, j], self.load[:, j])
                if np.any(better):
                    rows = n[better]
                    step_index, start = np.divmod(arg[better], j)
                    self.slowest[rows, j] = slowest[step_index, rows, start]
                    self.load[rows, j] = load[step_index, rows, start]
                    self.choice[rows, j] = np.stack([start, np.full(rows.size, k), d[step_index]], axis=1)

    def trace(self, n: int, j: int) -> list[tuple[Scheme, int]]:
        """The (scheme, replicas) groups of the optimum at ``(n, j)``."""
        groups = []
        while j > 0:
            i, k, d = (int(x) for x in self.choice[n, j])
            groups.append((self.schemes[k], d))
            n -= d * self.schemes[k].gpus // self.unit
            j = i
        assert n == 0, "DP traceback must use every GPU unit"
        return groups

    def best_tail(self, k: int, d: int) -> tuple[float, list[tuple[Scheme, int]]] | None:
        """Best strategy giving the longest band to exactly ``d`` replicas of scheme ``k``."""
        scheme = self.schemes[k]
        if (d * scheme.gpus) % self.unit or d * scheme.gpus > self.units * self.unit:
            return None
        u = d * scheme.gpus // self.unit
        nb = len(self.buckets.upper)
        rest = self.units - u
        times = self.band_time(k, np.arange(nb), nb, np.array(d, dtype=np.float64))
        slowest = np.maximum(self.slowest[rest, :nb], times)
        key = self.key(slowest, self.load[rest, :nb] + times * u)
        start = int(np.argmin(key))
        if not np.isfinite(key[start]):
            return None
        return float(slowest[start]), [(scheme, d)] + (self.trace(rest, start) if rest else [])

    def evaluate(self, k: int, d: int, j: int) -> float:
        """Predicted time of ``d`` replicas of scheme ``k`` holding buckets ``1..j`` together."""
        return float(self.band_time(k, np.array(0), j, np.array(d, dtype=np.float64)))


def _layout(groups: list[tuple[Scheme, int]]) -> _Layout:
    """Canonical multiset of pipelines: (scheme, count) pairs, largest stage mesh (tp·cp) first, then
    largest TP: with power-of-two meshes every stage then starts at a multiple of its size (node-aligned)."""
    counts: dict[Scheme, int] = {}
    for scheme, d in groups:
        counts[scheme] = counts.get(scheme, 0) + d
    return tuple(sorted(counts.items(), key=lambda sc: (-sc[0].tp * sc[0].cp, -sc[0].tp, -sc[0].gpus, -sc[0].pp)))


def _strategy(layout: _Layout, gpus_per_node: int) -> Strategy:
    """A Strategy of the layout's pipelines on consecutive ranks, in layout order.

    This is the placement ``Strategy`` itself gives pipelines without ranks (TP groups inside a
    node), written out directly because that generic search is slow for a thousand GPUs.
    """
    pipelines, start = [], 0
    for s, d in layout:
        for _ in range(d):
            pipelines.append(Pipeline(tp=s.tp, pp=s.pp, cp=s.cp, ep=s.ep, ranks=tuple(range(start, start + s.gpus))))
            start += s.gpus
    return Strategy(tuple(pipelines), gpus_per_node=gpus_per_node)
