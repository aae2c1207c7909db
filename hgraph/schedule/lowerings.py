"""The lowerings: one registry of pipeline schedules, name -> function, and the placement of pulls
and pushes around them.

A pipeline lowering (``Lowering``) is a pure function ``(pp, vpp, stage, num_micro_batches) -> list
of Action`` (``hgraph.schedule.actions``) for one physical stage, peers as stage indices. ``LOWERINGS``
is the one registry: ``"1f1b"``, ``"zb1p"``, ``"interleaved"`` (what a pipeline with ``vpp > 1``
runs, ``lowering_name``) and ``"forward"`` (evaluation: ``RankProgram.actions(m, mode="eval")``).
``PIPELINE_SCHEDULES`` are the names a user chooses (``ScheduleConfig.pipeline``, ``hgraph train``'s
``[compile.schedule] pipeline``), ``PLACEMENTS`` the ways pulls and pushes sit around the pipeline:
``"none"`` blocking (``blocking_order``), ``"overlap"`` (``ScheduleConfig.overlap``) the order
``hgraph.compiler.overlap_order`` emits. ``place`` puts a rank's ``PullPushOrder`` around its
pipeline actions; it is the one lowering of both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from hgraph.schedule.actions import P2P, SENDS, Action, Kind, ScheduleError, steps

Lowering = Callable[[int, int, int, int], list[Action]]  # (pp, vpp, stage, num_micro_batches) -> actions
INTERLEAVED = "interleaved"
FORWARD = "forward"  # evaluation: forwards and their activation transfers only


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


def one_f_one_b(pp: int, vpp: int, stage: int, num_micro_batches: int) -> list[Action]:
    """1F1B: ``pp - stage - 1`` warm-up forwards, then one forward / one backward, then the rest."""
    return _one_f_one_b(pp, vpp, stage, num_micro_batches, split=False)


def zero_bubble_h1(pp: int, vpp: int, stage: int, num_micro_batches: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2023): 1F1B with each backward split into its input-gradient step ``I``
    (sent upstream at once) and its weight-gradient step ``W``. W steps are postponed while the
    activation memory allows (at most the ``pp - stage`` micro-batches 1F1B holds): in the steady state
    just before the next forward, in the cool-down one after each ``I``, where 1F1B waits."""
    return _one_f_one_b(pp, vpp, stage, num_micro_batches, split=True)


def _one_f_one_b(pp: int, vpp: int, stage: int, m: int, split: bool) -> list[Action]:
    if vpp != 1:
        raise ScheduleError(f"{'zb1p' if split else '1f1b'} with vpp={vpp}; a pipeline with vpp > 1 runs "
                            f"{INTERLEAVED!r} (lowering_name)")
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


def forward_only(pp: int, vpp: int, stage: int, num_micro_batches: int) -> list[Action]:
    """Evaluation (``"forward"``): every forward of the iteration and its activation transfers, no
    backward. The forwards run in the order of the training lowerings (``interleaved_1f1b``'s rounds
    of ``pp`` micro-batches, chunk by chunk, under ``vpp > 1``; micro-batch order otherwise), so a
    stage never waits on an activation its peer computes later."""
    if num_micro_batches < 0:
        raise ScheduleError(f"the forward lowering needs a micro-batch count >= 0; got {num_micro_batches}")
    b = _Builder(pp, vpp, stage)
    padded = -(-num_micro_batches // pp) * pp
    for rnd in range(0, padded, pp):
        for chunk in range(vpp):
            for mb in range(rnd, min(rnd + pp, num_micro_batches)):
                b.comm(Kind.RECV_ACT, chunk, mb)
                b.compute(Kind.FORWARD, chunk, mb)
                b.comm(Kind.SEND_ACT, chunk, mb)
    return _batch_exchanges(b.out)


def _batch_exchanges(actions: list[Action]) -> list[Action]:
    """Within each run of transfers, sends before receives, so a stage never waits for its own data."""
    out: list[Action] = []
    for step in steps(actions):
        out += sorted(step, key=lambda a: a.kind not in SENDS) if step[0].kind in P2P else step
    return out


LOWERINGS: dict[str, Lowering] = {
    "1f1b": one_f_one_b, "zb1p": zero_bubble_h1, INTERLEAVED: interleaved_1f1b, FORWARD: forward_only,
}
PIPELINE_SCHEDULES = ("1f1b", "zb1p")  # the user's choice for vpp = 1 (the first is the default)
PLACEMENTS = ("none", "overlap")  # compile(schedule=...): blocking pulls and pushes, or the overlap order


def lowering_name(schedule: str, vpp: int) -> str:
    """The ``LOWERINGS`` entry a pipeline with ``vpp`` virtual stages per stage runs under the user's
    ``schedule``: ``"interleaved"`` when ``vpp > 1`` (the one place this rule lives), else ``schedule``."""
    if schedule not in PIPELINE_SCHEDULES:
        choices = ", ".join(PIPELINE_SCHEDULES)
        raise ScheduleError(f"pipeline_schedule={schedule!r}; expected one of {choices}")
    return INTERLEAVED if vpp > 1 else schedule


def pipeline_actions(schedule: str, pp: int, vpp: int, stage: int, num_micro_batches: int) -> list[Action]:
    """Stage ``stage``'s actions under the user's ``schedule`` (``lowering_name`` picks the lowering)."""
    return LOWERINGS[lowering_name(schedule, vpp)](pp, vpp, stage, num_micro_batches)


# ----------------------------------------------------------------------------- placing pulls and pushes
@dataclass(frozen=True)
class PullPushOrder:
    """One rank's PULL/PUSH actions in the order they run, in four places around its pipeline actions
    (``place``); the compiler emits it whole (``blocking_order``, ``hgraph.compiler.overlap_order``)."""

    prelude: tuple[Action, ...]
    """Before the pipeline's first action."""
    forward: tuple[Action, ...] = ()
    """Right after the first forward; those with ``at`` set run inside it, before the first use of
    their parameter ``at``."""
    backward: tuple[Action, ...] = ()
    """Right after the last backward; those with ``at`` set (push starts) run inside it, as soon as
    every gradient of their bucket is final."""
    end: tuple[Action, ...] = ()
    """After the pipeline's last action, before the optimizer step."""

    def __str__(self) -> str:
        return "\n".join(f"{name}: " + " ".join(map(str, getattr(self, name)))
                         for name in ("prelude", "forward", "backward", "end"))


def blocking_order(pulls: Sequence[str], pushes: Sequence[str]) -> PullPushOrder:
    """``schedule="none"``: every pull started and waited before the pipeline, every push after it."""
    return PullPushOrder(
        prelude=tuple(Action(k, group=g) for g in pulls for k in (Kind.PULL_START, Kind.PULL_WAIT)),
        end=tuple(Action(k, group=g) for g in pushes for k in (Kind.PUSH_START, Kind.PUSH_WAIT)),
    )


def place(pipeline: Sequence[Action], order: PullPushOrder) -> list[Action]:
    """A rank's whole iteration: ``pipeline`` (its compute and activation actions) with ``order``
    placed around it, then the optimizer step. Without a forward (or backward) in ``pipeline`` the
    actions of that place run, detached, after the pipeline."""
    kinds = [a.kind for a in pipeline]
    first = kinds.index(Kind.FORWARD) if Kind.FORWARD in kinds else None
    last = len(kinds) - 1 - kinds[::-1].index(Kind.BACKWARD) if Kind.BACKWARD in kinds else None
    out = list(order.prelude)
    for k, a in enumerate(pipeline):
        out += [a, *(order.forward if k == first else ()), *(order.backward if k == last else ())]
    out += [] if first is not None else [replace(a, at=None) for a in order.forward]
    out += [] if last is not None else [replace(a, at=None) for a in order.backward]
    return out + [*order.end, Action(Kind.OPTIMIZER)]
