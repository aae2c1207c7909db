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
Every primitive also has an asynchronous form, ``start_<name>(...)`` returning a ``Handle`` whose
``wait()`` gives the result (torch.distributed ``async_op=True`` work; on simulated ranks a start
deposits, the wait collects); the blocking forms are start + wait.
"""

from __future__ import annotations

import enum
import os
import threading
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import torch

from hgraph.errors import CommunicationError
from hgraph.runtime.kernels.failures import comm_timeout

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


# ----------------------------------------------------------------------------- simulated ranks
class ThreadWorld:
    """Shared state of a set of simulated ranks (one ``ThreadComm`` per thread)."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.cond = threading.Condition()
        self.slots: dict[tuple, dict[int, Any]] = {}
        self.reads: dict[tuple, int] = defaultdict(int)
        # Point-to-point: message ``k`` from ``a`` to ``b`` with tag ``t`` lives at ``mailbox[(a, b, t, k)]``.
        self.mailbox: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self.sent: dict[tuple[int, int, int], int] = defaultdict(int)
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
    """A simulated rank: collectives rendezvous with the other threads of the same ``ThreadWorld``.

    A start deposits this rank's payload (or message); ``wait`` collects the others'.
    """

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.calls: dict[Group, int] = defaultdict(int)
        self.received: dict[tuple[int, int], int] = defaultdict(int)  # receives started, per (source, tag)

    def _check_member(self, group: Group, what: str) -> None:
        if self.rank not in group:
            raise CommunicationError(f"rank {self.rank} called {what} on group {group} it is not part of")

    def _rendezvous(
        self, group: Group, what: str, payload: Any, combine: Callable[[dict[int, Any]], Any]
    ) -> Handle:
        """Deposit ``payload`` now; the handle returns ``combine(every member's payload)``."""
        group = tuple(group)
        self._check_member(group, what)
        key = (group, self.calls[group])
        self.calls[group] += 1
        w = self.world
        with w.cond:
            w.slots.setdefault(key, {})[self.rank] = (what, payload)
            w.cond.notify_all()

        def finish() -> Any:
            with w.cond:
                w.wait_for(lambda: len(w.slots[key]) == len(group), self.rank, f"{what} on group {group}")
                arrived = w.slots[key]
                kinds = {k for k, _ in arrived.values()}
                if len(kinds) > 1:
                    detail = ", ".join(f"rank {r}: {k}" for r, (k, _) in sorted(arrived.items()))
                    raise CommunicationError(f"mismatched collectives on group {group}: {detail}")
                parts = {r: p for r, (_, p) in arrived.items()}
                w.reads[key] += 1
                if w.reads[key] == len(group):
                    del w.slots[key]
                    del w.reads[key]
            return combine(parts)

        def ready() -> bool:
            with w.cond:
                return key in w.slots and len(w.slots[key]) == len(group)

        return Handle(finish, ready)

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> Handle:
        def combine(parts: dict[int, Any]) -> torch.Tensor:
            out = torch.zeros_like(tensor)
            for r in group:  # fixed order: every member gets bit-identical sums
                out += parts[r]
            return out

        return self._rendezvous(group, "all_reduce", tensor.detach().clone(), combine)

    def start_all_gather(self, tensor: torch.Tensor, group: Group) -> Handle:
        return self._rendezvous(
            group, "all_gather", tensor.detach().clone(), lambda parts: torch.stack([parts[r] for r in group])
        )

    def start_reduce_scatter(self, stacked: torch.Tensor, group: Group) -> Handle:
        def combine(parts: dict[int, Any]) -> torch.Tensor:
            me = tuple(group).index(self.rank)
            out = torch.zeros_like(stacked[me])
            for r in group:
                out += parts[r][me]
            return out

        return self._rendezvous(group, "reduce_scatter", stacked.detach().clone(), combine)

    def start_all_to_all(
        self, pieces: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple[int, ...]]
    ) -> Handle:
        def combine(parts: dict[int, Any]) -> list[torch.Tensor]:
            me = tuple(group).index(self.rank)
            out = [parts[r][me] for r in group]
            for r, got, want in zip(group, out, recv_shapes):
                if tuple(got.shape) != tuple(want):
                    raise CommunicationError(
                        f"rank {self.rank} expected {tuple(want)} from rank {r} in all_to_all, got {tuple(got.shape)}"
                    )
            return out

        return self._rendezvous(group, "all_to_all", [p.detach().clone() for p in pieces], combine)

    def start_broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> Handle:
        payload = tensor.detach().clone() if self.rank == src else None
        return self._rendezvous(group, "broadcast", payload, lambda parts: parts[src].clone())

    def start_exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int = 0
    ) -> Handle:
        w = self.world
        with w.cond:
            for dst, tensor in sends:
                k = w.sent[(self.rank, dst, tag)]
                w.sent[(self.rank, dst, tag)] += 1
                w.mailbox[(self.rank, dst, tag, k)] = tensor.detach().clone()
            w.cond.notify_all()
        slots = []
        for src, buffer in recvs:
            slots.append(((src, self.rank, tag, self.received[(src, tag)]), buffer))
            self.received[(src, tag)] += 1

        def finish() -> None:
            with w.cond:
                for key, buffer in slots:
                    w.wait_for(lambda: key in w.mailbox, self.rank, f"recv from rank {key[0]}")
                    message = w.mailbox.pop(key)
                    if message.shape != buffer.shape:
                        raise CommunicationError(
                            f"rank {self.rank} expected {tuple(buffer.shape)} from rank {key[0]}, "
                            f"got {tuple(message.shape)}"
                        )
                    buffer.copy_(message)

        def ready() -> bool:
            with w.cond:
                return all(key in w.mailbox for key, _ in slots)

        return Handle(finish, ready)


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
        self._groups: dict[Group, Any] = {}
        if dist.get_backend() == "nccl":
            self.device = torch.device("cuda", local_device_index(self.rank))
            torch.cuda.set_device(self.device)
        # Older torch (2.11) lacks the *_single names; the *_tensor ones take the same arguments.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

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
