"""``ProcessGroupComm``: the communicator on torch.distributed (gloo on CPU, NCCL on CUDA).

Subgroups are created on first use, with ``use_local_synchronization`` so only members take part,
and cached by their rank tuple.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
from hgraph.runtime.kernels.comm import Communicator, Group, Handle
from hgraph.runtime.kernels.failures import comm_timeout

from hgraph.errors import CommunicationError


def local_device_index(rank: int) -> int:
    """This process's GPU: torchrun's ``LOCAL_RANK``, else the global rank modulo the GPUs here."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return rank % max(torch.cuda.device_count(), 1)


class ProcessGroupComm(Communicator):
    """torch.distributed primitives on global ranks, with subgroups created once and cached."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise CommunicationError(
                "torch.distributed is not initialised; run inside hgraph.launch(...) or torchrun"
            )
        self.dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.plan_calls: dict = {}
        self._groups: dict[Group, Any] = {}
        if dist.get_backend() == "nccl":
            self.device = torch.device("cuda", local_device_index(self.rank))
            torch.cuda.set_device(self.device)
        # Older torch (2.11) lacks the *_single names; the *_tensor ones take the same arguments.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def group(self, ranks: Group) -> Any:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            if len(key) == self.world_size:
                self._groups[key] = self.dist.group.WORLD
            else:
                # Subgroups default to torch's 30-minute timeout, not the world's: pass ours.
                self._groups[key] = self.dist.new_group(
                    list(key), use_local_synchronization=True, timeout=comm_timeout()
                )
        return self._groups[key]

    def _work(self, work: Any, result: Callable[[], Any]) -> Handle:
        def finish() -> Any:
            if work is not None:
                work.wait()
            return result()

        return Handle(finish, lambda: work is None or work.is_completed())

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> Handle:
        out = tensor.detach().clone().contiguous()
        work = self.dist.all_reduce(out, group=self.group(group), async_op=True)
        return self._work(work, lambda: out)

    def start_all_gather(self, tensor: torch.Tensor, group: Group) -> Handle:
        group = tuple(group)
        if list(group) != sorted(group):
            raise CommunicationError(f"all_gather needs its group in ascending rank order, got {group}")
        src = tensor.detach().contiguous()
        # gloo wants the output concatenated along dim 0: gather flat, then view as stacked.
        out = src.new_empty((len(group) * src.numel(),))
        work = self._all_gather(out, src.reshape(-1), group=self.group(group), async_op=True)
        return self._work(work, lambda: out.view((len(group),) + tuple(src.shape)))

    def start_reduce_scatter(self, stacked: torch.Tensor, group: Group) -> Handle:
        group = tuple(group)
        if list(group) != sorted(group):
            raise CommunicationError(f"reduce_scatter needs its group in ascending rank order, got {group}")
        src = stacked.detach().contiguous()
        out = src.new_empty(tuple(src.shape[1:]))
        work = self._reduce_scatter(out.view(-1), src.reshape(-1), group=self.group(group), async_op=True)
        return self._work(work, lambda: out)

    def start_all_to_all(
        self, pieces: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple[int, ...]]
    ) -> Handle:
        group = tuple(group)
        if list(group) != sorted(group):
            raise CommunicationError(f"all_to_all needs its group in ascending rank order, got {group}")
        ref = pieces[0]
        trailing = {tuple(p.shape[1:]) for p in pieces} | {tuple(s[1:]) for s in recv_shapes}
        if len(trailing) == 1 and ref.dim() > 0:
            # Pieces of one row shape, any row counts (expert dispatch): gloo's list form needs equal
            # sizes, all_to_all_single takes split sizes.
            rows = [int(s[0]) for s in recv_shapes]
            out_flat = ref.new_empty((sum(rows),) + tuple(ref.shape[1:]))
            work = self.dist.all_to_all_single(
                out_flat, torch.cat([p.contiguous() for p in pieces]), rows, [int(p.shape[0]) for p in pieces],
                group=self.group(tuple(group)), async_op=True,
            )
            return self._work(work, lambda: list(out_flat.split(rows)))
        out = [ref.new_empty(tuple(shape)) for shape in recv_shapes]
        ins = [p.contiguous() for p in pieces]
        work = self.dist.all_to_all(out, ins, group=self.group(tuple(group)), async_op=True)
        return self._work(work, lambda: out)

    def start_broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> Handle:
        out = tensor.detach().clone().contiguous()
        work = self.dist.broadcast(out, src=src, group=self.group(group), async_op=True)
        return self._work(work, lambda: out)

    def start_exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int = 0
    ) -> Handle:
        dist = self.dist
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, tag=tag) for peer, t in sends]
        staging = [(buf, buf if buf.is_contiguous() else torch.empty_like(buf)) for _, buf in recvs]
        ops += [dist.P2POp(dist.irecv, tmp, peer, tag=tag) for (peer, _), (_, tmp) in zip(recvs, staging)]
        works = dist.batch_isend_irecv(ops) if ops else []

        def finish() -> None:
            for work in works:
                work.wait()
            for buf, tmp in staging:
                if tmp is not buf:
                    buf.copy_(tmp)

        return Handle(finish, lambda: all(work.is_completed() for work in works))
