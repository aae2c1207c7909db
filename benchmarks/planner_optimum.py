"""The optimum of one iteration's assignment by exhaustive search, written apart from hgraph.planner.

The problem (DESIGN.md A5/A7), restated here from its definition: pipelines ``(a, b, c, pp, max_len)``
with per-stage micro-batch time ``T(mb) = Σ (a·l² + b·l) + c`` and 1F1B time ``Σ T + (pp − 1)·max T``
(0 for an idle pipeline); put every sequence in exactly one micro-batch of one pipeline, each
micro-batch holding at most ``max_len`` tokens, minimising the slowest pipeline. The search: for each
pipeline and each subset of sequences, the best split of the subset into micro-batches (every set
partition); then the best assignment of sequences to pipelines (every one). Exponential: meant for
up to ~8 sequences. Nothing from ``hgraph`` is imported.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Iterator, Sequence

Pipeline = tuple[float, float, float, int, int]  # a, b, c, pp, max_len


def set_partitions(items: tuple[int, ...]) -> Iterator[list[tuple[int, ...]]]:
    """Every way to split ``items`` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [(first,)] + partition
        for i in range(len(partition)):
            yield partition[:i] + [(first,) + partition[i]] + partition[i + 1 :]


def pipeline_optimum(pipe: Pipeline, lengths: tuple[int, ...]) -> float:
    """Least 1F1B time of one pipeline holding exactly ``lengths`` (inf when one cannot fit)."""
    return _pipeline_optimum(pipe, tuple(sorted(lengths)))


@lru_cache(maxsize=None)
def _pipeline_optimum(pipe: Pipeline, lengths: tuple[int, ...]) -> float:
    a, b, c, pp, max_len = pipe
    if not lengths:
        return 0.0
    best = math.inf
    for blocks in set_partitions(tuple(range(len(lengths)))):
        tokens = [sum(lengths[i] for i in blk) for blk in blocks]
        if max(tokens) > max_len:
            continue
        times = [sum(a * lengths[i] ** 2 + b * lengths[i] for i in blk) + c for blk in blocks]
        best = min(best, sum(times) + (pp - 1) * max(times))
    return best


def optimum(pipelines: Sequence[Pipeline], lengths: Sequence[int]) -> float:
    """Least iteration time (ms) over every assignment; inf when no assignment fits."""
    best = math.inf
    for owner in itertools.product(range(len(pipelines)), repeat=len(lengths)):
        worst = 0.0
        for p, pipe in enumerate(pipelines):
            worst = max(worst, pipeline_optimum(pipe, tuple(l for l, o in zip(lengths, owner) if o == p)))
            if worst >= best:
                break
        best = min(best, worst)
    return best
