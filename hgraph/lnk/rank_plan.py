"""Per-rank LNK plans: the steps one rank runs, found from the two layouts alone.

``solve_rank(src, dst, rank)`` returns a ``RankPlan`` whose steps equal
``solve(src, dst).steps_for(rank)`` (order, peers, boxes) and whose byte counts equal the full plan's,
without building the world's transfer table. The solver's choices are local rules wherever they are
forced (``hgraph.lnk.solver``): a rank that needs an atom and lacks it receives it from its only
holder; a reduction's reducer is its only candidate, or the only one with the fewest partners on
other nodes, and each term comes from its only holder or the only one on the reducer's node. A
rank's steps are then the atoms of its own boxes: which destination boxes its source boxes meet
(it sends those atoms to every rank that needs and lacks them) and which source boxes its
destination boxes meet. Atoms with the same source and destination boxes share one rule, so the
work is the number of distinct boxes plus the rank's own messages, not world x atoms.

A term held by several ranks equally near the reducer (tp ranks holding the same gradient) goes to
the least loaded of them. When each such rank holds only that one term, its load is a sum of
messages the local rules know (what it receives and sends as reducer, needer or copy sender, and
which of its group sent each earlier atom), so the group's choices are replayed over the atoms in
the solver's order with the group's loads alone. Where the solver breaks any other tie by the load
it has accumulated over all ranks, where the plan may be a collective or a no-op, and for Partial
destinations, there is no local rule: the full plan is solved once (cached) and the rank's part is
cut from it. Either way the answer is the full plan's.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Union

from hgraph.errors import LayoutError
from hgraph.core.layout import AnyLayout, Box, box_numel, chunk_bounds
from hgraph.lnk.collectives import collective_steps
from hgraph.lnk.pieces import is_partial, pieces_of
from hgraph.lnk.plan import LocalCopy, Message, ReshardPlan, Step, Transfer
from hgraph.lnk.solver import Grid, ascending, solve, validate
from hgraph.lnk.topology import DEFAULT_TOPOLOGY, Topology

Cell = tuple[int, ...]
_CANDIDATE_WORK = 4096  # reducer candidates x (terms + needers) beyond which ties are not searched


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a ``ReshardPlan``: its steps in plan order, and the plan's byte totals.

    ``first``: indices (in ``steps``) of the plan's first-round steps. ``local``: found by local rules
    (else cut from the full plan). What needs every rank's steps (busiest rank, all messages,
    predicted time) comes from the full plan, solved on first use.
    """

    src: AnyLayout
    dst: AnyLayout
    itemsize: int
    rank: int
    steps: tuple[Step, ...]
    first: frozenset[int]
    lower_bound_bytes: int
    bytes_moved: int
    topology: Topology = DEFAULT_TOPOLOGY
    noop: bool = False
    local: bool = True

    @classmethod
    def of(cls, plan: ReshardPlan, rank: int) -> "RankPlan":
        """``rank``'s part of a full plan."""
        indexed = plan.indexed_steps_for(rank)
        first = frozenset(i for i, (k, _) in enumerate(indexed) if k in plan.first_round)
        return cls(plan.src, plan.dst, plan.itemsize, rank, tuple(s for _, s in indexed), first,
                   plan.lower_bound_bytes, plan.bytes_moved, plan.topology, plan.noop, local=False)

    @cached_property
    def memo(self) -> dict:
        """Per-plan cache of data derived from the steps (the runtime's call lists)."""
        return {}

    @property
    def first_round(self) -> frozenset[int]:
        return self.first

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Every rank taking part in the whole plan (source or destination), ascending."""
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    @cached_property
    def _indexed(self) -> tuple[tuple[int, Step], ...]:
        return tuple(enumerate(self.steps))

    def indexed_steps_for(self, rank: int) -> tuple[tuple[int, Step], ...]:
        """``(index, step)`` of this rank's steps; ``first_round`` uses the same indices."""
        if rank != self.rank:
            raise LayoutError(
                f"this RankPlan holds rank {self.rank}'s steps of {self.src} -> {self.dst}, not rank {rank}'s; "
                f"use solve_rank(src, dst, {rank}) or the full plan solve(src, dst)"
            )
        return self._indexed

    def steps_for(self, rank: int) -> tuple[Step, ...]:
        return tuple(s for _, s in self.indexed_steps_for(rank))

    @cached_property
    def full(self) -> ReshardPlan:
        """The whole plan (every rank's steps), solved on first use."""
        return solve(self.src, self.dst, self.topology, self.itemsize)

    @property
    def max_rank_bytes(self) -> int:
        return self.full.max_rank_bytes

    @property
    def inter_node_bytes(self) -> int:
        return self.full.inter_node_bytes

    def messages(self) -> list[Message]:
        return self.full.messages()

    def predicted_time_s(self, topology: Optional[Topology] = None) -> float:
        return self.full.predicted_time_s(topology)

    def __str__(self) -> str:
        head = (
            f"reshard {self.src} -> {self.dst}: {self.bytes_moved} bytes "
            f"(lower bound {self.lower_bound_bytes}), rank {self.rank}'s {len(self.steps)} steps"
        )
        if self.noop:
            return head + "\n  no-op"
        return "\n".join([head] + [f"  {step}" for step in self.steps])


AnyPlan = Union[ReshardPlan, RankPlan]


def solve_rank(
    src: AnyLayout, dst: AnyLayout, rank: int, topology: Optional[Topology] = None, itemsize: int = 4
) -> RankPlan:
    """``rank``'s part of ``solve(src, dst, topology, itemsize)`` (cached by its arguments)."""
    return _solve_rank(src, dst, int(rank), topology or DEFAULT_TOPOLOGY, int(itemsize))


@functools.lru_cache(maxsize=65536)
def _solve_rank(src: AnyLayout, dst: AnyLayout, rank: int, topology: Topology, itemsize: int) -> RankPlan:
    validate(src, dst)
    rules = _rules(src, dst, topology)
    if rules is None:
        return RankPlan.of(solve(src, dst, topology, itemsize), rank)
    steps = rules.steps(rank)
    first = frozenset(
        i for i, s in enumerate(steps) if isinstance(s, Transfer) and s.phase == rules.first_phase
    )
    moved = rules.cost * itemsize
    return RankPlan(src, dst, itemsize, rank, steps, first, moved, moved, topology)


@functools.lru_cache(maxsize=512)
def _rules(src: AnyLayout, dst: AnyLayout, topology: Topology) -> Optional["_Rules"]:
    """The local rules of a layout pair, or ``None`` where the full plan decides."""
    if not box_numel(tuple((0, n) for n in src.shape)) or is_partial(dst):
        return None
    if collective_steps(src, dst) is not None:
        return None
    rules = _Rules(src, dst, topology)
    return rules if rules.local else None


class _Have:
    """The source pieces over some atoms: representation -> term -> holders, and what follows."""

    def __init__(self, groups: list[dict[tuple[int, tuple], list[int]]]) -> None:
        reps: dict[int, dict[tuple, list[int]]] = defaultdict(lambda: defaultdict(list))
        for group in groups:
            for (replica, term), ranks in group.items():
                reps[replica][term].extend(ranks)
        self.reps = reps
        self.complete = sorted({r for rep in reps.values() if len(rep) == 1 for r in next(iter(rep.values()))})
        self.holding = {k: frozenset(r for rs in rep.values() for r in rs) for k, rep in reps.items()}
        self.terms = {k: [ascending(rep[t]) for t in sorted(rep)] for k, rep in reps.items()}
        self._ambiguous: dict[tuple[int, int], list[list[int]]] = {}

    @cached_property
    def term_sets(self) -> dict[int, frozenset[tuple[int, ...]]]:
        """representation -> its terms' holder tuples."""
        return {k: frozenset(map(tuple, terms)) for k, terms in self.terms.items()}

    def tied(self, replica: int, rho: int, node: Callable[[int], int]) -> bool:
        """Whether some term not held by ``rho`` has several holders equally near it."""
        here = node(rho)
        key = (replica, here)
        if key not in self._ambiguous:
            self._ambiguous[key] = [
                hs for hs in self.terms[replica] if len(hs) > 1 and sum(1 for h in hs if node(h) == here) != 1
            ]
        return any(rho not in hs for hs in self._ambiguous[key])

    @cached_property
    def own_terms(self) -> dict[int, dict[int, list[list[int]]]]:
        """representation -> rank -> the (ascending) holder lists of the terms it holds."""
        out: dict[int, dict[int, list[list[int]]]] = {}
        for k, terms in self.terms.items():
            by_rank: dict[int, list[list[int]]] = defaultdict(list)
            for hs in terms:
                for r in hs:
                    by_rank[r].append(hs)
            out[k] = by_rank
        return out


@dataclass(frozen=True)
class _Copy:
    """Atoms with a complete copy: every needer lacking it receives it from the single ``sender``."""

    needers: frozenset[int]
    held: frozenset[int]
    sender: Optional[int]  # None: every needer already holds it
    cost: int
    has_a: bool

    def add(self, rank: int, cell: Cell, copies: dict, sends: dict, pick=None) -> None:
        if rank in self.needers:
            if rank in self.held:
                copies[(rank, False)].add(cell)
            else:
                sends[("A", self.sender, rank, False)].add(cell)
        if rank == self.sender:
            for d in self.needers:
                if d not in self.held:
                    sends[("A", rank, d, False)].add(cell)

    def load(self, rank: int) -> int:
        """Messages (per element) ``rank`` sends or receives at one of these atoms."""
        return (rank in self.needers and rank not in self.held) + (self.cost if rank == self.sender else 0)


@dataclass(frozen=True)
class _Reduce:
    """Atoms summed by reducer ``rho`` from one term each of ``terms`` and sent on to the needers."""

    needers: frozenset[int]
    have: _Have
    replica: int
    rho: int
    cost: int
    has_a: bool
    tied: bool  # some term has several holders equally near rho: picked by load (``_Rules.pick``)

    @property
    def term_sets(self) -> frozenset[tuple[int, ...]]:
        return self.have.term_sets[self.replica]

    def load(self, rank: int) -> int:
        """Messages (per element) ``rank`` sends or receives here, except as a term's chosen sender."""
        if rank == self.rho:
            return sum(1 for hs in self.have.terms[self.replica] if rank not in hs) + len(self.needers) - 1
        return int(rank in self.needers)

    def add(self, rank: int, cell: Cell, copies: dict, sends: dict, pick) -> None:
        rho = self.rho
        if rank == rho:
            for hs in self.have.terms[self.replica]:
                if rho in hs:
                    copies[(rho, True)].add(cell)
                else:
                    sends[("A", pick(hs, rho, cell), rho, True)].add(cell)
            for d in self.needers:
                if d != rho:
                    sends[("B", rho, d, False)].add(cell)
            return
        if rank in self.needers:
            sends[("B", rho, rank, False)].add(cell)
        for hs in self.have.own_terms[self.replica].get(rank, ()):
            if rho not in hs and pick(hs, rho, cell) == rank:
                sends[("A", rank, rho, True)].add(cell)


class _Rules:
    """The forced choices of the solver for one layout pair, grouped by the atoms' covering boxes."""

    def __init__(self, src: AnyLayout, dst: AnyLayout, topology: Topology) -> None:
        self.node = topology.node
        self.src_groups: dict[Box, dict[tuple[int, tuple], list[int]]] = {}
        self.dst_groups: dict[Box, set[int]] = {}
        self.src_boxes: dict[int, list[Box]] = defaultdict(list)
        self.dst_boxes: dict[int, list[Box]] = defaultdict(list)
        for p in pieces_of(src):
            if not p.empty:
                self.src_groups.setdefault(p.box, {}).setdefault((p.replica, p.term), []).append(p.rank)
                self.src_boxes[p.rank].append(p.box)
        for p in pieces_of(dst):
            if not p.empty:
                self.dst_groups.setdefault(p.box, set()).add(p.rank)
                self.dst_boxes[p.rank].append(p.box)
        self._haves: dict[tuple[Box, ...], _Have] = {}
        self._needers: dict[tuple[Box, ...], frozenset[int]] = {}
        boxes = list(self.src_groups) + list(self.dst_groups)
        self.grid = Grid(src.shape, boxes)
        self.sig = self._signatures()
        extra = self._reduction_cuts()
        if any(extra):
            self.grid = Grid(src.shape, boxes, extra)
            self.sig = self._signatures()
        self.local = self._analyse()

    def _signatures(self) -> dict[Cell, tuple[tuple[Box, ...], tuple[Box, ...]]]:
        """Needed atom -> (source boxes covering it, destination boxes covering it)."""
        src_cover: dict[Cell, list[Box]] = defaultdict(list)
        dst_cover: dict[Cell, list[Box]] = defaultdict(list)
        for box in self.src_groups:
            for cell in self.grid.cells(box):
                src_cover[cell].append(box)
        for box in self.dst_groups:
            for cell in self.grid.cells(box):
                dst_cover[cell].append(box)
        return {cell: (tuple(src_cover.get(cell, ())), tuple(boxes)) for cell, boxes in dst_cover.items()}

    def have(self, cover: tuple[Box, ...]) -> _Have:
        if cover not in self._haves:
            self._haves[cover] = _Have([self.src_groups[b] for b in cover])
        return self._haves[cover]

    def needers(self, cover: tuple[Box, ...]) -> frozenset[int]:
        if cover not in self._needers:
            self._needers[cover] = frozenset().union(*(self.dst_groups[b] for b in cover))
        return self._needers[cover]

    def _reduction_cuts(self) -> list[set[int]]:
        """The solver's extra cuts of atoms reduced for several ranks (``_reduction_cuts`` there)."""
        cuts = self.grid.cuts
        extra: list[set[int]] = [set() for _ in cuts]
        for cell, (src_cover, dst_cover) in self.sig.items():
            widest = len(self.needers(dst_cover))
            if widest < 2 or not src_cover or self.have(src_cover).complete:
                continue
            extents = [(c[i + 1] - c[i], d) for d, (c, i) in enumerate(zip(cuts, cell))]
            extent, dim = max(extents, key=lambda e: (e[0], -e[1]))
            start = cuts[dim][cell[dim]]
            parts = min(widest, extent)
            extra[dim].update(start + chunk_bounds(extent, parts, i)[0] for i in range(1, parts))
        return extra

    def _analyse(self) -> bool:
        """Build every rule; False when some choice depends on the solver's running load."""
        numel: dict[tuple, int] = defaultdict(int)
        for cell, sig in self.sig.items():
            numel[sig] += self.grid.numel(cell)
        self.rule: dict[tuple, Union[_Copy, _Reduce]] = {}
        self.cost, has_a = 0, False
        for sig, n in numel.items():
            rule = self._rule(*sig)
            if rule is None:
                return False
            self.rule[sig] = rule
            self.cost += rule.cost * n
            has_a = has_a or rule.has_a
        self.first_phase = "A" if has_a else "B"
        if any(isinstance(r, _Reduce) and r.tied for r in self.rule.values()) and not self._one_term_each():
            return False
        self.order = sorted(self.sig, key=lambda c: (-self.grid.numel(c), c))  # the solver's atom order
        self.position = {cell: i for i, cell in enumerate(self.order)}
        self._replays: dict[tuple[int, ...], list] = {}
        return self.cost > 0

    def _one_term_each(self) -> bool:
        """Every rank holding a term of a reduction holds only that term (one holder set per rank)."""
        owner: dict[int, tuple[int, ...]] = {}
        sets = {id(r.term_sets): r.term_sets for r in self.rule.values() if isinstance(r, _Reduce)}
        for term_sets in sets.values():
            for hs in term_sets:
                    if any(owner.setdefault(h, hs) != hs for h in hs):
                        return False
        return True

    def pick(self, holders: list[int], rho: int, cell: Cell) -> int:
        """The solver's sender of a term to reducer ``rho`` at ``cell``: the nearest holder, then the
        least loaded (replayed for the holders' group), then the lowest rank."""
        if len(holders) == 1:
            return holders[0]
        here = self.node(rho)
        near = [h for h in holders if self.node(h) == here]
        if len(near) == 1:
            return near[0]
        return self._replay(tuple(holders), self.position[cell])

    def _replay(self, group: tuple[int, ...], until: int) -> int:
        """The group's choice at atom ``until`` (in solver order), replaying its loads from atom 0."""
        state = self._replays.setdefault(group, [0, dict.fromkeys(group, 0), {}])
        position, load, chosen = state
        node = self.node
        while position <= until:
            cell = self.order[position]
            rule, n = self.rule[self.sig[cell]], self.grid.numel(cell)
            if isinstance(rule, _Reduce) and group in rule.term_sets and rule.rho not in group:
                here = node(rule.rho)
                sender = min(group, key=lambda s: (node(s) != here, load[s], s))
                chosen[position] = sender
                load[sender] += n
            for h in group:
                load[h] += rule.load(h) * n
            position += 1
        state[0] = position
        return chosen[until]

    def _rule(self, src_cover: tuple[Box, ...], dst_cover: tuple[Box, ...]) -> Optional[Union[_Copy, _Reduce]]:
        if not src_cover:
            return None
        have, needers = self.have(src_cover), self.needers(dst_cover)
        if have.complete:
            held = frozenset(have.complete)
            lacking = len(needers) - sum(1 for h in held if h in needers)
            if lacking and len(held) > 1:
                return None  # the solver picks among holders by load
            return _Copy(needers, held, have.complete[0] if lacking else None, lacking, lacking > 0)
        dst = sorted(needers)

        def cost(replica: int) -> tuple[int, int]:
            return len(have.reps[replica]) - 1 + len(dst) - (not have.holding[replica].isdisjoint(needers)), replica

        replica = min(have.reps, key=cost)
        terms, holding = have.terms[replica], have.holding[replica]
        rho = self._reducer([d for d in dst if d in holding] or dst, terms, dst)
        if rho is None:
            return None
        tied = have.tied(replica, rho, self.node)
        has_a = any(rho not in hs for hs in terms)
        return _Reduce(needers, have, replica, rho, cost(replica)[0], has_a, tied)

    def _reducer(self, candidates: list[int], terms: list[list[int]], dst: list[int]) -> Optional[int]:
        """The solver's reducer when its nearness alone decides it (else ``None``: load decides)."""
        if len(candidates) == 1:
            return candidates[0]
        if len(candidates) * (len(terms) + len(dst)) > _CANDIDATE_WORK:
            return None
        node = self.node

        def far(rho: int) -> int:
            here = node(rho)
            return sum(1 for hs in terms if all(node(h) != here for h in hs)) + sum(1 for d in dst if node(d) != here)

        scored = sorted((far(c), c) for c in candidates)
        return scored[0][1] if scored[0][0] < scored[1][0] else None

    def steps(self, rank: int) -> tuple[Step, ...]:
        """``rank``'s steps, in the full plan's order (copies, then transfers by phase, src, dst)."""
        cells: set[Cell] = set()
        for box in [*self.dst_boxes.get(rank, ()), *self.src_boxes.get(rank, ())]:
            cells.update(self.grid.cells(box))
        copies: dict[tuple[int, bool], set[Cell]] = defaultdict(set)
        sends: dict[tuple[str, int, int, bool], set[Cell]] = defaultdict(set)
        for cell in cells:
            sig = self.sig.get(cell)
            if sig is not None:
                self.rule[sig].add(rank, cell, copies, sends, self.pick)
        out: list[Step] = []
        for (r, accumulate), group in sorted(copies.items()):
            out += [LocalCopy(r, box, accumulate) for box in self.grid.merge(group)]
        for (phase, s, d, accumulate), group in sorted(sends.items()):
            out += [Transfer(s, d, box, phase, accumulate) for box in self.grid.merge(group)]
        return tuple(out)
