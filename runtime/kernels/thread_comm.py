"""``ThreadComm``: simulated ranks as threads of one process (``run_threads``); collectives meet in
shared memory. Used by ``compiled.simulate`` and tests. A wait longer than ``timeout`` raises
``CommunicationError`` naming the rank and the call, so a mismatched program never hangs.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
from hgraph.runtime.kernels.comm import Communicator, Group, Handle

from hgraph.errors import CommunicationError


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
        self.plan_calls: dict = {}
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
