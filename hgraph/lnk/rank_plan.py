"""Per-rank LNK plans: the steps one rank runs, found from the two layouts alone.

``solve_rank(src, dst, rank)`` returns a ``RankPlan`` whose steps equal
``solve(src, dst).steps_for(rank)`` (order, peers, boxes) and whose byte counts equal the full plan's,
without building the world's transfer table.
The local rules that find a rank's steps, and where the full plan decides instead, are
``hgraph.lnk.local_rules``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Union

from hgraph.errors import LayoutError
from hgraph.core.layout import AnyLayout
from hgraph.lnk.plan import Message, ReshardPlan, Step, Transfer
from hgraph.lnk.solver import solve, validate
from hgraph.lnk.local_rules import local_rules
from hgraph.lnk.topology import DEFAULT_TOPOLOGY, Topology



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
    rules = local_rules(src, dst, topology)
    if rules is None:
        return RankPlan.of(solve(src, dst, topology, itemsize), rank)
    steps = rules.steps(rank)
    first = frozenset(
        i for i, s in enumerate(steps) if isinstance(s, Transfer) and s.phase == rules.first_phase
    )
    moved = rules.cost * itemsize
    return RankPlan(src, dst, itemsize, rank, steps, first, moved, moved, topology)
