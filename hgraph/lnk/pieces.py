"""Any layout or union as flat *pieces*: which rank holds which box of which partial term.

A piece is ``(rank, box, replica, term)``. A *representation* (one replica index) is a full
description of the value: the value is the sum of its terms, each term tiled by the boxes of its
pieces (several pieces may hold the same box and term: replicas inside a layout).

* ``Layout``: replica 0, term = the rank's coordinates along Partial mesh dims;
* union ``"split"``: the box is shifted by the pipeline's dim-0 offset, term = the inner term;
* union ``"duplicate"``: replica = pipeline index (each pipeline is its own full representation);
* union ``"partial"``: term = ``(pipeline index,) + inner term``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hgraph.errors import LayoutError
from hgraph.core.layout import AnyLayout, Box, Layout, LayoutUnion, box_numel

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Piece:
    rank: int
    box: Box
    replica: int
    term: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return box_numel(self.box) == 0


@functools.lru_cache(maxsize=2048)
def pieces_of(layout: AnyLayout) -> tuple[Piece, ...]:
    """The pieces of ``layout`` in rank order of its layouts (cached: the solver and the per-rank
    rules ask for the same layouts many times)."""
    if isinstance(layout, Layout):
        return tuple(Piece(r, box, 0, layout.term(r)) for r in layout.ranks for box in layout.regions(r))
    if not isinstance(layout, LayoutUnion):
        raise LayoutError(f"expected a Layout or LayoutUnion, got {layout!r}")
    out = []
    for p, (inner, offset) in enumerate(zip(layout.layouts, layout.offsets)):
        for r in inner.ranks:
            for box in inner.regions(r):
                term, replica = inner.term(r), 0
                if layout.hetero == "split":
                    box = ((box[0][0] + offset, box[0][1] + offset),) + box[1:]
                elif layout.hetero == "duplicate":
                    replica = p
                else:
                    term = (p,) + term
                out.append(Piece(r, box, replica, term))
    return tuple(out)


def is_partial(layout: AnyLayout) -> bool:
    """True when some piece holds a partial term (the value is a pending sum)."""
    return any(piece.term for piece in pieces_of(layout))


def local_shards(layout: AnyLayout, value: "torch.Tensor") -> dict[int, "torch.Tensor"]:
    """Cut a global tensor into each rank's local tensor under ``layout``.

    For a Partial layout the value is put in the first term (sorted) of every representation and the
    other terms hold zeros: a valid decomposition, handy for tests and demos.
    """
    if tuple(value.shape) != tuple(layout.shape):
        raise LayoutError(f"value of shape {tuple(value.shape)} does not fit {layout} (shape {layout.shape})")
    pieces = pieces_of(layout)
    first = {}
    for p in pieces:
        first[p.replica] = min(first.get(p.replica, p.term), p.term)
    out = {r: value.new_zeros(layout.local_shape(r)) for r in layout.ranks}
    for p in pieces:
        if p.term == first[p.replica]:
            out[p.rank][layout.local_index(p.rank, p.box)] = value[tuple(slice(a, b) for a, b in p.box)]
    return out


def assemble(layout: AnyLayout, shards: dict[int, "torch.Tensor"]) -> "torch.Tensor":
    """The global value of ``shards`` under ``layout`` (sum of the terms of representation 0)."""
    pieces = [p for p in pieces_of(layout) if p.replica == 0]
    like = shards[pieces[0].rank]
    total = like.new_zeros(layout.shape)
    covered: set[tuple[Box, tuple[int, ...]]] = set()
    for p in pieces:
        if (p.box, p.term) in covered:
            continue
        covered.add((p.box, p.term))
        total[tuple(slice(a, b) for a, b in p.box)] += shards[p.rank][layout.local_index(p.rank, p.box)]
    return total
