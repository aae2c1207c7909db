"""The rank a program runs as: its communicator and its groups, set per thread/process.

Compiled stage programs are shared by every rank of a (pipeline, stage); their communication nodes
name *logical* mesh dims (``"tp"``, ``"cp"``) and look up the concrete group of the calling rank here.
The runtime enters ``rank_context(...)`` around a program; ``compiled.simulate`` does the same in each
simulated-rank thread.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

from hgraph.errors import CommunicationError
from hgraph.runtime.kernels.comm import Communicator, Group


@dataclass(frozen=True)
class RankContext:
    """Who is running: global rank, communicator, and this rank's group and index per mesh dim name.
    ``routing``: when a list, every expert dispatch appends the rows this rank routed to each expert
    (``[E]``, in call order): router statistics for the planner (``Trainer.history``)."""

    rank: int
    comm: Communicator
    groups: dict[str, Group] = field(default_factory=dict)
    routing: Optional[list] = None

    def group(self, mesh_dim: str) -> Group:
        try:
            return self.groups[mesh_dim]
        except KeyError:
            raise CommunicationError(
                f"rank {self.rank} has no '{mesh_dim}' group (known: {sorted(self.groups)})"
            ) from None

    def index(self, mesh_dim: str) -> int:
        """This rank's coordinate along ``mesh_dim`` (its position in that group)."""
        return self.group(mesh_dim).index(self.rank)

    def size(self, mesh_dim: str) -> int:
        return len(self.group(mesh_dim))


_local = threading.local()


def current() -> RankContext:
    """The context of the running program; raises when called outside one."""
    ctx: Optional[RankContext] = getattr(_local, "ctx", None)
    if ctx is None:
        raise CommunicationError(
            "no hgraph rank context is active; run programs through the hgraph runtime or compiled.simulate"
        )
    return ctx


@contextlib.contextmanager
def rank_context(ctx: RankContext) -> Iterator[RankContext]:
    """Make ``ctx`` current in this thread for the duration of the block."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous
