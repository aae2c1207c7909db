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

Cost (``hgraph.planner.band_program``): buckets (geometric, ratio ``BUCKET_RATIO``, plus every MaxLen
as a boundary) keep ``j`` small;
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
from hgraph.core.degrees import Degrees
from hgraph.planner.band_program import MIN_BUCKET, BandProgram, bucketize
from hgraph.planner.cost import CostModel

TAIL_REPLICAS = (1, 2, 3, 4)
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


_Layout = tuple[tuple[Degrees, int], ...]


class _Found(NamedTuple):
    layout: _Layout
    predicted_ms: float
    covers: int
    origin: str


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
    schemes = [s for s in model.schemes if s.size <= gpus and model.max_len(s) >= MIN_BUCKET]
    if not schemes:
        raise PlanError(f"no scheme of cost model {model.name!r} fits on {gpus} GPUs with a usable MaxLen")
    caps = {s: model.max_len(s) for s in schemes}
    values, counts = _histogram(lengths, max_len, tokens_per_iteration)
    if values[-1] > max(caps.values()):
        raise PlanError(
            f"sequence length {int(values[-1])} exceeds the largest MaxLen {max(caps.values())} "
            f"({max(caps, key=caps.__getitem__)}) on {gpus} GPUs; pass max_len to truncate"
        )
    buckets = bucketize(values, counts, sorted(set(caps.values())))
    dp = BandProgram(model, schemes, caps, gpus, buckets)
    dp.run()

    # Proposals are keyed by their multiset of pipelines; Strategy objects (rank placement, slow
    # for 1024 GPUs) are built only for the ones kept.
    found: dict[_Layout, _Found] = {}

    def add(groups: list[tuple[Degrees, int]], predicted: float, j: int, origin: str) -> None:
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
        if gpus % scheme.size == 0:
            layout = _layout([(scheme, gpus // scheme.size)])
            if layout in kept:
                kept[layout] = kept[layout]._replace(origin="homogeneous")
            else:
                # it covers the buckets up to its MaxLen (possibly none: then it has no prediction)
                j = int(np.searchsorted(buckets.longest, caps[scheme], side="right"))
                predicted = dp.evaluate(k, gpus // scheme.size, j) if j else math.inf
                covers = int(buckets.longest[j - 1]) if j else 0
                kept[layout] = _Found(layout, predicted, covers, "homogeneous")
    for k, batch in enumerate(_scenario_batches(lengths, max_len, tokens_per_iteration, scenarios)):
        values, counts = _histogram(batch, max_len, None)
        if values[-1] > max(caps.values()):
            continue
        drawn = bucketize(values, counts, sorted(set(caps.values())))
        program = BandProgram(model, schemes, caps, gpus, drawn)
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
            layout = _layout([(p.stage_key, 1) for p in c.strategy.pipelines])
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


def _layout(groups: list[tuple[Degrees, int]]) -> _Layout:
    """Canonical multiset of pipelines: (scheme, count) pairs, largest stage mesh (tp·cp) first, then
    largest TP: with power-of-two meshes every stage then starts at a multiple of its size (node-aligned)."""
    counts: dict[Degrees, int] = {}
    for scheme, d in groups:
        counts[scheme] = counts.get(scheme, 0) + d
    return tuple(sorted(counts.items(), key=lambda sc: (-sc[0].tp * sc[0].cp, -sc[0].tp, -sc[0].size, -sc[0].pp)))


def _strategy(layout: _Layout, gpus_per_node: int) -> Strategy:
    """A Strategy of the layout's pipelines on consecutive ranks, in layout order.

    This is the placement ``Strategy`` itself gives pipelines without ranks (TP groups inside a
    node), written out directly because that generic search is slow for a thousand GPUs.
    """
    pipelines, start = [], 0
    for s, d in layout:
        for _ in range(d):
            pipelines.append(Pipeline(tp=s.tp, pp=s.pp, cp=s.cp, ep=s.ep, ranks=tuple(range(start, start + s.size))))
            start += s.size
    return Strategy(tuple(pipelines), gpus_per_node=gpus_per_node)
