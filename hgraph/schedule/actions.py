"""The action IR of one rank's iteration: what it computes and communicates, in order, as data.

Every schedule is a *lowering* into a list of ``Action``s per rank (as ``torch.distributed.pipelining``
does with ``_Action``): the lowerings and their registry are ``hgraph.schedule.lowerings``; one
executor (``runtime/executor.py``) interprets the list, one dry run (``hgraph.schedule.replay``)
checks the lists of all ranks against each other before anything runs.

String form (``str(action)``, parsed back by ``parse``), ``m`` the micro-batch, ``c`` the chunk
(virtual stage on this rank, 0 without interleaving), ``r`` the peer rank::

    c.mF  c.mB  c.mI  c.mW                 forward, backward, input-grad half, weight-grad half
    c.mSEND_ACT>r  c.mRECV_ACT<r           activations to the next / from the previous stage
    c.mSEND_GRAD>r c.mRECV_GRAD<r          activation gradients to the previous / from the next stage
    PULL_START:name PULL_WAIT:name PUSH_START:name PUSH_WAIT:name OPTIMIZER
    PULL_WAIT:name@p  PUSH_START:name@b    attached: inside the compute action before them

An *attached* action (``at`` set; only under ``schedule="overlap"``, placed by
``hgraph.schedule.lowerings.place``) runs inside the compute action it follows: a pull op before the
forward's first use of parameter ``p``, a push start as soon as every gradient of its bucket (named by
its first push ``b``) is final in the backward. The dry run takes them in list order, right after that
compute action.

Consecutive SEND/RECV actions form one batched exchange (posted together, then waited), which keeps
the blocking schedules free of deadlocks with point-to-point backends. Pipeline lowerings are pure:
their peers are *stage indices*; ``with_peers`` maps them to ranks.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from hgraph.errors import HGraphError


class ScheduleError(HGraphError):
    """A schedule is malformed, would deadlock, or ranks disagree on the order of their communication."""


class Kind(enum.Enum):
    """What an action does; the value is its string form."""

    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients together
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    PULL_START = "PULL_START"
    PULL_WAIT = "PULL_WAIT"
    PUSH_START = "PUSH_START"
    PUSH_WAIT = "PUSH_WAIT"
    OPTIMIZER = "OPTIMIZER"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
P2P = frozenset({Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD})
PARAMETER = frozenset({Kind.PULL_START, Kind.PULL_WAIT, Kind.PUSH_START, Kind.PUSH_WAIT})
SENDS = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}  # send -> its receive


@dataclass(frozen=True)
class Action:
    """One step of a rank: ``kind`` on micro-batch ``mb`` of chunk ``chunk``; ``peer`` for SEND/RECV,
    ``group`` (a parameter name) for PULL/PUSH; ``at`` for an action attached to the compute before it."""

    kind: Kind
    mb: Optional[int] = None
    chunk: int = 0
    peer: Optional[int] = None
    group: Optional[str] = None
    at: Optional[str] = None

    def __str__(self) -> str:
        if self.kind in PARAMETER:
            return f"{self.kind.value}:{self.group}" + ("" if self.at is None else f"@{self.at}")
        if self.kind is Kind.OPTIMIZER:
            return "OPTIMIZER"
        text = f"{self.chunk}.{self.mb}{self.kind.value}"
        if self.kind in P2P:
            text += (">" if self.kind in SENDS else "<") + str(self.peer)
        return text


_PIPE = re.compile(r"^(\d+)\.(\d+)(F|B|I|W|SEND_ACT|RECV_ACT|SEND_GRAD|RECV_GRAD)(?:([<>])(\d+))?$")


def parse(text: str) -> Action:
    """The action whose ``str`` is ``text``; raises ``ScheduleError`` on anything else."""
    text = text.strip()
    if text == "OPTIMIZER":
        return Action(Kind.OPTIMIZER)
    head, _, name = text.partition(":")
    if name and head in {k.value for k in PARAMETER}:
        group, _, at = name.partition("@")
        return Action(Kind(head), group=group, at=at or None)
    m = _PIPE.match(text)
    if m is None:
        raise ScheduleError(f"cannot parse action {text!r}; expected e.g. '0.3F', '0.1SEND_ACT>2', 'PULL_START:w'")
    chunk, mb, kind, arrow, peer = m.groups()
    action = Action(Kind(kind), int(mb), int(chunk), None if peer is None else int(peer))
    if (action.kind in P2P) != (arrow is not None) or (arrow and (arrow == ">") != (action.kind in SENDS)):
        raise ScheduleError(f"action {text!r}: sends take '>peer', receives '<peer', compute actions no peer")
    return action


def format_actions(actions: Sequence[Action]) -> str:
    """The readable per-rank listing: one line per step, batched exchanges on one line."""
    return "\n".join(f"{i:3d}  " + " + ".join(map(str, step)) for i, step in enumerate(steps(actions)))


def steps(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """``actions`` grouped as they run: each maximal run of SEND/RECV is one exchange, others alone."""
    out: list[tuple[Action, ...]] = []
    for a in actions:
        if a.kind in P2P and out and out[-1][0].kind in P2P:
            out[-1] += (a,)
        else:
            out.append((a,))
    return out


# ----------------------------------------------------------------------------- peers
def pipeline_peers(pipeline_ranks: Sequence[int], pp: int, rank: int) -> Callable[[int], int]:
    """Rank of the same mesh position as ``rank`` on physical stage ``s`` of its pipeline (stage ranks
    are consecutive blocks of ``pipeline_ranks``): the one place pipeline peers are computed."""
    n = len(pipeline_ranks) // pp
    pos = pipeline_ranks.index(rank) % n
    return lambda s: pipeline_ranks[s * n + pos]


def with_peers(actions: Sequence[Action], peer_rank: Callable[[int], int]) -> list[Action]:
    """``actions`` with their stage-index peers replaced by ranks."""
    return [a if a.peer is None else replace(a, peer=peer_rank(a.peer)) for a in actions]


def wrapped_chunk(pp: int, stage: int, send: Action) -> int:
    """The receiver's chunk of a send of physical ``stage``: activations leaving the last stage enter
    the next chunk on stage 0; gradients leaving stage 0 enter the previous chunk on the last stage."""
    if send.kind is Kind.SEND_ACT and stage == pp - 1:
        return send.chunk + 1
    if send.kind is Kind.SEND_GRAD and stage == 0:
        return send.chunk - 1
    return send.chunk
