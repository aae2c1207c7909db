"""Reshard plans executed on real gloo processes (world sizes 2 and 4), values checked exactly.

A Partial source spreads the value over all of its terms (each a different non-zero part), so a
dropped or doubled contribution shows; destinations are checked by the layout definition alone
(``tests/lnk/lnk_cases.check_destination``)."""

import sys
from pathlib import Path

import pytest
import torch

from hgraph.core.layout import Layout, LayoutUnion, replicated, sharded
from hgraph.lnk import is_partial, solve
from hgraph.runtime.launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lnk"))
from lnk_cases import check_destination  # noqa: E402
from lower_bound import holders  # noqa: E402


def L(shape, ranks, mesh, placements):
    return Layout(shape, ranks, mesh, placements)


TWO = (0, 1)
FOUR = (0, 1, 2, 3)
TP2_1_1 = (sharded((8, 4), (0, 1)), replicated((8, 4), (2,)), replicated((8, 4), (3,)))

CASES = {
    2: [
        (sharded((5, 3), TWO), replicated((5, 3), TWO)),
        (L((5, 3), TWO, (2,), ("P",)), sharded((5, 3), TWO)),
        (L((5, 3), TWO, (2,), ("P",)), replicated((5, 3), TWO)),
        (sharded((5, 3), TWO, 0), sharded((5, 3), TWO, 1)),
        (replicated((5, 3), TWO), sharded((5, 3), TWO, 1)),
        (sharded((5, 3), (0,)), sharded((5, 3), (1, 0), 1)),
        (L((5, 3), TWO, (2,), ("P",)), L((5, 3), (1,), (1,), ("P",))),
    ],
    4: [
        (sharded((8, 3), FOUR), replicated((8, 3), FOUR)),
        (L((8, 3), FOUR, (4,), ("P",)), sharded((8, 3), FOUR)),
        (sharded((8, 3), (3, 2, 1, 0)), replicated((8, 3), FOUR)),
        (sharded((7, 5), FOUR), replicated((7, 5), FOUR)),
        (L((5, 6), FOUR, (4,), ("P",)), sharded((5, 6), FOUR)),
        (L((5, 6), FOUR, (4,), ("P",)), replicated((5, 6), FOUR)),
        (sharded((7, 6), FOUR, 0), sharded((7, 6), FOUR, 1)),
        (replicated((7, 6), FOUR), sharded((7, 6), FOUR, 1)),
        (L((6, 6), FOUR, (2, 2), ("S(0)", "S(1)")), L((6, 6), FOUR, (2, 2), ("R", "S(1)"))),
        (L((6, 6), FOUR, (2, 2), ("P", "S(1)")), L((6, 6), FOUR, (2, 2), ("S(0)", "S(1)"))),
        (sharded((8, 8), TWO), sharded((8, 8), FOUR)),
        (sharded((8, 8), FOUR), sharded((8, 8), TWO, 1)),
        (L((6, 4), (0, 1, 2), (3,), ("P",)), sharded((6, 4), (1, 3))),
        (sharded((8, 8), TWO), replicated((8, 8), (2, 3))),
        (LayoutUnion(TP2_1_1, "duplicate"), sharded((8, 4), FOUR)),
        (sharded((8, 4), FOUR), LayoutUnion(TP2_1_1, "duplicate")),
        (LayoutUnion(TP2_1_1, "partial"), sharded((8, 4), FOUR)),
        (
            LayoutUnion((sharded((3, 4), TWO), replicated((5, 4), (2, 3))), "split"),
            sharded((8, 4), (3, 2, 1, 0), 1),
        ),
    ],
}


def _value(shape):
    return torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape) - 7


def spread_shards(layout, value):
    """Each rank's local tensor when the value is split over every term of every representation:
    every term but the last a random non-zero integer tensor, the last the remainder."""
    entries = holders(layout)
    parts: dict = {}
    for rep in sorted({e[2] for e in entries}):
        terms = sorted({e[3] for e in entries if e[2] == rep})
        gen = torch.Generator().manual_seed(rep)
        noise = [torch.randint(1, 9, value.shape, generator=gen).double() * (i + 1) for i in range(len(terms))]
        split = noise[:-1] + [value - sum(noise[:-1], torch.zeros_like(value))] if len(terms) > 1 else [value]
        parts.update({(rep, t): v for t, v in zip(terms, split)})
    return {r: parts[rep, t][tuple(slice(a, b) for a, b in box)].clone() for r, box, rep, t in entries}


def _run_cases(world_size):
    """On every rank: execute each case with the torch.distributed communicator."""
    import torch.distributed as dist

    from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm
    from hgraph.runtime.kernels.reshard import execute

    rank, comm = dist.get_rank(), ProcessGroupComm()
    out = []
    for src, dst in CASES[world_size]:
        plan = solve(src, dst, itemsize=8)
        shards = spread_shards(src, _value(src.shape))
        out.append(execute(plan, shards.get(rank), comm, dtype=torch.float64))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_plans_on_gloo(world_size):
    per_rank = launch(_run_cases, world_size, args=(world_size,), timeout=120)
    for i, (src, dst) in enumerate(CASES[world_size]):
        got = {r: per_rank[r][i] for r in dst.ranks}
        check_destination(dst, _value(src.shape), got, is_partial(dst))
        for r in set(range(world_size)) - set(dst.ranks):
            assert per_rank[r][i] is None
