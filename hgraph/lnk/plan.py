"""Reshard plans as data: an ordered list of steps on explicit ranks, with their costs.

Boxes in steps are *global* coordinates; each rank turns them into local ones with its own source
region (what it reads) and destination region (what it writes). Steps run in list order:

* ``LocalCopy``  a rank copies (or adds, for a reduction it performs) a box from its source tensor
  into its output;
* ``Transfer``   point-to-point send of a box. Phase ``A`` carries source data (read from the
  sender's source tensor; ``accumulate`` means the receiver adds it: a reduction input), phase ``B``
  carries reduced sums (read from the reducer's output);
* ``AllGather``, ``ReduceScatter``, ``AllReduce``, ``AllToAll``  collectives on a sorted group of
  ranks, with the global boxes each member contributes or receives.

Traffic of collectives is counted as the ring algorithms move it (all_gather: every member receives
what it lacks; reduce_scatter: ``(n-1)/n`` of the box per member; all_reduce: both), logical bytes
without the padding gloo needs for uneven chunks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Union

from hgraph.core.layout import AnyLayout, Box, box_numel, chunk_bounds
from hgraph.lnk.topology import DEFAULT_TOPOLOGY, Topology

Group = tuple[int, ...]
Message = tuple[int, int, int]  # (sender, receiver, elements)


def format_box(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _group(group: Group) -> str:
    return "group(" + ",".join(map(str, group)) + ")"


def _ring(group: Group, sent: list[int]) -> list[Message]:
    """Member ``i`` sends ``sent[i]`` elements to its ring successor."""
    n = len(group)
    return [(group[i], group[(i + 1) % n], sent[i]) for i in range(n) if sent[i]]


def _chunk_numels(box: Box, dim: int, chunks: tuple[tuple[int, int], ...]) -> list[int]:
    """Elements of each chunk when ``box`` is cut along ``dim`` at ``chunks``."""
    per_row = box_numel(box) // max(1, box[dim][1] - box[dim][0])
    return [per_row * (b - a) for a, b in chunks]


@dataclass(frozen=True)
class LocalCopy:
    """``rank`` copies ``box`` from its source tensor into its output (adds it if ``accumulate``)."""

    rank: int
    box: Box
    accumulate: bool = False

    @property
    def ranks(self) -> Group:
        return (self.rank,)

    def messages(self) -> list[Message]:
        return []

    def __str__(self) -> str:
        return f"copy {self.rank} {format_box(self.box)}" + (" add" if self.accumulate else "")


@dataclass(frozen=True)
class Transfer:
    """``src`` sends ``box`` to ``dst`` in ``phase`` (``A``: source data, ``B``: reduced sums)."""

    src: int
    dst: int
    box: Box
    phase: str
    accumulate: bool = False

    @property
    def ranks(self) -> Group:
        return (self.src, self.dst)

    def messages(self) -> list[Message]:
        return [(self.src, self.dst, box_numel(self.box))]

    def __str__(self) -> str:
        add = " add" if self.accumulate else ""
        return f"send {self.src}->{self.dst} {format_box(self.box)} phase{self.phase}{add}"


@dataclass(frozen=True)
class AllGather:
    """Members hold ``box`` cut along ``dim`` into ``chunks`` (in group order); all get the whole box."""

    group: Group
    dim: int
    box: Box
    chunks: tuple[tuple[int, int], ...]

    @property
    def ranks(self) -> Group:
        return self.group

    def messages(self) -> list[Message]:
        n, total = len(self.group), box_numel(self.box)
        own = _chunk_numels(self.box, self.dim, self.chunks)
        return _ring(self.group, [total - own[(i + 1) % n] for i in range(n)])

    def __str__(self) -> str:
        return f"all_gather dim{self.dim} {_group(self.group)}"


@dataclass(frozen=True)
class ReduceScatter:
    """Members hold partial terms of ``box``; member ``i`` gets the sum of ``chunks[i]`` along ``dim``."""

    group: Group
    dim: int
    box: Box
    chunks: tuple[tuple[int, int], ...]

    @property
    def ranks(self) -> Group:
        return self.group

    def messages(self) -> list[Message]:
        total = box_numel(self.box)
        own = _chunk_numels(self.box, self.dim, self.chunks)
        return _ring(self.group, [total - own[i] for i in range(len(self.group))])

    def __str__(self) -> str:
        return f"reduce_scatter dim{self.dim} {_group(self.group)}"


@dataclass(frozen=True)
class AllReduce:
    """Members hold partial terms of ``box``; all get the sum (ring: reduce-scatter then all-gather)."""

    group: Group
    box: Box

    @property
    def ranks(self) -> Group:
        return self.group

    def messages(self) -> list[Message]:
        n, total = len(self.group), box_numel(self.box)
        own = [chunk_bounds(total, n, i)[1] - chunk_bounds(total, n, i)[0] for i in range(n)]
        return _ring(self.group, [2 * total - own[i] - own[(i + 1) % n] for i in range(n)])

    def __str__(self) -> str:
        return f"all_reduce {_group(self.group)}"


@dataclass(frozen=True)
class AllToAll:
    """Member ``i`` sends ``boxes[i][j]`` of its source tensor to member ``j`` (``src_dim`` -> ``dst_dim``)."""

    group: Group
    src_dim: int
    dst_dim: int
    boxes: tuple[tuple[Box, ...], ...]

    @property
    def ranks(self) -> Group:
        return self.group

    def messages(self) -> list[Message]:
        return [
            (a, b, box_numel(self.boxes[i][j]))
            for i, a in enumerate(self.group)
            for j, b in enumerate(self.group)
            if i != j and box_numel(self.boxes[i][j])
        ]

    def __str__(self) -> str:
        return f"all_to_all dim{self.src_dim}->dim{self.dst_dim} {_group(self.group)}"


Step = Union[LocalCopy, Transfer, AllGather, ReduceScatter, AllReduce, AllToAll]
Collective = (AllGather, ReduceScatter, AllReduce, AllToAll)


@dataclass(frozen=True)
class ReshardPlan:
    """How to turn tensors laid out as ``src`` into ``dst``: global ordered steps and their costs.

    ``noop`` plans have no steps: every destination rank already holds exactly its output.
    """

    src: AnyLayout
    dst: AnyLayout
    itemsize: int
    steps: tuple[Step, ...]
    lower_bound_bytes: int
    topology: Topology = DEFAULT_TOPOLOGY
    noop: bool = False

    @cached_property
    def _by_rank(self) -> dict[int, tuple[tuple[int, Step], ...]]:
        by_rank: dict[int, list[tuple[int, Step]]] = defaultdict(list)
        for k, step in enumerate(self.steps):
            for rank in dict.fromkeys(step.ranks):
                by_rank[rank].append((k, step))
        return {r: tuple(s) for r, s in by_rank.items()}

    @cached_property
    def first_round(self) -> frozenset[int]:
        """Indices (in ``steps``) of the communication steps that need no earlier communication:
        the leading transfers of the first phase, or the leading collectives on disjoint groups."""
        out: set[int] = set()
        seen: set[int] = set()
        kind = None
        for i, step in enumerate(self.steps):
            if isinstance(step, LocalCopy):
                continue
            this = ("T", step.phase) if isinstance(step, Transfer) else ("C",)
            if kind is not None and this != kind:
                break
            if this == ("C",):
                if seen & set(step.ranks):
                    break
                seen |= set(step.ranks)
            kind = this
            out.add(i)
        return frozenset(out)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank taking part (source or destination), ascending."""
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    def steps_for(self, rank: int) -> tuple[Step, ...]:
        """The steps ``rank`` takes part in, in plan order."""
        return tuple(step for _, step in self._by_rank.get(rank, ()))

    def indexed_steps_for(self, rank: int) -> tuple[tuple[int, Step], ...]:
        """``(index in steps, step)`` of the steps ``rank`` takes part in, in plan order (built once
        per plan for all ranks, so each rank's look-up costs its own steps only)."""
        return self._by_rank.get(rank, ())

    def messages(self) -> list[Message]:
        return list(self._messages)

    @cached_property
    def _messages(self) -> tuple[Message, ...]:
        return tuple(m for step in self.steps for m in step.messages())

    @cached_property
    def bytes_moved(self) -> int:
        """Bytes crossing between ranks (logical, unpadded)."""
        return sum(n for _, _, n in self._messages) * self.itemsize

    @cached_property
    def max_rank_bytes(self) -> int:
        """Sent + received bytes of the busiest rank."""
        load: dict[int, int] = defaultdict(int)
        for a, b, n in self._messages:
            load[a] += n
            load[b] += n
        return max(load.values(), default=0) * self.itemsize

    @property
    def inter_node_bytes(self) -> int:
        """Bytes crossing between nodes of ``topology``."""
        topo = self.topology
        return sum(n for a, b, n in self.messages() if not topo.same_node(a, b)) * self.itemsize

    def predicted_time_s(self, topology: Optional[Topology] = None) -> float:
        """Alpha-beta estimate: phases run one after another; within a phase every rank's sends (and
        receives) are serialised on it; collectives (concurrent across groups) cost ``rounds`` latencies
        plus the busiest member's bytes over the group's slowest link."""
        topo = topology or self.topology
        phases: dict[str, list[Step]] = defaultdict(list)
        for step in self.steps:
            if isinstance(step, Transfer):
                phases[step.phase].append(step)
            elif isinstance(step, Collective):
                phases["collective"].append(step)
        total = 0.0
        for name, steps in phases.items():
            if name == "collective":
                total += max(self._collective_time(s, topo) for s in steps)
                continue
            send: dict[int, float] = defaultdict(float)
            recv: dict[int, float] = defaultdict(float)
            for a, b, n in (m for s in steps for m in s.messages()):
                t = topo.message_time(a, b, n * self.itemsize)
                send[a] += t
                recv[b] += t
            total += max(max(send.values(), default=0.0), max(recv.values(), default=0.0))
        return total

    def _collective_time(self, step: Step, topo: Topology) -> float:
        group = step.ranks
        n = len(group)
        rounds = 2 * (n - 1) if isinstance(step, AllReduce) else n - 1
        if any(not topo.same_node(a, b) for a in group for b in group):
            latency, bandwidth = topo.inter_latency, topo.inter_bandwidth
        else:
            latency, bandwidth = topo.intra_latency, topo.intra_bandwidth
        sent: dict[int, int] = defaultdict(int)
        received: dict[int, int] = defaultdict(int)
        for a, b, k in step.messages():
            sent[a] += k
            received[b] += k
        busiest = max([*sent.values(), *received.values()], default=0) * self.itemsize
        return rounds * latency + busiest / bandwidth

    def __str__(self) -> str:
        head = (
            f"reshard {self.src} -> {self.dst}: {self.bytes_moved} bytes "
            f"(lower bound {self.lower_bound_bytes}), busiest rank {self.max_rank_bytes}"
        )
        if self.noop:
            return head + "\n  no-op"
        return "\n".join([head] + [f"  {step}" for step in self.steps])

