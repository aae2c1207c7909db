"""Run a ``ReshardPlan`` on the calling rank: the one interpreter of plan steps.

Every rank of the plan calls ``execute(plan, local)`` with its source tensor (``None`` when it holds
none) and gets its destination tensor back (``None`` when it is not a destination). The same code
runs on real processes (``ProcessGroupComm``, the default) and on simulated ranks (``ThreadComm``;
``hgraph.lnk.simulate``). Gloo needs equal sizes in all_gather/reduce_scatter, so uneven chunks are
padded to the largest one and trimmed after; the plan's byte counts stay the logical ones.
"""

from __future__ import annotations

from typing import Optional

import torch

from hgraph.errors import CommunicationError
from hgraph.layout import Box, box_numel
from hgraph.lnk.plan import AllGather, AllReduce, AllToAll, LocalCopy, ReduceScatter, ReshardPlan, Transfer
from hgraph.runtime.comm import Communicator, ProcessGroupComm

_default_comm: Optional[ProcessGroupComm] = None


def default_comm() -> ProcessGroupComm:
    """The process-wide torch.distributed communicator (created once, so subgroups are reused)."""
    global _default_comm
    if _default_comm is None:
        _default_comm = ProcessGroupComm()
    return _default_comm


def _view(tensor: torch.Tensor, box: Box, region: Box) -> torch.Tensor:
    """The part of a local tensor (covering global ``region``) that holds global ``box``."""
    return tensor[tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(box, region))]


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def execute(
    plan: ReshardPlan,
    local: Optional[torch.Tensor],
    comm: Optional[Communicator] = None,
    *,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> Optional[torch.Tensor]:
    """This rank's part of ``plan``: returns its destination tensor (``None`` if it has none).

    ``dtype`` and ``device`` matter only on ranks that hold no source tensor (default: torch's default
    dtype, CPU); elsewhere the output follows ``local``.
    """
    comm = comm or default_comm()
    rank = comm.rank
    in_src, in_dst = rank in plan.src.ranks, rank in plan.dst.ranks
    src_region = plan.src.region(rank) if in_src else None
    if in_src:
        if local is None or tuple(local.shape) != _shape(src_region):
            got = None if local is None else tuple(local.shape)
            raise CommunicationError(
                f"rank {rank} holds {plan.src} region {src_region} (shape {_shape(src_region)}) "
                f"but was given {got}"
            )
    if plan.noop:
        return local if in_dst else None
    dst_region = plan.dst.region(rank) if in_dst else None
    if local is not None:
        like = local
    else:
        like = torch.empty(0, dtype=dtype or torch.get_default_dtype(), device=device)
    out = like.new_zeros(_shape(dst_region)) if in_dst else None
    steps = plan.steps_for(rank)
    i = 0
    while i < len(steps):
        step = steps[i]
        if isinstance(step, Transfer):
            batch = [step]
            while i + 1 < len(steps) and getattr(steps[i + 1], "phase", None) == step.phase:
                i += 1
                batch.append(steps[i])
            _exchange(batch, rank, comm, local, src_region, out, dst_region, like)
        elif isinstance(step, LocalCopy):
            target = _view(out, step.box, dst_region)
            source = _view(local, step.box, src_region)
            if step.accumulate:
                target += source
            else:
                target.copy_(source)
        else:
            out = _collective(step, rank, comm, local, src_region, dst_region)
        i += 1
    return out


def _exchange(batch, rank, comm, local, src_region, out, dst_region, like) -> None:
    """One phase of point-to-point transfers: post all, then write (or add) in plan order."""
    sends, recvs, writes = [], [], []
    for t in batch:
        if t.src == rank:
            source = _view(local, t.box, src_region) if t.phase == "A" else _view(out, t.box, dst_region)
            sends.append((t.dst, source.contiguous()))
        if t.dst == rank:
            buffer = like.new_empty(_shape(t.box))
            recvs.append((t.src, buffer))
            writes.append((t, buffer))
    comm.exchange(sends, recvs)
    for t, buffer in writes:
        target = _view(out, t.box, dst_region)
        if t.accumulate:
            target += buffer
        else:
            target.copy_(buffer)


def _collective(step, rank, comm, local, src_region, dst_region) -> torch.Tensor:
    group = step.group
    me = group.index(rank)
    if isinstance(step, AllReduce):
        return comm.all_reduce(local, group)
    if isinstance(step, AllToAll):
        # gloo's all_to_all needs equal sizes: send every piece flat, padded to the largest one.
        width = max(box_numel(box) for row in step.boxes for box in row)
        pieces = []
        for box in step.boxes[me]:
            flat = local.new_zeros(width)
            flat[: box_numel(box)] = _view(local, box, src_region).reshape(-1)
            pieces.append(flat)
        got = comm.all_to_all(pieces, group, [(width,)] * len(group))
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
        stacked = comm.all_gather(padded, group)
        if in_order:
            return stacked.reshape(_shape(dst_region))
        out = local.new_empty(_shape(dst_region))
        for j, (lo, hi) in enumerate(step.chunks):
            out.narrow(d, lo - dst_region[d][0], hi - lo).copy_(stacked[j].narrow(d, 0, hi - lo))
        return out
    if isinstance(step, ReduceScatter):
        if in_order:
            return comm.reduce_scatter(local.reshape((len(group), width) + local.shape[1:]), group)
        stacked = local.new_zeros((len(group),) + local.shape[:d] + (width,) + local.shape[d + 1 :])
        for j, (lo, hi) in enumerate(step.chunks):
            stacked[j].narrow(d, 0, hi - lo).copy_(local.narrow(d, lo - src_region[d][0], hi - lo))
        return comm.reduce_scatter(stacked, group).narrow(d, 0, lengths[me]).clone()
    raise CommunicationError(f"rank {rank}: unknown plan step {step!r}")
