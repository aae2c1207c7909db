"""Random layouts and unions for LNK property tests, and an oracle of the results from the layouts'
definition alone (``check_destination``).

Source shards come from a random decomposition of a random integer-valued float64 tensor ``X`` into
partial terms, so sums are exact and a dropped or doubled term shows.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from hgraph.core.layout import Layout, LayoutUnion
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.lnk import is_partial
from lower_bound import holders

MAX_RANKS = 16


@st.composite
def meshes(draw, max_ranks: int) -> tuple[int, ...]:
    ndims = draw(st.integers(1, 3))
    mesh: list[int] = []
    for _ in range(ndims):
        room = max_ranks // math.prod(mesh or [1])
        mesh.append(draw(st.integers(1, max(1, min(4, room)))))
    return tuple(mesh)


@st.composite
def layouts(draw, shape, pool: list[int], partial: bool) -> Layout:
    """A layout on ranks drawn (and removed) from ``pool``."""
    mesh = draw(meshes(len(pool)))
    n = math.prod(mesh)
    ranks = draw(st.permutations(pool))[:n]
    for r in ranks:
        pool.remove(r)
    options = [Replicate()] + [Shard(d) for d in range(len(shape))] + ([Partial()] if partial else [])
    placements = tuple(draw(st.sampled_from(options)) for _ in mesh)
    return Layout(shape, tuple(ranks), mesh, placements)


@st.composite
def any_layouts(draw, shape, pool: list[int], partial: bool):
    """A Layout or a LayoutUnion of 2-3 pipelines of ``shape``."""
    if len(pool) < 2 or not draw(st.booleans()):
        return draw(layouts(shape, pool, partial))
    hetero = draw(st.sampled_from(["split", "duplicate", "partial"] if partial else ["split", "duplicate"]))
    count = draw(st.integers(2, min(3, len(pool))))
    parts = []
    if hetero == "split":
        cuts = sorted(draw(st.lists(st.integers(0, shape[0]), min_size=count - 1, max_size=count - 1)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [shape[0]])]
    else:
        sizes = [shape[0]] * count
    for i, size in enumerate(sizes):
        sub_pool_size = len(pool) - (count - 1 - i)
        sub_pool = pool[:sub_pool_size]
        lay = draw(layouts((size,) + tuple(shape[1:]), sub_pool, partial))
        for r in lay.ranks:
            pool.remove(r)
        parts.append(lay)
    return LayoutUnion(tuple(parts), hetero)


@st.composite
def transitions(draw, max_ranks: int = MAX_RANKS):
    """``(src, dst)`` with the same shape; dst is Partial only when src is."""
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    src = draw(any_layouts(shape, list(range(max_ranks)), True))
    dst = draw(any_layouts(shape, list(range(max_ranks)), is_partial(src) and draw(st.booleans())))
    return src, dst


# ----------------------------------------------------------------------------- values
def _layout_terms(layout: Layout) -> list[tuple[int, ...]]:
    return sorted({layout.term(r) for r in layout.ranks})


def _split_terms(value: torch.Tensor, count: int, gen: torch.Generator) -> list[torch.Tensor]:
    parts = [torch.randint(-5, 6, value.shape, generator=gen).double() for _ in range(count - 1)]
    return parts + [value - sum(parts, torch.zeros_like(value))]


def source_shards(src, value: torch.Tensor, gen: torch.Generator) -> dict[int, torch.Tensor]:
    """Every source rank's local tensor: ``value`` split into random integer terms."""
    shards: dict[int, torch.Tensor] = {}

    def place(layout: Layout, part: torch.Tensor) -> None:
        terms = _layout_terms(layout)
        values = dict(zip(terms, _split_terms(part, len(terms), gen)))
        for r in layout.ranks:
            shards[r] = values[layout.term(r)][layout.local_slices(r)].clone()

    if isinstance(src, Layout):
        place(src, value)
    elif src.hetero == "split":
        for lay, off in zip(src.layouts, src.offsets):
            place(lay, value[off : off + lay.shape[0]])
    elif src.hetero == "duplicate":
        for lay in src.layouts:
            place(lay, value)
    else:
        for lay, part in zip(src.layouts, _split_terms(value, len(src.layouts), gen)):
            place(lay, part)
    return shards


def check_destination(dst, value: torch.Tensor, got: dict[int, torch.Tensor], dst_partial: bool) -> None:
    """What a destination must satisfy, by the definition of a layout alone: a non-Partial rank holds
    ``value`` on its box; for a Partial one, ranks holding the same term agree where their boxes meet
    and, in every representation, the terms sum to ``value`` (any split of the sum is valid)."""
    entries = holders(dst)
    assert set(got) == {r for r, *_ in entries}
    for rank, box, _, _ in entries:
        assert tuple(got[rank].shape) == tuple(b - a for a, b in box), f"rank {rank} shape"
    if not dst_partial:
        for rank, box, _, _ in entries:
            want = value[tuple(slice(a, b) for a, b in box)]
            assert torch.equal(got[rank], want), f"rank {rank}\ngot {got[rank]}\nwant {want}"
        return
    for rep in {e[2] for e in entries}:
        terms: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for rank, box, r, term in entries:
            if r != rep:
                continue
            zero = (torch.zeros_like(value), torch.zeros(value.shape, dtype=torch.bool))
            total, seen = terms.setdefault(term, zero)
            sl = tuple(slice(a, b) for a, b in box)
            overlap = seen[sl]
            assert torch.equal(total[sl][overlap], got[rank][overlap]), f"rank {rank}: replicas of {term} differ"
            total[sl] = got[rank]
            seen[sl] = True
        got_sum = sum(t for t, _ in terms.values())
        assert torch.equal(got_sum, value), f"representation {rep}: terms sum to\n{got_sum}\nnot\n{value}"


@st.composite
def one_dim_changes(draw, max_ranks: int = MAX_RANKS):
    """``(src, dst)`` on the same ranks and mesh differing in one mesh dim: the collective cases."""
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    src = draw(layouts(shape, list(range(max_ranks)), True))
    m = draw(st.integers(0, len(src.mesh) - 1))
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    if src.is_partial:
        options.append(Partial())
    placements = list(src.placements)
    placements[m] = draw(st.sampled_from(options))
    return src, Layout(shape, src.ranks, src.mesh, tuple(placements))
