"""Collective plans for a change of one mesh dim between two layouts on the same ranks and mesh.

Transitions along mesh dim ``m`` (every other mesh dim unchanged), run on the groups of ranks that
differ only in their ``m`` coordinate:

* ``S(d) -> R``     all_gather: every member receives the chunks it lacks;
* ``P -> S(d)``     reduce_scatter: member ``i`` gets the sum of chunk ``i``;
* ``P -> R``        all_reduce;
* ``S(i) -> S(j)``  all_to_all: member ``a`` sends ``src_box(a) & dst_box(b)`` to member ``b``.

(``R -> S(d)`` needs no communication: the point-to-point plan is local copies.) The same algebra,
by mesh dim rather than by rank, plans the program every rank of a stage runs: ``hgraph.lnk.transform``.
Here the geometry is checked on the actual boxes (several mesh dims may cut the same tensor dim, and the torch.chunk rule
leaves uneven and empty chunks), and so are the partial terms: a member's destination term must be
the sum of a set of source terms that no other destination term takes. The solver keeps a
collective plan only when it moves exactly the lower-bound bytes (e.g. not a reduce_scatter whose result is also replicated elsewhere).
"""

from __future__ import annotations

from typing import Optional

from hgraph.core.layout import AnyLayout, Box, Layout, unravel
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.lnk.plan import AllGather, AllReduce, AllToAll, ReduceScatter, Step


def collective_steps(src: AnyLayout, dst: AnyLayout) -> Optional[tuple[Step, ...]]:
    """One collective per group along the changed mesh dim, or ``None`` when none applies."""
    if not (isinstance(src, Layout) and isinstance(dst, Layout)):
        return None
    if src.interleaved_dim is not None or dst.interleaved_dim is not None:
        return None  # several boxes per rank: point-to-point only
    if src.ranks != dst.ranks or src.mesh != dst.mesh:
        return None
    changed = [m for m, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b]
    if len(changed) != 1:
        return None
    m = changed[0]
    a, b = src.placements[m], dst.placements[m]
    steps = []
    reduces = isinstance(a, Partial) and _terms_reduce(src, dst, m)
    for group in _groups(src, m):
        s = [src.region(r) for r in group]
        t = [dst.region(r) for r in group]
        step: Optional[Step] = None
        if isinstance(a, Shard) and isinstance(b, Replicate) and _same_terms(src, dst, group):
            if all(box == t[0] for box in t) and _tiles(s, t[0], a.dim):
                step = AllGather(group, a.dim, t[0], tuple(box[a.dim] for box in s))
        elif reduces:
            if isinstance(b, Shard) and all(box == s[0] for box in s) and _tiles(t, s[0], b.dim):
                step = ReduceScatter(group, b.dim, s[0], tuple(box[b.dim] for box in t))
            elif isinstance(b, Replicate) and all(box == s[0] for box in s + t):
                step = AllReduce(group, s[0])
        elif isinstance(a, Shard) and isinstance(b, Shard) and _same_terms(src, dst, group):
            whole = _hull(s)
            if _tiles(s, whole, a.dim) and _tiles(t, whole, b.dim):
                boxes = tuple(tuple(_clip(x, y) for y in t) for x in s)
                step = AllToAll(group, a.dim, b.dim, boxes)
        if step is None:
            return None
        steps.append(step)
    return tuple(steps)


def _groups(layout: Layout, m: int) -> list[tuple[int, ...]]:
    """Ranks that differ only in mesh coordinate ``m``, each group sorted ascending."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, rank in enumerate(layout.ranks):
        coords = unravel(i, layout.mesh)
        groups.setdefault(coords[:m] + coords[m + 1 :], []).append(rank)
    return [tuple(sorted(g)) for _, g in sorted(groups.items())]


def _tiles(boxes: list[Box], whole: Box, dim: int) -> bool:
    """``boxes`` agree with ``whole`` off ``dim`` and cut ``whole[dim]`` into disjoint consecutive chunks."""
    if any(box[:dim] + box[dim + 1 :] != whole[:dim] + whole[dim + 1 :] for box in boxes):
        return False
    position = whole[dim][0]
    for lo, hi in sorted((box[dim] for box in boxes), key=lambda c: (c[0], c[1])):
        if lo == hi:
            continue
        if lo != position:
            return False
        position = hi
    return position == whole[dim][1]


def _hull(boxes: list[Box]) -> Box:
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def _clip(a: Box, b: Box) -> Box:
    """Intersection of two boxes, as an empty box (same start and stop) where they do not meet."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo = max(a0, b0)
        out.append((lo, max(lo, min(a1, b1))))
    return tuple(out)


def _same_terms(src: Layout, dst: Layout, group: tuple[int, ...]) -> bool:
    """Every member keeps its partial term (src and dst Partial on the same mesh dims)."""
    return src.num_terms == dst.num_terms and all(src.term(r) == dst.term(r) for r in group)


def _terms_reduce(src: Layout, dst: Layout, m: int) -> bool:
    """Reducing each group along mesh dim ``m`` gives a valid destination: every rank holding one
    destination term (in any group) sums the same source terms, and no source term feeds two."""
    owner: dict[tuple[int, ...], frozenset] = {}
    for group in _groups(src, m):
        terms = frozenset(src.term(r) for r in group)
        if any(owner.setdefault(dst.term(r), terms) != terms for r in group):
            return False
    return sum(map(len, owner.values())) == len(frozenset().union(*owner.values()))
