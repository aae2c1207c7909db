"""Communicators: the few collective and point-to-point primitives hgraph programs use.

Two implementations share one interface, so every program and reshard plan runs unchanged on
real processes and on simulated ranks:

* ``ProcessGroupComm``: torch.distributed (gloo on CPU, NCCL on CUDA). Subgroups are created once,
  with ``use_local_synchronization`` so only members take part, and cached by their rank tuple.
* ``ThreadComm``: simulated ranks as threads of one process (``run_threads``); collectives meet in
  shared memory. Used by ``compiled.simulate`` and tests. A wait longer than ``timeout`` raises
  ``CommunicationError`` naming the rank and the call, so a mismatched program never hangs.

Groups are tuples of *global* ranks; all members must call a collective on a group in the same
order. ``all_gather``/``reduce_scatter`` take equally sized pieces (pad first: gloo needs it).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from typing import Any, Callable, Sequence

import torch

from hgraph.errors import CommunicationError

Group = tuple[int, ...]


class Communicator:
    """Interface of the primitives; ``rank`` is this caller's global rank."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        """Sum over ``group``; returns a new tensor."""
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        """Stack every member's equally shaped tensor: result shape ``(len(group), *tensor.shape)``."""
        raise NotImplementedError

    def reduce_scatter(self, stacked: torch.Tensor, group: Group) -> torch.Tensor:
        """``stacked[i]`` is this rank's contribution to member ``i``; returns the summed piece of ours."""
        raise NotImplementedError

    def all_to_all(
        self, pieces: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        """Send ``pieces[i]`` to member ``i``; returns what member ``i`` sent us, of ``recv_shapes[i]``."""
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        """``src``'s tensor on every member (``tensor`` is the receive buffer elsewhere)."""
        raise NotImplementedError

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        """Point-to-point: post every send and receive at once, then wait for all.

        ``recvs`` holds ``(src, buffer)`` pairs filled in place. Messages between one pair of ranks
        are matched in the order they are posted.
        """
        raise NotImplementedError

    def barrier(self, group: Group) -> None:
        self.all_reduce(torch.zeros(1), group)


# ----------------------------------------------------------------------------- simulated ranks
class ThreadWorld:
    """Shared state of a set of simulated ranks (one ``ThreadComm`` per thread)."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.cond = threading.Condition()
        self.slots: dict[tuple, dict[int, Any]] = {}
        self.reads: dict[tuple, int] = defaultdict(int)
        self.mailbox: dict[tuple[int, int], deque] = defaultdict(deque)
        self.failed: str | None = None

    def fail(self, message: str) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = message
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], rank: int, what: str) -> None:
        """Wait (holding ``cond``) until ``predicate``; raise if another rank failed or on timeout."""
        ok = self.cond.wait_for(lambda: predicate() or self.failed is not None, timeout=self.timeout)
        if self.failed is not None and not predicate():
            raise CommunicationError(f"rank {rank} stopped in {what}: {self.failed}")
        if not ok:
            raise CommunicationError(
                f"rank {rank} waited more than {self.timeout:.0f}s in {what}; the other ranks never "
                "joined (mismatched collective order or a missing send/recv)"
            )


class ThreadComm(Communicator):
    """A simulated rank: collectives rendezvous with the other threads of the same ``ThreadWorld``."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.calls: dict[Group, int] = defaultdict(int)

    def _check_member(self, group: Group, what: str) -> None:
        if self.rank not in group:
            raise CommunicationError(f"rank {self.rank} called {what} on group {group} it is not part of")

    def _rendezvous(self, group: Group, what: str, payload: Any) -> dict[int, Any]:
        """Deposit ``payload``; return every member's payload once all have arrived."""
        group = tuple(group)
        self._check_member(group, what)
        key = (group, self.calls[group])
        self.calls[group] += 1
        w = self.world
        with w.cond:
            slot = w.slots.setdefault(key, {})
            slot[self.rank] = (what, payload)
            w.cond.notify_all()
            w.wait_for(lambda: len(w.slots[key]) == len(group), self.rank, f"{what} on group {group}")
            arrived = w.slots[key]
            kinds = {k for k, _ in arrived.values()}
            if len(kinds) > 1:
                detail = ", ".join(f"rank {r}: {k}" for r, (k, _) in sorted(arrived.items()))
                raise CommunicationError(f"mismatched collectives on group {group}: {detail}")
            result = {r: p for r, (_, p) in arrived.items()}
            w.reads[key] += 1
            if w.reads[key] == len(group):
                del w.slots[key]
                del w.reads[key]
        return result

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        parts = self._rendezvous(group, "all_reduce", tensor.detach().clone())
        out = torch.zeros_like(tensor)
        for r in group:  # fixed order: every member gets bit-identical sums
            out += parts[r]
        return out

    def all_gather(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        parts = self._rendezvous(group, "all_gather", tensor.detach().clone())
        return torch.stack([parts[r] for r in group])

    def reduce_scatter(self, stacked: torch.Tensor, group: Group) -> torch.Tensor:
        parts = self._rendezvous(group, "reduce_scatter", stacked.detach().clone())
        me = group.index(self.rank)
        out = torch.zeros_like(stacked[me])
        for r in group:
            out += parts[r][me]
        return out

    def all_to_all(
        self, pieces: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        parts = self._rendezvous(group, "all_to_all", [p.detach().clone() for p in pieces])
        me = group.index(self.rank)
        out = [parts[r][me] for r in group]
        for r, got, want in zip(group, out, recv_shapes):
            if tuple(got.shape) != tuple(want):
                raise CommunicationError(
                    f"rank {self.rank} expected {tuple(want)} from rank {r} in all_to_all, got {tuple(got.shape)}"
                )
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        parts = self._rendezvous(group, "broadcast", tensor.detach().clone() if self.rank == src else None)
        return parts[src].clone()

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        w = self.world
        with w.cond:
            for dst, tensor in sends:
                w.mailbox[(self.rank, dst)].append(tensor.detach().clone())
            w.cond.notify_all()
            for src, buffer in recvs:
                box = w.mailbox[(src, self.rank)]
                w.wait_for(lambda: len(box) > 0, self.rank, f"recv from rank {src}")
                message = box.popleft()
                if message.shape != buffer.shape:
                    raise CommunicationError(
                        f"rank {self.rank} expected {tuple(buffer.shape)} from rank {src}, got {tuple(message.shape)}"
                    )
                buffer.copy_(message)


def run_threads(fn: Callable[[Communicator], Any], world_size: int, timeout: float = 60.0) -> list:
    """Run ``fn(comm)`` for every simulated rank in its own thread; return results in rank order.

    The first exception of any rank is re-raised here after every thread has stopped.
    """
    world = ThreadWorld(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(world, rank))
        except BaseException as exc:  # noqa: BLE001 - reported below, with the rank
            errors.append((rank, exc))
            world.fail(f"rank {rank} raised {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=body, args=(r,), name=f"hgraph-rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # Prefer the root cause over the "another rank failed" errors it triggered.
        errors.sort(key=lambda e: (isinstance(e[1], CommunicationError) and "stopped in" in str(e[1]), e[0]))
        raise errors[0][1]
    return results


# ----------------------------------------------------------------------------- real processes
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
        self._groups: dict[Group, Any] = {}

    def create_groups(self, groups: Sequence[Group]) -> None:
        """Create every group in one global order, so no two ranks wait on each other in a cycle.

        Call with the same list on every rank; each rank joins only the groups it belongs to.
        """
        for group in sorted({tuple(sorted(g)) for g in groups}):
            if self.rank in group:
                self.group(group)

    def group(self, ranks: Group) -> Any:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            if len(key) == self.world_size:
                self._groups[key] = self.dist.group.WORLD
            else:
                self._groups[key] = self.dist.new_group(list(key), use_local_synchronization=True)
        return self._groups[key]

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        out = tensor.detach().clone().contiguous()
        self.dist.all_reduce(out, group=self.group(group))
        return out

    def all_gather(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        group = tuple(group)
        if list(group) != sorted(group):
            raise CommunicationError(f"all_gather needs its group in ascending rank order, got {group}")
        src = tensor.detach().contiguous()
        # gloo wants the output concatenated along dim 0: gather flat, then view as stacked.
        out = src.new_empty((len(group) * src.numel(),))
        self.dist.all_gather_single(out, src.reshape(-1), group=self.group(group))
        return out.view((len(group),) + tuple(src.shape))

    def reduce_scatter(self, stacked: torch.Tensor, group: Group) -> torch.Tensor:
        group = tuple(group)
        if list(group) != sorted(group):
            raise CommunicationError(f"reduce_scatter needs its group in ascending rank order, got {group}")
        src = stacked.detach().contiguous()
        out = src.new_empty(tuple(src.shape[1:]))
        self.dist.reduce_scatter_single(out.view(-1), src.reshape(-1), group=self.group(group))
        return out

    def all_to_all(
        self, pieces: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        ref = pieces[0]
        out = [ref.new_empty(tuple(shape)) for shape in recv_shapes]
        self.dist.all_to_all(out, [p.contiguous() for p in pieces], group=self.group(tuple(group)))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        out = tensor.detach().clone().contiguous()
        self.dist.broadcast(out, src=src, group=self.group(group))
        return out

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        dist = self.dist
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for peer, t in sends]
        staging = [(buf, buf if buf.is_contiguous() else torch.empty_like(buf)) for _, buf in recvs]
        ops += [dist.P2POp(dist.irecv, tmp, peer) for (peer, _), (_, tmp) in zip(recvs, staging)]
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for buf, tmp in staging:
            if tmp is not buf:
                buf.copy_(tmp)
