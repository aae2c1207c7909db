"""The action IR of one rank's iteration: what it computes and communicates, in order, as data.

Every schedule is a *lowering* into a list of ``Action``s per rank (as ``torch.distributed.pipelining``
does with ``_Action``); one executor (``runtime/executor.py``) interprets the list, one dry run
(``dry_run`` here) checks the lists of all ranks against each other before anything runs.

String form (``str(action)``, parsed back by ``parse``), ``m`` the micro-batch, ``c`` the chunk
(virtual stage on this rank, 0 without interleaving), ``r`` the peer rank::

    c.mF  c.mB  c.mI  c.mW                 forward, backward, input-grad half, weight-grad half
    c.mSEND_ACT>r  c.mRECV_ACT<r           activations to the next / from the previous stage
    c.mSEND_GRAD>r c.mRECV_GRAD<r          activation gradients to the previous / from the next stage
    PULL_START:name PULL_WAIT:name PUSH_START:name PUSH_WAIT:name OPTIMIZER
    PULL_WAIT:name@p  PUSH_START:name@b    attached: inside the compute action before them

An *attached* action (``at`` set; only under ``schedule="overlap"``, lowered by ``overlap_actions``)
runs inside the compute action it follows: a pull op before the forward's first use of parameter
``p``, a push start as soon as every gradient of its bucket (named by its first push ``b``) is final
in the backward. The dry run takes them in list order, right after that compute action.

Consecutive SEND/RECV actions form one batched exchange (posted together, then waited), which keeps
the blocking schedules free of deadlocks with point-to-point backends. The pipeline lowerings here
(``one_f_one_b``, ``zero_bubble_h1``, ``interleaved_1f1b``) are pure: their peers are *stage
indices*; ``with_peers`` maps them to ranks.
"""

from __future__ import annotations

import enum
import re
from collections import defaultdict, deque
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Protocol, Sequence

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
_SENDS = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}


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
            text += (">" if self.kind in _SENDS else "<") + str(self.peer)
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
    if (action.kind in P2P) != (arrow is not None) or (arrow and (arrow == ">") != (action.kind in _SENDS)):
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


# ----------------------------------------------------------------------------- pipeline lowerings
class _Builder:
    """Appends compute and exchange actions of one physical stage, dropping the transfers that do
    not exist (nothing before the first virtual stage, nothing after the last)."""

    def __init__(self, pp: int, vpp: int, stage: int) -> None:
        self.pp, self.vpp, self.stage, self.out = pp, vpp, stage, []

    def virtual(self, chunk: int) -> int:
        return chunk * self.pp + self.stage

    def compute(self, kind: Kind, chunk: int, mb: int) -> None:
        self.out.append(Action(kind, mb, chunk))

    def comm(self, kind: Kind, chunk: int, mb: int) -> None:
        v, last = self.virtual(chunk), self.pp * self.vpp - 1
        if kind in (Kind.RECV_ACT, Kind.SEND_GRAD):
            if v == 0:
                return
            peer = (self.stage - 1) % self.pp
        else:
            if v == last:
                return
            peer = (self.stage + 1) % self.pp
        self.out.append(Action(kind, mb, chunk, peer))


def one_f_one_b(pp: int, stage: int, num_micro_batches: int) -> list[Action]:
    """1F1B: ``pp - stage - 1`` warm-up forwards, then one forward / one backward, then the rest."""
    return _one_f_one_b(pp, stage, num_micro_batches, split=False)


def zero_bubble_h1(pp: int, stage: int, num_micro_batches: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2023): 1F1B with each backward split into its input-gradient step ``I``
    (sent upstream at once) and its weight-gradient step ``W``. W steps are postponed while the
    activation memory allows (at most the ``pp - stage`` micro-batches 1F1B holds): in the steady state
    just before the next forward, in the cool-down one after each ``I``, where 1F1B waits."""
    return _one_f_one_b(pp, stage, num_micro_batches, split=True)


def _one_f_one_b(pp: int, stage: int, m: int, split: bool) -> list[Action]:
    b = _Builder(pp, 1, stage)
    warmup, limit = min(pp - stage - 1, m), pp - stage
    pending: deque[int] = deque()  # micro-batches whose I ran and whose W did not (split only)
    held = 0  # micro-batches whose forward ran and whose backward (W under split) did not

    def weight() -> None:
        nonlocal held
        b.compute(Kind.BACKWARD_WEIGHT, 0, pending.popleft())
        held -= 1

    def forward(mb: int) -> None:
        nonlocal held
        while held >= limit:
            weight()
        b.comm(Kind.RECV_ACT, 0, mb)
        b.compute(Kind.FORWARD, 0, mb)
        b.comm(Kind.SEND_ACT, 0, mb)
        held += 1

    def backward(mb: int) -> None:
        nonlocal held
        b.comm(Kind.RECV_GRAD, 0, mb)
        b.compute(Kind.BACKWARD_INPUT if split else Kind.BACKWARD, 0, mb)
        b.comm(Kind.SEND_GRAD, 0, mb)
        if split:
            pending.append(mb)
        else:
            held -= 1

    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        if pending:
            weight()
        backward(i)
    while pending:
        weight()
    return _batch_exchanges(b.out)


def interleaved_1f1b(pp: int, vpp: int, stage: int, num_micro_batches: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., 2021): physical stage ``stage`` holds chunks
    ``stage, stage + pp, ...`` of the ``pp * vpp`` virtual stages. Micro-batches go through in rounds
    of ``pp``: forward order is (round, chunk, micro-batch of round); backward order the same with the
    chunks reversed. Warm-up is ``(pp - stage - 1) * 2 + (vpp - 1) * pp`` forwards (capped), then one
    forward / one backward. Any number of micro-batches: the schedule of the next multiple of ``pp``,
    with the actions of the padding micro-batches (the last ones) left out on every stage — they cost
    nothing, and what remains waits on a subset of what the whole schedule waits on, so it completes."""
    if num_micro_batches < 1:
        raise ScheduleError(f"interleaved 1F1B needs at least one micro-batch; got {num_micro_batches}")
    padded = -(-num_micro_batches // pp) * pp
    b = _Builder(pp, vpp, stage)
    total = padded * vpp

    def order(k: int, backward: bool) -> tuple[int, int]:
        rnd, rest = divmod(k, pp * vpp)
        chunk, i = divmod(rest, pp)
        return (vpp - 1 - chunk if backward else chunk), rnd * pp + i

    warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)

    def forward(k: int) -> None:
        chunk, mb = order(k, False)
        b.comm(Kind.RECV_ACT, chunk, mb)
        b.compute(Kind.FORWARD, chunk, mb)
        b.comm(Kind.SEND_ACT, chunk, mb)

    def backward(k: int) -> None:
        chunk, mb = order(k, True)
        b.comm(Kind.RECV_GRAD, chunk, mb)
        b.compute(Kind.BACKWARD, chunk, mb)
        b.comm(Kind.SEND_GRAD, chunk, mb)

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return _batch_exchanges([a for a in b.out if a.mb < num_micro_batches])


def _batch_exchanges(actions: list[Action]) -> list[Action]:
    """Within each run of transfers, sends before receives, so a stage never waits for its own data."""
    out: list[Action] = []
    for step in steps(actions):
        out += sorted(step, key=lambda a: a.kind not in _SENDS) if step[0].kind in P2P else step
    return out


PIPELINE_SCHEDULES = {"1f1b": one_f_one_b, "zb1p": zero_bubble_h1}


def pipeline_actions(schedule: str, pp: int, vpp: int, stage: int, num_micro_batches: int) -> list[Action]:
    """The pipeline lowering ``schedule`` (``"1f1b"``, ``"zb1p"``; interleaved when ``vpp > 1``)."""
    if vpp > 1:
        return interleaved_1f1b(pp, vpp, stage, num_micro_batches)
    if schedule not in PIPELINE_SCHEDULES:
        raise ScheduleError(f"pipeline_schedule={schedule!r}; expected one of {sorted(PIPELINE_SCHEDULES)}")
    return PIPELINE_SCHEDULES[schedule](pp, stage, num_micro_batches)


def pipeline_peers(pipeline_ranks: Sequence[int], pp: int, rank: int) -> Callable[[int], int]:
    """Rank of the same mesh position as ``rank`` on physical stage ``s`` of its pipeline (stage ranks
    are consecutive blocks of ``pipeline_ranks``): the one place pipeline peers are computed."""
    n = len(pipeline_ranks) // pp
    pos = pipeline_ranks.index(rank) % n
    return lambda s: pipeline_ranks[s * n + pos]


def with_peers(actions: Sequence[Action], peer_rank: Callable[[int], int]) -> list[Action]:
    """``actions`` with their stage-index peers replaced by ranks."""
    return [a if a.peer is None else replace(a, peer=peer_rank(a.peer)) for a in actions]


def overlap_actions(
    pipeline: Sequence[Action], pulls: Sequence[str], schedule: "OverlapOrder", pushes: Sequence[str],
) -> list[Action]:
    """The ``schedule="overlap"`` lowering of one rank: ``pipeline`` (its compute and activation
    actions) with the pull/push order of ``schedule`` (a ``RankSchedule``; pull ops index ``pulls``,
    buckets index ``pushes``) placed around it: prelude pulls first; the pulls before each
    parameter's first use attached to the first forward, then the rest of the forward's pulls; push
    starts attached to the last backward, bucket by bucket; the pulls this rank only sends, then
    every push wait, at the end."""
    def ops(seq: Sequence[tuple[str, int]], at: Optional[str] = None) -> list[Action]:
        return [Action(Kind.PULL_START if w == "start" else Kind.PULL_WAIT, group=pulls[i], at=at) for w, i in seq]

    forward = ([a for name, seq in schedule.at_use for a in ops(seq, name)] + ops(schedule.after_forward))
    starts = [Action(Kind.PUSH_START, group=pushes[i], at=pushes[b[0]]) for b in schedule.buckets for i in b]
    kinds = [a.kind for a in pipeline]
    first = kinds.index(Kind.FORWARD) if Kind.FORWARD in kinds else None
    last = len(kinds) - 1 - kinds[::-1].index(Kind.BACKWARD) if Kind.BACKWARD in kinds else None
    out = ops(schedule.prelude)
    for k, a in enumerate(pipeline):
        out += [a, *(forward if k == first else []), *(starts if k == last else [])]
    out += ([] if first is not None else [replace(a, at=None) for a in forward])
    out += ([] if last is not None else [replace(a, at=None) for a in starts])
    out += ops(schedule.at_end)
    return out + [Action(Kind.PUSH_WAIT, group=pushes[i]) for b in schedule.buckets for i in b] + [Action(Kind.OPTIMIZER)]


class OverlapOrder(Protocol):
    """What ``overlap_actions`` reads of a ``hgraph.program.products.RankSchedule``."""

    prelude: tuple[tuple[str, int], ...]
    at_use: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    after_forward: tuple[tuple[str, int], ...]
    at_end: tuple[tuple[str, int], ...]
    buckets: tuple[tuple[int, ...], ...]


# ----------------------------------------------------------------------------- replay
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


# ----------------------------------------------------------------------------- dry run
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
            if a.kind in _SENDS:
                channels[(rank, a.peer, _SENDS[a.kind])].append((route(rank, a), a))
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


def wrapped_chunk(pp: int, stage: int, send: Action) -> int:
    """The receiver's chunk of a send of physical ``stage``: activations leaving the last stage enter
    the next chunk on stage 0; gradients leaving stage 0 enter the previous chunk on the last stage."""
    if send.kind is Kind.SEND_ACT and stage == pp - 1:
        return send.chunk + 1
    if send.kind is Kind.SEND_GRAD and stage == 0:
        return send.chunk - 1
    return send.chunk
