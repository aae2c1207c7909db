"""The one replay of per-rank action lists, and the dry run built on it.

``replay`` is the event loop every check and every timing shares: the dry run here (order and
deadlock checks, before anything runs) and ``hgraph.schedule.bubble`` (durations, the one
``pipeline_time``).
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Callable, Mapping, Sequence

from hgraph.schedule.actions import SENDS, Action, Kind, ScheduleError, steps, wrapped_chunk
from hgraph.schedule.lowerings import pipeline_actions


def replay(
    programs: Mapping[int, Sequence[tuple[Action, ...]]],
    post: Callable[[int, tuple[Action, ...]], None],
    ready: Callable[[int, tuple[Action, ...]], bool],
    complete: Callable[[int, tuple[Action, ...]], None],
) -> dict[int, int]:
    """The one event loop over per-rank step lists (``steps``), shared by the dry run (order checks)
    and ``hgraph.schedule.bubble`` (durations): every rank runs its steps in order; when a rank reaches
    a step, ``post(rank, step)`` once (its sends leave); the step runs once ``ready(rank, step)``, then
    ``complete(rank, step)``. Ranks take turns until none moves. Returns the step each rank stopped at
    (its list's length when it finished)."""
    pos = dict.fromkeys(programs, 0)
    posted = dict.fromkeys(programs, False)
    progress = True
    while progress:
        progress = False
        for rank, program in programs.items():
            while pos[rank] < len(program):
                step = program[pos[rank]]
                if not posted[rank]:
                    post(rank, step)
                    posted[rank] = progress = True
                if not ready(rank, step):
                    break
                complete(rank, step)
                pos[rank] += 1
                posted[rank] = False
                progress = True
    return pos


def dry_run(
    programs: Mapping[int, Sequence[Action]],
    members: Callable[[int, str], Sequence[int]] = lambda rank, group: (rank,),
    first: Callable[[int, int], bool] = lambda rank, chunk: False,
    last: Callable[[int, int], bool] = lambda rank, chunk: False,
    route: Callable[[int, Action], int] = lambda rank, action: action.chunk,
    late: Callable[[int, Action], Sequence[int]] = lambda rank, action: (),
) -> None:
    """Run every rank's action list against the others; raise ``ScheduleError`` naming the rank, the
    action and the peer on a deadlock or a mismatched order.

    Exchanges post their sends, then wait for each receive: a receive matches the next message on
    its (sender, receiver, kind) channel, which must be the same micro-batch and chunk. A PULL/PUSH
    start is a collective over ``members(rank, group)``: every member must start the same groups in
    the same order; its wait completes once all members started it. Compute needs its inputs: a
    forward the received activation (unless ``first(rank, chunk)``), a backward its forward and the
    received gradient (unless ``last(rank, chunk)``), a weight step its input step. ``late(rank, wait)``:
    the peers a wait still exchanges with (plan rounds issued at the wait); it completes once each of
    them has reached its own wait of that group.
    """
    step_lists = {r: steps(a) for r, a in programs.items()}
    channels: dict[tuple[int, int, Kind], deque] = defaultdict(deque)
    started: dict[tuple[int, ...], dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    done: dict[int, set] = defaultdict(set)
    reached: dict[int, set[str]] = defaultdict(set)  # the waits a rank has arrived at

    def post(rank: int, step: tuple[Action, ...]) -> None:
        for a in step:
            if a.kind in (Kind.PULL_WAIT, Kind.PUSH_WAIT):
                reached[rank].add(f"{a.kind.value}:{a.group}")
            if a.kind in SENDS:
                channels[(rank, a.peer, SENDS[a.kind])].append((route(rank, a), a))
            elif a.kind in (Kind.PULL_START, Kind.PUSH_START):
                group = tuple(sorted(members(rank, a.group)))
                log = started[group]
                slot = len(log[rank])
                log[rank].append(f"{a.kind.value}:{a.group}")
                for other, seq in log.items():
                    if len(seq) > slot and seq[slot] != log[rank][slot]:
                        raise ScheduleError(
                            f"collective order mismatch on ranks {list(group)} at position {slot}: rank {rank} "
                            f"starts {a}, rank {other} starts {seq[slot]}"
                        )

    def ready(rank: int, a: Action) -> bool:
        key = (a.chunk, a.mb)
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            q = channels[(a.peer, rank, a.kind)]
            if q and (q[0][1].mb, q[0][0]) != (a.mb, a.chunk):
                raise ScheduleError(
                    f"point-to-point order mismatch: rank {rank} waits at {a} but rank {a.peer} sent "
                    f"{q[0][1]} first"
                )
            return bool(q)
        if a.kind is Kind.FORWARD:
            return first(rank, a.chunk) or (Kind.RECV_ACT, key) in done[rank]
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            has_grad = last(rank, a.chunk) or (Kind.RECV_GRAD, key) in done[rank]
            return (Kind.FORWARD, key) in done[rank] and has_grad
        if a.kind is Kind.BACKWARD_WEIGHT:
            return (Kind.BACKWARD_INPUT, key) in done[rank]
        if a.kind in (Kind.PULL_WAIT, Kind.PUSH_WAIT):
            start = Kind.PULL_START if a.kind is Kind.PULL_WAIT else Kind.PUSH_START
            group = tuple(sorted(members(rank, a.group)))
            if f"{start.value}:{a.group}" not in started[group][rank]:
                raise ScheduleError(f"rank {rank}: {a} before its {start.value}")
            slot = started[group][rank].index(f"{start.value}:{a.group}")
            peers_there = all(f"{a.kind.value}:{a.group}" in reached[p] for p in late(rank, a))
            return peers_there and all(len(started[group][m]) > slot for m in group)
        return True

    def complete(rank: int, step: tuple[Action, ...]) -> None:
        for a in step:
            if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                channels[(a.peer, rank, a.kind)].popleft()
            done[rank].add((a.kind, (a.chunk, a.mb)))

    pos = replay(step_lists, post, lambda rank, step: all(ready(rank, a) for a in step), complete)
    stuck = {r: step_lists[r][pos[r]] for r in programs if pos[r] < len(step_lists[r])}
    if stuck:
        detail = "; ".join(
            f"rank {r} waits at {' + '.join(map(str, s))}"
            + "".join(f" (peer rank {a.peer})" for a in s if a.peer is not None)
            for r, s in sorted(stuck.items())
        )
        raise ScheduleError(f"schedule deadlocks: {detail}")
    leftover = [f"{a} from rank {src}" for (src, _, _), q in channels.items() for _, a in q]
    if leftover:
        raise ScheduleError(f"schedule leaves messages nobody receives: {', '.join(leftover)}")


def dry_run_pipeline(schedule: str, pp: int, vpp: int, num_micro_batches: int) -> None:
    """Dry-run the pure pipeline lowering on its ``pp`` physical stages (stage index = rank)."""
    programs = {s: pipeline_actions(schedule, pp, vpp, s, num_micro_batches) for s in range(pp)}
    dry_run(programs, first=lambda s, c: c * pp + s == 0, last=lambda s, c: c * pp + s == pp * vpp - 1,
            route=lambda s, a: wrapped_chunk(pp, s, a))
