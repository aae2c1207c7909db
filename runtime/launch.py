"""Start ranks: ``launch`` spawns local processes for tests and demos; ``init_from_env`` joins torchrun.

``launch(fn, world_size, args)`` runs ``fn(*args)`` on every rank inside an initialised process group
(``file://`` rendezvous in a temporary directory, one thread per process) and returns the return
values in rank order. ``fn`` must be picklable (a module-level function). When a rank raises, the others
are stopped and ``CommunicationError`` names the rank and its error; an overall ``timeout`` keeps a
mismatched program from hanging.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

from hgraph.errors import CommunicationError


@contextlib.contextmanager
def _child_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables that spawned children inherit, restoring ours afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(rank: int, world_size: int, init_method: str, backend: str, timeout: float,
            fn: Callable[..., Any], args: Sequence[Any], results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(*args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the rank
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    backend: str = "gloo",
) -> list:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return their results in rank order."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise CommunicationError(f"world_size={world_size}; launch needs at least 1 rank")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="hgraph-launch-")
    init_method = "file://" + os.path.join(rendezvous, "store")
    procs = []
    try:
        with _child_env({"OMP_NUM_THREADS": "1"}):
            for rank in range(world_size):
                p = ctx.Process(
                    target=_worker,
                    args=(rank, world_size, init_method, backend, timeout, fn, tuple(args), results),
                    name=f"hgraph-rank{rank}",
                )
                p.start()
                procs.append(p)
        return _collect(procs, results, world_size, time.monotonic() + timeout, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(rendezvous, ignore_errors=True)


def _collect(procs: list, results: Any, world_size: int, deadline: float, timeout: float) -> list:
    values: dict[int, Any] = {}
    while len(values) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in values and not p.is_alive() and p.exitcode not in (0, None):
                    raise CommunicationError(f"rank {rank} died with exit code {p.exitcode}") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise CommunicationError(
                    f"ranks {missing} did not finish within {timeout:.0f}s "
                    "(a hang or a mismatched collective)"
                ) from None
            continue
        if not ok:
            raise CommunicationError(f"rank {rank} failed: {payload}")
        values[rank] = pickle.loads(payload)
    return [values[r] for r in range(world_size)]


def init_from_env(backend: str = "gloo", timeout: float = 1800.0) -> tuple[int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).

    Returns ``(rank, world_size)``; does nothing if the group is already initialised.
    """
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise CommunicationError(f"init_from_env needs the environment variables {missing} (set by torchrun)")
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout)
        )
    return dist.get_rank(), dist.get_world_size()
