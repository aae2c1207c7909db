"""The rank a program runs as: its communicator and its groups, passed to the program as an argument.

Compiled stage programs are shared by every rank of a (pipeline, stage) — on simulated ranks, by
threads at once — and their communication nodes name *logical* mesh dims (``"tp"``, ``"cp"``). So the
calling rank is an argument of every call: the runtime passes a ``RankContext`` as the program's last
argument (``passes/bind_rank.py`` adds that placeholder), and each communication node receives it as
its ``rank_context`` keyword, which the custom ops take as an (opaque) argument of their schema.
Adjoints keep the context their forward saw, whatever thread autograd runs them on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch._library.opaque_object import MemberType, register_opaque_type
from torch._opaque_base import OpaqueBase

from hgraph.errors import CommunicationError
from hgraph.runtime.kernels.comm import Communicator, Group

INPUT = "rank_context"  # the name of a bound program's last placeholder


@dataclass(frozen=True, eq=False)
class RankContext(OpaqueBase):
    """Who is running: global rank, communicator, and this rank's group per mesh dim name."""

    rank: int  # the global rank
    comm: Optional[Communicator]  # None when nothing is sent (shape-only tracing, ``passes/backward.py``)
    groups: dict[str, Group] = field(default_factory=dict)  # mesh dim name -> the ranks of this rank's group

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


def required(rank_context: Any, what: str) -> RankContext:
    """``rank_context``, or the error saying that ``what`` runs only with one."""
    if not isinstance(rank_context, RankContext):
        raise CommunicationError(
            f"{what} needs the calling rank's RankContext (got {type(rank_context).__name__}): run the program "
            "through the hgraph runtime or compiled.simulate, or pass rank_context= (a bound program takes it "
            "as its last argument, passes/bind_rank.py)"
        )
    return rank_context


# A traced program (``make_fx``) reads the rank's coordinates at trace time: they are baked in.
register_opaque_type(RankContext, typ="reference", members={
    name: MemberType.USE_REAL for name in ("rank", "comm", "groups", "group", "index", "size")
})
