"""Pipeline time and bubble of one pipeline under each schedule: the one ``pipeline_time`` and the
timed replay under it.

``replay_time(forward, backward, pp=.., schedule=..)`` replays a lowering's action lists
(``hgraph.schedule.lowerings.LOWERINGS``: the same lowerings the runtime executes, run by the same
event loop as the dry run, ``hgraph.schedule.replay.replay``) with the given durations: every physical
stage runs its actions in order; a receive waits for the matching send (plus ``p2p`` ms); sends never
wait. ``forward[v][m]`` / ``backward[v][m]`` are the ms of micro-batch ``m`` on virtual stage ``v``
(``pp * vpp`` rows; ``v = chunk * pp + stage``; ``vpp = 1``: one row per stage). Under ``"zb1p"`` a
backward is split into its input-gradient part (``1 - weight_share`` of it) and its weight-gradient
part (``weight_share``). For ``pp`` stages of equal time and V equal micro-batches of cost C, 1F1B gives
``C * (pp - 1 + V)`` (DESIGN A5).

``pipeline_time(stage_times, pp, schedule, vpp)`` is what the planner predicts with: 1F1B in closed
form, ``Σ T + (pp − 1)·max T``; ZB-H1 and interleaved 1F1B (``vpp > 1``) by ``replay_time``, forward
a third of a stage time, each chunk ``1/vpp`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hgraph.errors import PlanError
from hgraph.schedule.actions import Action, Kind, ScheduleError, steps, wrapped_chunk
from hgraph.schedule.lowerings import INTERLEAVED, LOWERINGS, lowering_name
from hgraph.schedule.replay import replay

FORWARD_SHARE = 1.0 / 3.0  # forward's share of a micro-batch's stage time (backward ~ 2x forward)


@dataclass(frozen=True)
class PipelineTime:
    """Predicted time of one pipeline's iteration (ms) and the idle share of its stages."""

    total: float
    busy: tuple[float, ...]  # compute ms per physical stage

    @property
    def bubble(self) -> float:
        """Idle fraction: ``1 - mean(busy) / total``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.total) if self.total else 0.0

    def __str__(self) -> str:
        return f"pipeline {self.total:.3f} ms, bubble {self.bubble:.1%}"


def replay_time(
    forward: Sequence[Sequence[float]],
    backward: Sequence[Sequence[float]],
    *,
    pp: int | None = None,
    schedule: str = "1f1b",
    weight_share: float = 0.5,
    p2p: float = 0.0,
) -> PipelineTime:
    """Time of one iteration of a pipeline under the lowering ``schedule`` (a ``LOWERINGS`` name:
    ``"1f1b"``, ``"zb1p"``, ``"interleaved"``); see the module docstring for the inputs."""
    pp = len(forward) if pp is None else pp
    if schedule not in LOWERINGS:
        raise PlanError(f"schedule {schedule!r}; expected one of {', '.join(LOWERINGS)}")
    if len(forward) != len(backward) or not forward or len(forward) % pp:
        raise PlanError(f"need pp * vpp rows of forward and backward times; got {len(forward)} and "
                        f"{len(backward)} rows for pp={pp}")
    vpp = len(forward) // pp
    if (vpp > 1) != (schedule == INTERLEAVED):
        raise PlanError(f"schedule {schedule!r} with {vpp} chunks per stage; 'interleaved' needs vpp > 1, others 1")
    m = len(forward[0])
    if any(len(row) != m for row in [*forward, *backward]):
        raise PlanError("every virtual stage needs a time for every micro-batch")
    if not 0.0 <= weight_share <= 1.0:
        raise PlanError(f"weight_share={weight_share}; expected a fraction in [0, 1]")
    try:
        programs = [steps(LOWERINGS[schedule](pp, vpp, s, m)) for s in range(pp)]
    except ScheduleError as exc:
        raise PlanError(str(exc)) from None

    def duration(stage: int, kind: Kind, chunk: int, mb: int) -> float:
        v = chunk * pp + stage
        if kind is Kind.FORWARD:
            return forward[v][mb]
        share = {Kind.BACKWARD: 1.0, Kind.BACKWARD_INPUT: 1.0 - weight_share, Kind.BACKWARD_WEIGHT: weight_share}
        return backward[v][mb] * share[kind]

    clock, busy = [0.0] * pp, [0.0] * pp
    arrival: dict[tuple[Kind, int, int, int], float] = {}  # (receive kind, receiver, chunk, mb) -> ms
    receive = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}

    def receives(s: int, step: tuple[Action, ...]) -> list[tuple[Kind, int, int, int]]:
        return [(a.kind, s, a.chunk, a.mb) for a in step if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)]

    def post(s: int, step: tuple[Action, ...]) -> None:  # sends leave at once
        for a in step:
            if a.kind in receive:
                arrival[(receive[a.kind], a.peer, wrapped_chunk(pp, s, a), a.mb)] = clock[s] + p2p

    def complete(s: int, step: tuple[Action, ...]) -> None:
        clock[s] = max([clock[s], *(arrival[key] for key in receives(s, step))])
        head = step[0]
        if head.kind not in receive and head.kind not in (Kind.RECV_ACT, Kind.RECV_GRAD):
            t = duration(s, head.kind, head.chunk, head.mb)
            clock[s] += t
            busy[s] += t

    pos = replay(dict(enumerate(programs)), post,
                 lambda s, step: all(key in arrival for key in receives(s, step)), complete)
    if any(pos[s] < len(prog) for s, prog in enumerate(programs)):
        raise PlanError(f"schedule {schedule!r} does not complete for pp={pp}, vpp={vpp}, {m} micro-batches")
    return PipelineTime(max(clock), tuple(busy))


def pipeline_time(stage_times: Sequence[float], pp: int, schedule: str = "1f1b", vpp: int = 1) -> float:
    """A pipeline's time from its micro-batches' per-stage times (0 when idle) under the user's
    ``schedule`` with ``vpp`` virtual stages per stage: the one place the schedule's bubble enters a
    prediction (see the module docstring)."""
    if not stage_times:
        return 0.0
    try:
        name = lowering_name(schedule, vpp)
    except ScheduleError as exc:
        raise PlanError(str(exc)) from None
    if name == "1f1b":
        return sum(stage_times) + (pp - 1) * max(stage_times)
    forward = [[t * FORWARD_SHARE / vpp for t in stage_times]] * (pp * vpp)
    backward = [[t * (1 - FORWARD_SHARE) / vpp for t in stage_times]] * (pp * vpp)
    return replay_time(forward, backward, pp=pp, schedule=name).total
