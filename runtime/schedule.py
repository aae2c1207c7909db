"""Pipeline schedules as data: an action list per stage, printable, parsable and dry-run checked.

Actions (string form in brackets, ``m`` the micro-batch):
``F`` forward (``3F``), ``B`` backward (``3B``), ``RECV_F``/``SEND_F`` activations from/to the
previous/next stage, ``RECV_B``/``SEND_B`` activation gradients. Sends and receives posted together
form one batched exchange (``SEND_F3+RECV_B1``), which is what keeps 1F1B free of deadlocks with
blocking point-to-point backends.

``one_f_one_b(pp, stage, m)`` is the classic schedule: ``pp - stage - 1`` warm-up forwards, then
alternating forward/backward, then the remaining backwards. ``dry_run`` executes the action lists of
all stages against each other and raises ``ScheduleError`` if some stage would wait forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from hgraph.errors import HGraphError


class ScheduleError(HGraphError):
    """A pipeline schedule would deadlock or is malformed."""


@dataclass(frozen=True)
class Action:
    """One step of a stage: ``kind`` in F, B, SEND_F, RECV_F, SEND_B, RECV_B on micro-batch ``mb``."""

    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.mb}{self.kind}" if self.kind in ("F", "B") else f"{self.kind}{self.mb}"


@dataclass(frozen=True)
class Step:
    """Actions executed together: one compute action, or a batch of sends/receives posted at once."""

    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return "+".join(str(a) for a in self.actions)


def parse_step(text: str) -> Step:
    """Parse the string form of a step (``2F`` or ``SEND_F3+RECV_B1``)."""
    actions = []
    for part in text.split("+"):
        part = part.strip()
        for kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
            if part.startswith(kind):
                actions.append(Action(kind, int(part[len(kind) :])))
                break
        else:
            if part[-1:] in ("F", "B") and part[:-1].isdigit():
                actions.append(Action(part[-1], int(part[:-1])))
            else:
                raise ScheduleError(f"cannot parse schedule step {part!r}")
    return Step(tuple(actions))


def one_f_one_b(pp: int, stage: int, num_micro_batches: int) -> list[Step]:
    """The 1F1B action list of ``stage`` with batched exchanges at the steady-state boundaries."""
    m = num_micro_batches
    first, last = stage == 0, stage == pp - 1
    warmup = min(pp - stage - 1, m)
    steps: list[Step] = []

    def comm(*actions: Action) -> None:
        kept = tuple(
            a
            for a in actions
            if not ((first and a.kind in ("RECV_F", "SEND_B")) or (last and a.kind in ("SEND_F", "RECV_B")))
        )
        if kept:
            steps.append(Step(kept))

    for i in range(warmup):
        comm(Action("RECV_F", i))
        steps.append(Step((Action("F", i),)))
        comm(Action("SEND_F", i))
    remaining = m - warmup
    if remaining:
        comm(Action("RECV_F", warmup))
    for i in range(remaining):
        fwd, bwd = warmup + i, i
        steps.append(Step((Action("F", fwd),)))
        comm(Action("SEND_F", fwd), Action("RECV_B", bwd))
        steps.append(Step((Action("B", bwd),)))
        if i == remaining - 1:
            comm(Action("SEND_B", bwd))
        else:
            comm(Action("SEND_B", bwd), Action("RECV_F", fwd + 1))
    for i in range(remaining, m):
        comm(Action("RECV_B", i))
        steps.append(Step((Action("B", i),)))
        comm(Action("SEND_B", i))
    return steps


def format_schedule(steps: Sequence[Step]) -> str:
    return " ".join(str(s) for s in steps)


def dry_run(schedules: Sequence[Sequence[Step]]) -> None:
    """Execute every stage's steps against the others; raise ``ScheduleError`` on a deadlock.

    A step first posts all its sends (they never block), then waits until each of its receives can
    complete, i.e. the matching send was posted (messages between two stages match in order). A stage blocks on a step until all
    its receives can complete. Forward of ``m`` needs its activation received (or stage 0); backward
    of ``m`` needs its own forward and the gradient (or the last stage).
    """
    pp = len(schedules)
    pos = [0] * pp
    channels: dict[tuple[int, int, str], deque] = {}
    done_f: list[set[int]] = [set() for _ in range(pp)]
    got: list[set[tuple[str, int]]] = [set() for _ in range(pp)]

    def channel(src: int, dst: int, kind: str) -> deque:
        return channels.setdefault((src, dst, kind), deque())

    posted = [False] * pp  # whether the sends of the current step went out already
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            if pos[s] >= len(schedules[s]):
                continue
            step = schedules[s][pos[s]]
            if not posted[s]:
                for a in step.actions:
                    if a.kind == "SEND_F":
                        channel(s, s + 1, "F").append(a.mb)
                    elif a.kind == "SEND_B":
                        channel(s, s - 1, "B").append(a.mb)
                posted[s] = True
                progress = True
            ready = True
            for a in step.actions:
                if a.kind == "RECV_F":
                    q = channel(s - 1, s, "F")
                    ready &= bool(q) and q[0] == a.mb
                elif a.kind == "RECV_B":
                    q = channel(s + 1, s, "B")
                    ready &= bool(q) and q[0] == a.mb
                elif a.kind == "F":
                    ready &= s == 0 or ("F", a.mb) in got[s]
                elif a.kind == "B":
                    ready &= a.mb in done_f[s] and (s == pp - 1 or ("B", a.mb) in got[s])
            if not ready:
                continue
            for a in step.actions:
                if a.kind == "RECV_F":
                    channel(s - 1, s, "F").popleft()
                    got[s].add(("F", a.mb))
                elif a.kind == "RECV_B":
                    channel(s + 1, s, "B").popleft()
                    got[s].add(("B", a.mb))
                elif a.kind == "F":
                    done_f[s].add(a.mb)
            pos[s] += 1
            posted[s] = False
            progress = True
    stuck = [s for s in range(pp) if pos[s] < len(schedules[s])]
    if stuck:
        detail = "; ".join(f"stage {s} waits at {schedules[s][pos[s]]}" for s in stuck)
        raise ScheduleError(f"pipeline schedule deadlocks: {detail}")
    leftover = {k: list(v) for k, v in channels.items() if v}
    if leftover:
        raise ScheduleError(f"pipeline schedule leaves unreceived messages: {leftover}")
