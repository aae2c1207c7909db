"""Run a ``ReshardPlan`` on the calling rank: the one interpreter of plan steps.

Every rank of the plan calls ``execute(plan, local, comm)`` with its source tensor (``None`` when it holds
none) and gets its destination tensor back (``None`` when it is not a destination); ``start`` is the
asynchronous form (a handle whose ``wait()`` returns the same). The same code
runs on real processes (``ProcessGroupComm``) and on simulated ranks (``ThreadComm``;
``hgraph.runtime.kernels.simulate``). Gloo needs equal sizes in all_gather/reduce_scatter, so uneven chunks are
padded to the largest one and trimmed after; the plan's byte counts stay the logical ones.
"""

from __future__ import annotations

from typing import Any, Generator, Optional

import torch

from hgraph.errors import CommunicationError
from hgraph.core.layout import Box, box_numel
from hgraph.lnk.plan import AllGather, AllReduce, AllToAll, LocalCopy, ReduceScatter, ReshardPlan, Transfer
from hgraph.runtime.kernels.comm import Communicator, Handle


def _view(tensor: torch.Tensor, box: Box, region: Box) -> torch.Tensor:
    """The part of a local tensor (covering global ``region``) that holds global ``box``."""
    return tensor[tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(box, region))]


class _Local:
    """A rank's local tensor of a layout: global boxes -> views (several regions when interleaved)."""

    def __init__(self, tensor: Optional[torch.Tensor], layout: Any, rank: int) -> None:
        self.tensor, self.layout, self.rank = tensor, layout, rank

    def __getitem__(self, box: Box) -> torch.Tensor:
        assert self.tensor is not None
        return self.tensor[self.layout.local_index(self.rank, box)]


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def execute(
    plan: ReshardPlan,
    local: Optional[torch.Tensor],
    comm: Communicator,
    *,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> Optional[torch.Tensor]:
    """This rank's part of ``plan``: returns its destination tensor (``None`` if it has none).

    ``dtype`` and ``device`` matter only on ranks that hold no source tensor (default: torch's default
    dtype, CPU); elsewhere the output follows ``local``.
    """
    return start(plan, local, comm, dtype=dtype, device=device).wait()


def start(
    plan: ReshardPlan,
    local: Optional[torch.Tensor],
    comm: Communicator,
    *,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
    tag: int = 0,
) -> Handle:
    """Start ``plan`` on this rank; ``handle.wait()`` returns what ``execute`` returns.

    The start issues this rank's part of the plan's *first round* (``ReshardPlan.first_round``); later steps
    depend on earlier results and are issued inside ``wait``, in plan order. A step is thus issued at
    the start on all its members or at the wait on all of them, so every rank sees the same order
    on a group as long as all start (and wait) their plans in one order.
    ``local`` must stay unchanged until the wait. Point-to-point steps use ``tag``, so plans in
    flight together with other point-to-point traffic (started in another order) match apart.
    """
    steps = run_steps(plan, local, comm, dtype, device, tag)
    try:
        pending = next(steps)
    except StopIteration as stop:
        return Handle.completed(stop.value)
    calls = comm_steps(plan, comm.rank, comm.plan_calls)
    # With a single call, issued here, the rest of the plan is local work: ready when the call is.
    ready = pending.ready if len(calls) == 1 and calls[0][0] else None

    def finish() -> Optional[torch.Tensor]:
        nonlocal pending
        while True:
            result = pending.wait()
            try:
                pending = steps.send(result)
            except StopIteration as stop:
                return stop.value

    return Handle(finish, ready)


def comm_steps(plan: ReshardPlan, rank: int, cache: Optional[dict] = None) -> tuple[tuple, ...]:
    """The communication calls ``rank`` issues for ``plan``, in order, as the interpreter batches them:
    ``(at_start, ("collective", kind, group))`` or ``(at_start, ("p2p", send peers, receive peers))``;
    ``at_start``: issued by ``start`` rather than by ``wait``. Used by dry runs.
    ``cache``: where to keep the lists (``Communicator.plan_calls``: ``start`` runs a plan every iteration)."""
    if plan.noop:
        return ()
    if cache is None:
        return _comm_steps(plan, rank)
    key = (id(plan), rank)
    hit = cache.get(key)
    if hit is None or hit[0] is not plan:  # the plan is kept with its list, so its id is not reused
        hit = cache[key] = (plan, _comm_steps(plan, rank))
    return hit[1]


def late_peers(plan: ReshardPlan, rank: int) -> tuple[int, ...]:
    """The ranks ``rank`` still exchanges with in ``plan`` after its start (rounds issued by ``wait``)."""
    peers: set[int] = set()
    for at_start, call in comm_steps(plan, rank):
        if not at_start:
            peers.update(call[2] if call[0] == "collective" else (*call[1], *call[2]))
    return tuple(sorted(peers - {rank}))


def _comm_steps(plan: ReshardPlan, rank: int) -> tuple[tuple, ...]:
    out: list[tuple] = []
    first = plan.first_round
    steps = plan.indexed_steps_for(rank)
    i = 0
    while i < len(steps):
        k, step = steps[i]
        at_start = not out and k in first  # the interpreter gates on the first step of the call
        if isinstance(step, Transfer):
            batch = [step]
            while i + 1 < len(steps) and getattr(steps[i + 1][1], "phase", None) == step.phase:
                i += 1
                batch.append(steps[i][1])
            sends = tuple(t.dst for t in batch if t.src == rank)
            out.append((at_start, ("p2p", sends, tuple(t.src for t in batch if t.dst == rank))))
        elif not isinstance(step, LocalCopy):
            out.append((at_start, ("collective", type(step).__name__, tuple(step.group))))
        i += 1
    return tuple(out)


def run_steps(plan, local, comm, dtype, device, tag=0) -> Generator[Handle, Any, Optional[torch.Tensor]]:
    """The interpreter: yields each started communication, receives its result, returns the output."""
    rank = comm.rank
    in_src, in_dst = rank in plan.src.ranks, rank in plan.dst.ranks
    if in_src:
        want = plan.src.local_shape(rank)
        if local is None or tuple(local.shape) != want:
            got = None if local is None else tuple(local.shape)
            raise CommunicationError(
                f"rank {rank} holds {plan.src} regions {plan.src.regions(rank)} (shape {want}) "
                f"but was given {got}"
            )
    if plan.noop:
        return local if in_dst else None
    if local is not None:
        like = local
    else:
        like = torch.empty(0, dtype=dtype or torch.get_default_dtype(), device=device)
    out = like.new_zeros(plan.dst.local_shape(rank)) if in_dst else None
    src_at = _Local(local, plan.src, rank)
    first = plan.first_round
    indexed = plan.indexed_steps_for(rank)
    steps = [s for _, s in indexed]
    issued = False
    i = 0
    while i < len(steps):
        step = steps[i]
        if not issued and not isinstance(step, LocalCopy):
            issued = True
            if indexed[i][0] not in first:
                yield Handle.completed()  # not a first-round step: issue it (and the rest) at the wait
        if isinstance(step, Transfer):
            batch = [step]
            while i + 1 < len(steps) and getattr(steps[i + 1], "phase", None) == step.phase:
                i += 1
                batch.append(steps[i])
            yield from _exchange(batch, rank, comm, src_at, _Local(out, plan.dst, rank), like, tag)
        elif isinstance(step, LocalCopy):
            target = _Local(out, plan.dst, rank)[step.box]
            source = src_at[step.box]
            if step.accumulate:
                target += source
            else:
                target.copy_(source)
        else:  # collectives are planned for single-box layouts only
            src_region = plan.src.region(rank) if in_src else None
            dst_region = plan.dst.region(rank) if in_dst else None
            out = yield from _collective(step, rank, comm, local, src_region, dst_region)
        i += 1
    return out


def _exchange(batch, rank, comm, src_at: _Local, out_at: _Local, like, tag=0):
    """One phase of point-to-point transfers: post all, then write (or add) in plan order."""
    sends, recvs, writes = [], [], []
    for t in batch:
        if t.src == rank:
            source = src_at[t.box] if t.phase == "A" else out_at[t.box]
            sends.append((t.dst, source.contiguous()))
        if t.dst == rank:
            buffer = like.new_empty(_shape(t.box))
            recvs.append((t.src, buffer))
            writes.append((t, buffer))
    yield comm.start_exchange(sends, recvs, tag)
    for t, buffer in writes:
        target = out_at[t.box]
        if t.accumulate:
            target += buffer
        else:
            target.copy_(buffer)


def _collective(step, rank, comm, local, src_region, dst_region) -> torch.Tensor:
    group = step.group
    me = group.index(rank)
    if isinstance(step, AllReduce):
        return (yield comm.start_all_reduce(local, group))
    if isinstance(step, AllToAll):
        # gloo's all_to_all needs equal sizes: send every piece flat, padded to the largest one.
        width = max(box_numel(box) for row in step.boxes for box in row)
        pieces = []
        for box in step.boxes[me]:
            flat = local.new_zeros(width)
            flat[: box_numel(box)] = _view(local, box, src_region).reshape(-1)
            pieces.append(flat)
        got = yield comm.start_all_to_all(pieces, group, [(width,)] * len(group))
        out = local.new_empty(_shape(dst_region))
        for row, flat in zip(step.boxes, got):
            box = row[me]
            _view(out, box, dst_region).copy_(flat[: box_numel(box)].view(_shape(box)))
        return out
    d = step.dim
    lengths = [hi - lo for lo, hi in step.chunks]
    width = max(lengths)
    # Fast path: equal chunks stacked in group order along dim 0 are already the concatenation.
    in_order = len(set(lengths)) == 1 and d == 0 and list(step.chunks) == sorted(step.chunks)
    if isinstance(step, AllGather):
        if len(set(lengths)) == 1:
            padded = local
        else:
            padded = local.new_zeros(local.shape[:d] + (width,) + local.shape[d + 1 :])
            padded.narrow(d, 0, lengths[me]).copy_(local)
        stacked = yield comm.start_all_gather(padded, group)
        if in_order:
            return stacked.reshape(_shape(dst_region))
        out = local.new_empty(_shape(dst_region))
        for j, (lo, hi) in enumerate(step.chunks):
            out.narrow(d, lo - dst_region[d][0], hi - lo).copy_(stacked[j].narrow(d, 0, hi - lo))
        return out
    if isinstance(step, ReduceScatter):
        if in_order:
            stacked = local.reshape((len(group), width) + local.shape[1:])
            return (yield comm.start_reduce_scatter(stacked, group))
        stacked = local.new_zeros((len(group),) + local.shape[:d] + (width,) + local.shape[d + 1 :])
        for j, (lo, hi) in enumerate(step.chunks):
            stacked[j].narrow(d, 0, hi - lo).copy_(local.narrow(d, lo - src_region[d][0], hi - lo))
        reduced = yield comm.start_reduce_scatter(stacked, group)
        return reduced.narrow(d, 0, lengths[me]).clone()
    raise CommunicationError(f"rank {rank}: unknown plan step {step!r}")
