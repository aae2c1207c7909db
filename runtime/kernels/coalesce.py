"""Coalesced execution of several ``ReshardPlan``s: one communication call per group and kind.

Pulling (or pushing) one layer's parameters one plan each issues O(parameters) collectives; here the
plans of a bucket (one layer) run together. Every plan's *first* call on this rank (``reshard.start``
issues exactly that one at its start) is deferred, and the deferred calls are merged:

* all point-to-point exchanges into one ``start_exchange`` whose message to each peer is the flat
  concatenation, in plan order, of that peer's messages of every plan;
* all-gathers, reduce-scatters and all-reduces on the same group into one call on the flat
  concatenation of the plans' tensors (reduce-scatter: concatenated per destination member), split
  back afterwards;
* anything else (all-to-all) is issued as it is, in plan order.

Merging is consistent across ranks because a plan's first call is rank-independent: every member of a
first-round step has that step as its first call (``ReshardPlan.first_round``), and both ends of a transfer
see it in the same phase. Steps after the first run plan by plan, in bucket order, as ``execute``
would run them. Results equal the uncoalesced run; the simulated communicator (``ThreadComm``) sums
each element in rank order either way, so they are bit-identical there and for point-to-point plans
(partial sums are added in plan order by the receiver); a real backend's reduction of a longer buffer
may order an element's additions differently (last-bit differences).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from hgraph.runtime.kernels.comm import Communicator, Group, Handle
from hgraph.runtime.kernels.reshard import run_steps

_MERGED = ("all_gather", "reduce_scatter", "all_reduce")


class _Deferred(Handle):
    """A call recorded by ``_Recorder``; its result is filled in when the merged call completes."""

    def __init__(self, kind: str, args: tuple) -> None:
        super().__init__(self._resolve)
        self.kind, self.args = kind, args
        self.source: Optional[Handle] = None
        self.split: Any = None

    def _resolve(self) -> Any:
        assert self.source is not None, "a deferred call was waited before its bucket was flushed"
        return self.split(self.source.wait())


class _Recorder(Communicator):
    """Records the first call of every plan instead of issuing it (``flush`` issues them merged)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.device, self.plan_calls = comm.device, comm.plan_calls
        self.calls: list[_Deferred] = []
        self.recording = True

    def _call(self, kind: str, *args: Any) -> Handle:
        if not self.recording:
            return getattr(self.comm, f"start_{kind}")(*args)
        call = _Deferred(kind, args)
        self.calls.append(call)
        return call

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> Handle:
        return self._call("all_reduce", tensor, group)

    def start_all_gather(self, tensor: torch.Tensor, group: Group) -> Handle:
        return self._call("all_gather", tensor, group)

    def start_reduce_scatter(self, stacked: torch.Tensor, group: Group) -> Handle:
        return self._call("reduce_scatter", stacked, group)

    def start_all_to_all(self, pieces: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple]) -> Handle:
        return self._call("all_to_all", pieces, group, recv_shapes)

    def start_broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> Handle:
        return self._call("broadcast", tensor, src, group)

    def start_exchange(self, sends: Sequence, recvs: Sequence, tag: int = 0) -> Handle:
        return self._call("exchange", sends, recvs, tag)

    def flush(self) -> None:
        """Issue the recorded calls merged (module docstring), then pass later calls through."""
        self.recording = False
        calls, self.calls = self.calls, []
        exchanges = [c for c in calls if c.kind == "exchange"]
        if exchanges:
            self._exchange(exchanges)
        groups: dict[tuple[str, Group], list[_Deferred]] = {}
        for c in calls:
            if c.kind in _MERGED:
                groups.setdefault((c.kind, c.args[-1]), []).append(c)
            elif c.kind != "exchange":
                c.source, c.split = getattr(self.comm, f"start_{c.kind}")(*c.args), lambda r: r
        for (kind, group), members in groups.items():
            self._collective(kind, group, members)

    def _collective(self, kind: str, group: Group, calls: list[_Deferred]) -> None:
        tensors = [c.args[0] for c in calls]
        if kind == "reduce_scatter":  # [n, ...] each: concatenate per destination member
            n = len(group)
            flat = torch.cat([t.reshape(n, -1) for t in tensors], dim=1)
            sizes = [t[0].numel() for t in tensors]
            shapes = [t.shape[1:] for t in tensors]
        else:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            sizes = [t.numel() for t in tensors]
            shapes = [t.shape for t in tensors]
        handle = getattr(self.comm, f"start_{kind}")(flat, group)
        offset = 0
        for c, size, shape in zip(calls, sizes, shapes):
            lo, hi = offset, offset + size
            offset = hi
            if kind == "all_gather":  # result [n, Σ]: each member's slice of this plan
                c.split = lambda r, lo=lo, hi=hi, shape=shape: r[:, lo:hi].reshape(r.shape[0], *shape)
            else:
                c.split = lambda r, lo=lo, hi=hi, shape=shape: r[..., lo:hi].reshape(shape)
            c.source = handle

    def _exchange(self, calls: list[_Deferred]) -> None:
        """One message per peer and direction: the plans' messages concatenated flat, in plan order."""
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[torch.Tensor]] = {}
        for c in calls:
            for peer, t in c.args[0]:
                sends.setdefault(peer, []).append(t)
            for peer, t in c.args[1]:
                recvs.setdefault(peer, []).append(t)
        buffers = {peer: ts[0].new_empty(sum(t.numel() for t in ts)) for peer, ts in recvs.items()}
        handle = self.comm.start_exchange(
            [(peer, torch.cat([t.reshape(-1) for t in ts])) for peer, ts in sends.items()],
            list(buffers.items()), calls[0].args[2],
        )

        def unpack(_: Any) -> None:
            for peer, ts in recvs.items():
                offset = 0
                for t in ts:
                    t.copy_(buffers[peer][offset : offset + t.numel()].view(t.shape))
                    offset += t.numel()

        done = Handle(lambda: unpack(handle.wait()))
        for c in calls:
            c.source, c.split = done, lambda r: r


def execute_coalesced(
    plans: Sequence[Any],
    locals_: Sequence[Optional[torch.Tensor]],
    comm: Communicator,
    *,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
    tag: int = 0,
) -> list[Optional[torch.Tensor]]:
    """Run ``plans[i]`` on ``locals_[i]`` together (module docstring); returns their outputs in order.

    Every rank of every plan must call this with the same plans in the same order."""
    recorder = _Recorder(comm)
    runs, pending, outputs = [], [], [None] * len(plans)
    for i, (plan, local) in enumerate(zip(plans, locals_)):
        steps = run_steps(plan, local, recorder, dtype, device, tag)
        try:
            pending.append(next(steps))
            runs.append((i, steps))
        except StopIteration as stop:
            outputs[i] = stop.value
    recorder.flush()
    for (i, steps), handle in zip(runs, pending):
        while True:
            try:
                handle = steps.send(handle.wait())
            except StopIteration as stop:
                outputs[i] = stop.value
                break
    return outputs
