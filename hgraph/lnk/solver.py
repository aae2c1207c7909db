"""The LNK solver: plan a layout change with the fewest bytes, then balance who sends them.

Method. Both layouts become pieces (``hgraph.lnk.pieces``). Every tensor dim is cut at every
boundary of every source and destination box, giving a grid of *atoms*; an atom lies wholly inside
or outside each box. For each atom ``a``, destination replica and destination term ``j``, let ``D`` be
the destination ranks that need ``(a, j)`` (for a non-Partial destination: every rank that needs
``a``, in any destination representation, since they all want the same value). The terms that
contribute to ``j``:

* non-Partial destination: every term of one source representation (a replica) sums into it;
* Partial destination (only from a Partial source): any split of the source terms among the
  destination terms is a valid result (terms left without a source are zero), so the solver picks,
  per atom, the representation and split of least cost (``_assign_terms``): rank first, a source term
  stays on the ranks that already hold it, so Partial -> Partial on the same ranks (in any order)
  moves nothing.

With ``k`` contributing terms the atom costs (in atom-sized messages):

* ``k == 0``: zero fill, 0;
* ``k == 1``: every ``d`` in ``D`` not already holding the term's atom receives it once: ``|D \\ H|``
  (for a non-Partial destination ``H`` joins the holders of every representation that has a single
  term there: they all hold the true value);
* ``k >= 2``: a reducer ``rho`` in ``D`` (one holding a contributing term when possible, ``h = 1``)
  receives every other term once and sends the sum to ``D \\ {rho}``: ``(k - 1) + |D| - h``.

Why this is a lower bound (per element, so splitting atoms does not help): with ``k == 1`` each rank
of ``D`` that does not hold the value must receive at least one message carrying it. With ``k >= 2``
think of one-way calls carrying sums: until the first rank knows the full sum, the ``k`` terms (each
rank holds at most one) must be merged, which takes ``k - 1`` calls, or ``k`` when that first rank
holds none of them; every other rank of ``D`` then needs one more call of its own (the one-way gossip
bound ``2n - 2`` is the case ``D`` = holders). The cheapest representation is chosen per atom, and
for a Partial destination the cheapest split of the terms (see ``_assign_terms`` for why it is the
cheapest). What is proven, and checked against an independent bound and a brute-force search in
``tests/lnk/``: no plan that sends source data or partial sums of it moves fewer bytes, except for a
Partial destination with several representations, each of which is served alone here.
``lower_bound_bytes`` is the sum of these costs times the atom bytes, and the point-to-point plan moves
exactly that. Collective plans (``hgraph.lnk.collectives``) are used only when they move the same
bytes.

Balance (same bytes, less on the busiest rank and between nodes): an atom reduced for several ranks
is first cut into ``|D|`` parts along its longest dim, so that different members of ``D`` reduce
different parts (reduce-scatter then all-gather, in effect). Atoms are then handled largest first;
among the ranks that hold what is needed the sender is one on the receiver's node, then the least
loaded (bytes sent + received so far), then the lowest rank. Reducers likewise among the valid
candidates, counting how many of their partners sit on other nodes. Adjacent atoms with the same
sender, receiver and phase are merged into one box per message.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections import defaultdict
from operator import getitem
from typing import Iterator, Optional

from hgraph.errors import LayoutError
from hgraph.core.layout import AnyLayout, Box, Layout, LayoutUnion, box_numel, chunk_bounds
from hgraph.lnk.collectives import collective_steps
from hgraph.lnk.pieces import Piece, is_partial, pieces_of
from hgraph.lnk.plan import LocalCopy, ReshardPlan, Step, Transfer
from hgraph.lnk.topology import DEFAULT_TOPOLOGY, Topology

Cell = tuple[int, ...]


def solve(
    src: AnyLayout, dst: AnyLayout, topology: Optional[Topology] = None, itemsize: int = 4
) -> ReshardPlan:
    """Plan the change from ``src`` to ``dst`` (cached by its arguments)."""
    return _solve(src, dst, topology or DEFAULT_TOPOLOGY, int(itemsize))


@functools.lru_cache(maxsize=4096)
def _solve(src: AnyLayout, dst: AnyLayout, topology: Topology, itemsize: int) -> ReshardPlan:
    validate(src, dst)
    steps, lower_bound = _PointToPoint(src, dst, topology).solve()
    lower_bound *= itemsize
    if _is_noop(src, dst, steps):
        return ReshardPlan(src, dst, itemsize, (), lower_bound, topology, noop=True)
    if box_numel(tuple((0, n) for n in src.shape)):
        collective = collective_steps(src, dst)
        if collective is not None:
            plan = ReshardPlan(src, dst, itemsize, collective, lower_bound, topology)
            if plan.bytes_moved == lower_bound:
                return plan
    return ReshardPlan(src, dst, itemsize, steps, lower_bound, topology)


def validate(src: AnyLayout, dst: AnyLayout) -> None:
    for name, value in (("src", src), ("dst", dst)):
        if not isinstance(value, (Layout, LayoutUnion)):
            raise LayoutError(f"{name} must be a Layout or LayoutUnion, got {value!r}")
    if src.shape != dst.shape:
        raise LayoutError(
            f"src {src} has shape {src.shape} but dst {dst} has shape {dst.shape}; they must match"
        )
    if is_partial(dst) and not is_partial(src):
        raise LayoutError(
            f"dst {dst} is Partial but src {src} is not; a Partial destination needs a Partial source"
        )


def _is_noop(src: AnyLayout, dst: AnyLayout, steps: tuple[Step, ...]) -> bool:
    """Every destination rank already holds exactly its output (only whole-region copies)."""
    copies: dict[int, set[Box]] = defaultdict(set)
    for step in steps:
        if not isinstance(step, LocalCopy) or step.accumulate:
            return False
        copies[step.rank].add(step.box)
    for rank in dst.ranks:
        if rank not in src.ranks or src.regions(rank) != dst.regions(rank):
            return False
        if copies.get(rank, set()) != {box for box in dst.regions(rank) if box_numel(box)}:
            return False
    return True


class Grid:
    """Atoms: the grid cut at every box boundary of every dim."""

    def __init__(
        self, shape: tuple[int, ...], boxes: list[Box], extra: Optional[list[set[int]]] = None
    ) -> None:
        self.cuts = [
            sorted({0, n} | {edge for box in boxes for edge in box[d]} | (extra[d] if extra else set()))
            for d, n in enumerate(shape)
        ]
        self.spans = [list(zip(cuts, cuts[1:])) for cuts in self.cuts]
        self.widths = [[b - a for a, b in spans] for spans in self.spans]

    def cells(self, box: Box) -> Iterator[Cell]:
        ranges = [
            range(bisect.bisect_left(cuts, lo), bisect.bisect_left(cuts, hi))
            for cuts, (lo, hi) in zip(self.cuts, box)
        ]
        return itertools.product(*ranges)

    def numel(self, cell: Cell) -> int:
        n = 1
        for widths, i in zip(self.widths, cell):
            n *= widths[i]
        return n

    def box(self, lo: Cell, hi: Cell) -> Box:
        return tuple((cuts[a], cuts[b]) for cuts, a, b in zip(self.cuts, lo, hi))

    def merge(self, cells: set[Cell]) -> list[Box]:
        """Cover ``cells`` with few disjoint boxes (grow each box along the last dim first)."""
        if len(cells) == 1:
            return [tuple(map(getitem, self.spans, next(iter(cells))))]
        remaining = set(cells)
        out = []
        for cell in sorted(cells):
            if cell not in remaining:
                continue
            hi = [c + 1 for c in cell]
            for d in reversed(range(len(cell))):
                while True:
                    slab = itertools.product(
                        *(
                            range(hi[e], hi[e] + 1) if e == d else range(cell[e], hi[e])
                            for e in range(len(cell))
                        )
                    )
                    if all(c in remaining for c in slab):
                        hi[d] += 1
                    else:
                        break
            remaining.difference_update(itertools.product(*(range(a, b) for a, b in zip(cell, hi))))
            out.append(self.box(cell, tuple(hi)))
        return out


class _PointToPoint:
    """The lower-bound point-to-point plan (see the module docstring)."""

    def __init__(self, src: AnyLayout, dst: AnyLayout, topology: Topology) -> None:
        self.topology = topology
        self.src_pieces = [p for p in pieces_of(src) if not p.empty]
        self.dst_pieces = [p for p in pieces_of(dst) if not p.empty]
        self.dst_partial = is_partial(dst)
        self.grid_shape = src.shape
        self.grid = Grid(src.shape, [p.box for p in self.src_pieces + self.dst_pieces])
        self.load: dict[int, int] = defaultdict(int)
        self.copies: dict[tuple[int, bool], set[Cell]] = defaultdict(set)
        self.sends: dict[tuple[str, int, int, bool], set[Cell]] = defaultdict(set)
        self.cost = 0
        self.node = functools.lru_cache(maxsize=None)(topology.node)

    @staticmethod
    def _index(pieces: list[Piece], grid: Grid) -> dict[Cell, dict[int, dict[tuple, list[int]]]]:
        """cell -> replica -> term -> ranks holding (or needing) it."""
        index: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
        for p in pieces:
            for cell in grid.cells(p.box):
                index[cell][p.replica][p.term].append(p.rank)
        return index

    def solve(self) -> tuple[tuple[Step, ...], int]:
        need = self._index(self.dst_pieces, self.grid)
        have = self._index(self.src_pieces, self.grid)
        extra = self._reduction_cuts(need, have)
        if any(extra):
            boxes = [p.box for p in self.src_pieces + self.dst_pieces]
            self.grid = Grid(self.grid_shape, boxes, extra)
            need = self._index(self.dst_pieces, self.grid)
            have = self._index(self.src_pieces, self.grid)
        for cell in sorted(need, key=lambda c: (-self.grid.numel(c), c)):
            if not self.dst_partial:  # every destination representation wants the same whole value
                self._atom(cell, sorted({r for rep in need[cell].values() for rs in rep.values() for r in rs}), have[cell])
                continue
            for replica in sorted(need[cell]):
                wanted = {t: sorted(rs) for t, rs in need[cell][replica].items()}
                for term, contributing in _assign_terms(wanted, have[cell]).items():
                    self._deliver(cell, wanted[term], contributing)
        return self._steps(), self.cost

    def _reduction_cuts(self, need: dict, have: dict) -> list[set[int]]:
        """Extra cuts that split an atom reduced for several ranks ``D`` into ``|D|`` parts along its
        longest dim, so that different members of ``D`` reduce different parts (like reduce-scatter then
        all-gather): the same bytes, spread over more ranks."""
        extra: list[set[int]] = [set() for _ in self.grid.cuts]
        for cell, replicas in need.items():
            if self.dst_partial:
                widest = max((len(ranks) for rep in replicas.values() for ranks in rep.values()), default=0)
            else:
                widest = len({r for rep in replicas.values() for ranks in rep.values() for r in ranks})
            if widest < 2 or not self._reduces(have[cell]):
                continue
            extents = [(cuts[i + 1] - cuts[i], d) for d, (cuts, i) in enumerate(zip(self.grid.cuts, cell))]
            extent, dim = max(extents, key=lambda e: (e[0], -e[1]))
            start = self.grid.cuts[dim][cell[dim]]
            parts = min(widest, extent)
            extra[dim].update(start + chunk_bounds(extent, parts, i)[0] for i in range(1, parts))
        return extra

    def _reduces(self, have: dict) -> bool:
        """Whether an atom with these holders needs a reduction (no single-term representation)."""
        if self.dst_partial:
            return len(have.get(0, {})) >= 2
        return all(len(terms) >= 2 for terms in have.values())

    def _atom(self, cell: Cell, dst: list[int], have: dict) -> None:
        """A non-Partial destination: a complete copy if one exists, else the cheapest representation."""
        complete = sorted({r for rep in have.values() if len(rep) == 1 for r in next(iter(rep.values()))})
        if complete:
            return self._copy(cell, dst, complete)

        def cost(replica: int) -> tuple[int, int]:
            holders = {r for rs in have[replica].values() for r in rs}
            return len(have[replica]) - 1 + len(dst) - bool(holders.intersection(dst)), replica

        best = min(have, key=cost)
        self._deliver(cell, dst, [ascending(have[best][t]) for t in sorted(have[best])])

    def _deliver(self, cell: Cell, dst: list[int], contributing: list[list[int]]) -> None:
        if len(contributing) == 1:
            self._copy(cell, dst, contributing[0])
        elif contributing:
            self._reduce(cell, dst, contributing)

    def _pick(self, holders: list[int], target: int) -> int:
        if len(holders) == 1:
            return holders[0]
        node, load = self.node, self.load
        here = node(target)
        return min(holders, key=lambda s: (node(s) != here, load[s], s))

    def _send(self, phase: str, src: int, dst: int, cell: Cell, accumulate: bool) -> None:
        n = self.grid.numel(cell)
        self.load[src] += n
        self.load[dst] += n
        self.sends[(phase, src, dst, accumulate)].add(cell)

    def _copy(self, cell: Cell, dst: list[int], holders: list[int]) -> None:
        held = set(holders)
        n = self.grid.numel(cell)
        load, sends, pick = self.load, self.sends, self._pick
        for d in dst:
            if d in held:
                self.copies[(d, False)].add(cell)
            else:
                src = pick(holders, d)
                self.cost += n
                load[src] += n
                load[d] += n
                sends[("A", src, d, False)].add(cell)

    def _reduce(self, cell: Cell, dst: list[int], terms: list[list[int]]) -> None:
        holding = {r for holders in terms for r in holders}
        candidates = [d for d in dst if d in holding] or dst
        self.cost += (len(terms) - 1 + len(dst) - bool(holding.intersection(dst))) * self.grid.numel(cell)
        node = self.node

        def same(a: int, b: int) -> bool:
            return node(a) == node(b)

        def reducer_key(rho: int) -> tuple[int, int, int]:
            far_terms = sum(1 for hs in terms if not any(same(h, rho) for h in hs))
            far_dst = sum(1 for d in dst if not same(d, rho))
            return far_terms + far_dst, self.load[rho], rho

        rho = min(candidates, key=reducer_key)
        for holders in terms:
            if rho in holders:
                self.copies[(rho, True)].add(cell)
            else:
                self._send("A", self._pick(holders, rho), rho, cell, True)
        for d in dst:
            if d != rho:
                self._send("B", rho, d, cell, False)

    def _steps(self) -> tuple[Step, ...]:
        steps: list[Step] = []
        for (rank, accumulate), cells in sorted(self.copies.items()):
            steps += [LocalCopy(rank, box, accumulate) for box in self.grid.merge(cells)]
        spans = self.grid.spans
        for (phase, src, dst, accumulate), cells in sorted(self.sends.items()):  # phase A sorts before B
            if len(cells) == 1:
                box = tuple(map(getitem, spans, next(iter(cells))))
                steps.append(Transfer(src, dst, box, phase, accumulate))
            else:
                steps += [Transfer(src, dst, box, phase, accumulate) for box in self.grid.merge(cells)]
        return tuple(steps)


def _assign_terms(wanted: dict[tuple, list[int]], have: dict) -> dict[tuple, list[list[int]]]:
    """The cheapest split, at one atom, of a Partial source's terms among the destination terms.

    ``wanted``: destination term -> ranks needing it; ``have``: representation -> term -> holders.
    Returns destination term -> holders of each source term summed into it (absent: zero fill).

    With ``G_j`` the source terms given to destination term ``j`` (needed by ``D_j``), the cost is
    ``sum over non-empty G_j of |G_j| - 1 + |D_j| - h_j`` = ``k + sum of e_j``, where ``h_j`` is how
    many of ``D_j`` hold the term when ``|G_j| == 1`` and whether any of ``D_j`` holds one of them
    otherwise, and ``e_j = |D_j| - 1 - h_j``. Moving the extra terms of one multi-term group into
    another never costs more (the other's ``h`` only grows, the first becomes a single term whose
    ``h`` is at least as large), so some optimum has at most one multi-term group, the *pool*. Each
    choice of pool (destination term ``w``, and the term ``a`` that gives it its ``h``), or none, is
    then a min-cost assignment of the other terms to single-term groups or to the pool (cost 0).
    """
    return dict(_assign_cached(_freeze(wanted), _freeze({r: _freeze(t) for r, t in have.items()})))


def _freeze(mapping: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in mapping.items()))


@functools.lru_cache(maxsize=65536)
def _assign_cached(wanted: tuple, have: tuple) -> tuple:
    best: Optional[tuple[int, int, tuple]] = None
    for replica, rep in have:
        cost, split = _cheapest_split(wanted, rep)
        if best is None or cost < best[0]:
            best = (cost, replica, split)
    return best[2] if best is not None else ()


def _cheapest_split(wanted: tuple, rep: tuple) -> tuple[int, tuple]:
    from scipy.optimize import linear_sum_assignment

    dst_terms = [t for t, _ in wanted]
    needers = [set(rs) for _, rs in wanted]
    holders = [set(hs) for _, hs in rep]
    k, kd = len(holders), len(needers)
    single = [[len(d) - 1 - len(d & h) for d in needers] for h in holders]
    options: list[tuple[int, dict[int, list[int]]]] = []

    def assign(rows: list[int], cols: list[int], pool: int) -> tuple[int, dict[int, int]]:
        """Rows to distinct columns (single-term groups) or to one of ``pool`` free pool slots."""
        if not rows:
            return 0, {}
        matrix = [[single[t][j] for j in cols] + [0] * pool for t in rows]
        r_idx, c_idx = linear_sum_assignment(matrix)
        out = {rows[r]: (cols[c] if c < len(cols) else -1) for r, c in zip(r_idx, c_idx)}
        return int(sum(matrix[r][c] for r, c in zip(r_idx, c_idx))), out

    if k <= kd:
        cost, got = assign(list(range(k)), list(range(kd)), 0)
        options.append((cost, {t: [j] for t, j in got.items()}))
    for w in range(kd):
        for a in range(k):
            pool_cost = len(needers[w]) - 1 - min(1, len(needers[w] & holders[a]))
            rows = [t for t in range(k) if t != a]
            cost, got = assign(rows, [j for j in range(kd) if j != w], len(rows))
            groups = {t: [w if j == -1 else j] for t, j in got.items()}
            groups[a] = [w]
            options.append((pool_cost + cost, groups))
    cost, groups = min(options, key=lambda o: o[0])
    split: dict[tuple, list[list[int]]] = {}
    for t in range(k):
        split.setdefault(dst_terms[groups[t][0]], []).append(sorted(holders[t]))
    return k + cost, tuple(sorted(split.items()))


def ascending(ranks: list[int]) -> list[int]:
    """``ranks`` sorted (a single holder, the common case, as it is)."""
    return ranks if len(ranks) == 1 else sorted(ranks)
