"""Communicators: the interface of the few collective and point-to-point primitives hgraph programs use.

Two implementations share it, so every program and reshard plan runs unchanged on real processes and
on simulated ranks: ``process_group_comm.ProcessGroupComm`` (torch.distributed: gloo on CPU, NCCL on
CUDA) and ``thread_comm.ThreadComm`` (simulated ranks as threads of one process).

Groups are tuples of *global* ranks; all members must call a collective on a group in the same
order. ``all_gather``/``reduce_scatter`` take equally sized pieces (pad first: gloo needs it).
Every primitive also has an asynchronous form, ``start_<name>(...)`` returning a ``Handle`` whose
``wait()`` gives the result (torch.distributed ``async_op=True`` work; on simulated ranks a start
deposits, the wait collects); the blocking forms are start + wait.
"""


from __future__ import annotations

import enum
from typing import Any, Callable, Optional, Sequence

import torch


Group = tuple[int, ...]


class CommTag(enum.IntEnum):
    """Point-to-point tags, one per kind of message, so that exchanges in flight at the same time
    between the same two ranks never match each other's messages."""

    ACTIVATION = 0  # pipeline activations between stages
    PULL = 1  # Pull Parameter plans of the overlap schedule
    PUSH = 2  # Push Gradient plans of the overlap schedule
    HEADER = 3  # the activation headers (shapes, dtypes) sent ahead of activations
    GRADIENT = 4  # pipeline gradients between stages


class Handle:
    """An operation in flight: ``wait()`` completes it (once) and returns its result; ``ready()``
    says, without blocking, that ``wait()`` would return at once and issue nothing new."""

    def __init__(self, finish: Callable[[], Any], ready: Optional[Callable[[], bool]] = None) -> None:
        self._finish: Optional[Callable[[], Any]] = finish
        self._ready = ready
        self._result: Any = None

    @classmethod
    def completed(cls, result: Any = None) -> "Handle":
        handle = cls(lambda: result)
        handle.wait()
        return handle

    @property
    def done(self) -> bool:
        return self._finish is None

    def ready(self) -> bool:
        return self._finish is None or (self._ready is not None and self._ready())

    def wait(self) -> Any:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result


class Communicator:
    """Interface of the primitives; ``rank`` is this caller's global rank.

    Every primitive has an asynchronous form ``start_<name>(...) -> Handle`` whose ``wait()`` returns
    what the blocking form returns; the blocking form is ``start_<name>(...).wait()``. The *start*
    order fixes how collectives match: members must start them on a group in the same order, and
    point-to-point messages between a pair match in the order their sends and receives are started.
    Tensors handed to a start must not be modified until the handle is waited.
    """

    rank: int
    world_size: int
    # Where this communicator's tensors live: NCCL needs every tensor on the rank's GPU.
    device: torch.device = torch.device("cpu")
    # Per plan, the calls this rank issues (``reshard.comm_steps``): the cache of the plans it runs.
    plan_calls: dict

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> Handle:
        raise NotImplementedError

    def start_all_gather(self, tensor: torch.Tensor, group: Group) -> Handle:
        raise NotImplementedError

    def start_reduce_scatter(self, stacked: torch.Tensor, group: Group) -> Handle:
        raise NotImplementedError

    def start_all_to_all(
        self, pieces: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple[int, ...]]
    ) -> Handle:
        raise NotImplementedError

    def start_broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> Handle:
        raise NotImplementedError

    def start_exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int = 0
    ) -> Handle:
        """Messages match per (pair, ``tag``): streams with different tags may interleave freely."""
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        """Sum over ``group``; returns a new tensor."""
        return self.start_all_reduce(tensor, group).wait()

    def all_gather(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        """Stack every member's equally shaped tensor: result shape ``(len(group), *tensor.shape)``."""
        return self.start_all_gather(tensor, group).wait()

    def reduce_scatter(self, stacked: torch.Tensor, group: Group) -> torch.Tensor:
        """``stacked[i]`` is this rank's contribution to member ``i``; returns the summed piece of ours."""
        return self.start_reduce_scatter(stacked, group).wait()

    def all_to_all(
        self, pieces: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        """Send ``pieces[i]`` to member ``i``; returns what member ``i`` sent us, of ``recv_shapes[i]``."""
        return self.start_all_to_all(pieces, group, recv_shapes).wait()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        """``src``'s tensor on every member (``tensor`` is the receive buffer elsewhere)."""
        return self.start_broadcast(tensor, src, group).wait()

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        """Point-to-point: post every send and receive at once, then wait for all.

        ``recvs`` holds ``(src, buffer)`` pairs filled in place. Messages between one pair of ranks
        are matched in the order they are posted.
        """
        self.start_exchange(sends, recvs).wait()

    def barrier(self, group: Group) -> None:
        self.all_reduce(torch.zeros(1, device=self.device), group)
