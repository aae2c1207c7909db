"""Start ranks: ``launch`` spawns local processes for tests and demos; ``init_from_env`` joins torchrun.

``launch(fn, world_size, args)`` runs ``fn(*args)`` on every rank inside an initialised process group
(``file://`` rendezvous in a private temporary directory, gloo bound to the loopback interface, one
thread per process) and returns the return values in rank order. ``fn`` must be picklable (a
module-level function). ``comm_timeout`` (default ``DEFAULT_COMM_TIMEOUT``, 300 s; exported as
``HGRAPH_COMM_TIMEOUT``) bounds every collective; the run itself has no time limit unless
``timeout`` is given. When a rank dies or raises, every other rank fails within the collective
timeout (a ``CommunicationError`` naming what it was doing), the launcher waits a moment for their
reports, stops what is left and raises one ``CommunicationError`` naming the root cause first (the
rank that died or raised on its own), then what the others reported.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

from hgraph.errors import CommunicationError
from hgraph.runtime import preemption
from hgraph.runtime.kernels.failures import DEFAULT_COMM_TIMEOUT, TIMEOUT_ENV, is_transport_error
from hgraph.runtime.kernels.process_group_comm import local_device_index

GRACE_SECONDS = 5.0
"""After the first failure, how long the launcher waits for the other ranks' reports."""


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
            fn: Callable[..., Any], args: Sequence[Any], results: Any, preemptible: bool = False) -> None:
    import torch
    import torch.distributed as dist

    if preemptible:
        preemption.install()
    torch.set_num_threads(1)
    failed = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(local_device_index(rank))
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # Every rank connected before any runs fn: a rank that finished at once would otherwise
        # close its connections while a slower one is still connecting to it.
        dist.barrier()
        value = fn(*args)
        results.put((rank, True, pickle.dumps(value), False))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the rank
        failed = True
        report = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        results.put((rank, False, report, is_transport_error(exc)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if failed:
        sys.exit(1)  # after the queue is flushed (multiprocessing joins its feeder thread on exit)


def _loopback_interface() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux), if the platform lists one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float | None = None,
    backend: str = "gloo",
    comm_timeout: float | None = None,
    preemptible: bool = False,
) -> list:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return their results in rank order.

    ``timeout``: seconds for the whole run (default ``None``: until done); ``comm_timeout``: seconds
    for each collective (default ``DEFAULT_COMM_TIMEOUT``, 300 s, or ``timeout`` if that is shorter).
    ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
    ``preemptible``: every rank turns SIGTERM into a stop request (``hgraph.runtime.preemption``)
    before ``fn`` runs, and a SIGTERM sent to this process is passed on to the ranks, so a training
    ``fn`` can finish its iteration, checkpoint and return.
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise CommunicationError(f"world_size={world_size}; launch needs at least 1 rank")
    if comm_timeout is None:
        comm_timeout = DEFAULT_COMM_TIMEOUT if timeout is None else min(timeout, DEFAULT_COMM_TIMEOUT)
    for name, value in (("timeout", timeout), ("comm_timeout", comm_timeout)):
        if value is not None and not value > 0:
            raise CommunicationError(f"{name}={value}; launch needs a positive number of seconds")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="hgraph-launch-")
    init_method = "file://" + os.path.join(rendezvous, "store")
    procs = []
    try:
        env = {"OMP_NUM_THREADS": "1", TIMEOUT_ENV: str(comm_timeout)}
        loopback = _loopback_interface()
        if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = loopback  # local ranks never listen beyond this machine
        with _child_env(env):
            for rank in range(world_size):
                p = ctx.Process(
                    target=_worker,
                    args=(rank, world_size, init_method, backend, comm_timeout, fn, tuple(args), results,
                          preemptible),
                    name=f"hgraph-rank{rank}",
                )
                p.start()
                procs.append(p)
        deadline = None if timeout is None else time.monotonic() + timeout
        with _forwarding_sigterm(procs, preemptible):
            return _collect(procs, results, world_size, deadline, timeout)
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


@contextlib.contextmanager
def _forwarding_sigterm(procs: list, enabled: bool) -> Iterator[None]:
    """While ``enabled`` (and in the main thread): a SIGTERM to this process goes to the ranks instead."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _collect(procs: list, results: Any, world_size: int, deadline: float | None, timeout: float | None) -> list:
    values: dict[int, Any] = {}
    errors: dict[int, tuple[str, bool]] = {}  # rank -> (report, caused by a peer), in arrival order
    grace_end: float | None = None
    while len(values) < world_size:
        now = time.monotonic()
        if grace_end is not None and (now > grace_end or all(
            r in values or r in errors or not p.is_alive() for r, p in enumerate(procs)
        )):
            break
        if grace_end is None and deadline is not None and now > deadline:
            missing = sorted(set(range(world_size)) - set(values))
            raise CommunicationError(
                f"ranks {missing} did not finish within {timeout:.0f}s (a hang or a mismatched collective)"
            )
        try:
            rank, ok, payload, by_peer = results.get(timeout=0.1)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
            if grace_end is None and any(r not in values for r in dead):
                grace_end = _grace_end(deadline)
            continue
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            errors[rank] = (payload, by_peer)
            if grace_end is None:
                grace_end = _grace_end(deadline)
    if grace_end is None:
        return [values[r] for r in range(world_size)]
    while True:  # reports of ranks that exited are in the pipe already: read them all
        try:
            rank, ok, payload, by_peer = results.get(timeout=1.0)
        except queue.Empty:
            break
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            errors[rank] = (payload, by_peer)
    raise CommunicationError(_failure_report(procs, values, errors))


def _grace_end(deadline: float | None) -> float:
    """When to stop waiting for the other ranks' reports after the first failure."""
    end = time.monotonic() + GRACE_SECONDS
    return end if deadline is None else min(end, deadline)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"died with exit code {code}"


def _failure_report(procs: list, values: dict[int, Any], errors: dict[int, tuple[str, bool]]) -> str:
    """One message: the root cause first (a rank that died, else one that raised on its own, else
    one that stopped responding), then what every other rank reported."""
    died = [r for r, p in enumerate(procs) if r not in errors and r not in values and not p.is_alive()
            and p.exitcode not in (0, None)]
    own = [r for r, (_, by_peer) in errors.items() if not by_peer]  # in the order the reports came
    stuck = [r for r in range(len(procs)) if r not in errors and r not in values and r not in died]
    roots = died + own or stuck or list(errors)
    root = roots[0]
    if root in errors:
        head = f"rank {root} failed: {errors[root][0]}"
    elif root in died:
        head = f"rank {root} {_exit_text(procs[root].exitcode)} (no error report: killed or crashed)"
    else:
        head = f"rank {root} stopped responding (no report while its peers failed); stopped by the launcher"
    lines = [head.rstrip()]
    for r in range(len(procs)):
        if r == root:
            continue
        if r in errors:
            lines.append(f"  rank {r}: " + errors[r][0].strip().splitlines()[0])
        elif r in values:
            lines.append(f"  rank {r}: finished")
        elif r in died:
            lines.append(f"  rank {r}: {_exit_text(procs[r].exitcode)}")
        else:
            lines.append(
                f"  rank {r}: no report within {GRACE_SECONDS:.0f}s of the failure; stopped by the launcher"
            )
    return "\n".join(lines)


BACKENDS = ("auto", "nccl", "gloo")


def choose_backend(requested: str = "auto", world_size: int | None = None) -> str:
    """The process-group backend for ``requested``: ``"auto"`` is NCCL when CUDA is available (and,
    for ``world_size`` local ranks, there are that many GPUs), else gloo; ``"nccl"`` without CUDA is
    a ``CommunicationError`` naming the fix."""
    import torch

    if requested not in BACKENDS:
        raise CommunicationError(f"backend={requested!r}; expected one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough = gpus > 0 and (world_size is None or gpus >= world_size)
    if requested == "auto":
        return "nccl" if enough else "gloo"
    if requested == "nccl" and not enough:
        need = f"{world_size} GPUs" if world_size is not None else "a GPU"
        raise CommunicationError(f"backend='nccl' needs {need}; this machine has {gpus} (use backend='gloo' "
                                 "for CPU ranks, or 'auto')")
    return requested


def init_from_env(backend: str = "auto", timeout: float = DEFAULT_COMM_TIMEOUT) -> tuple[int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).

    ``backend``: ``"auto"`` (NCCL when CUDA is available, else gloo), ``"nccl"`` or ``"gloo"``;
    ``timeout``: seconds for each collective (default ``DEFAULT_COMM_TIMEOUT``, 300 s). Returns ``(rank, world_size)``; does nothing if the group is already initialised. The group
    hgraph joins here is left at interpreter exit (``destroy_process_group``), so gloo's worker
    threads are joined before the process ends instead of aborting it ("terminate called without
    an active exception").
    """
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise CommunicationError(f"init_from_env needs the environment variables {missing} (set by torchrun)")
    os.environ.setdefault(TIMEOUT_ENV, str(timeout))
    backend = choose_backend(backend)
    if not dist.is_initialized():
        if backend == "nccl":
            import torch

            torch.cuda.set_device(local_device_index(int(os.environ["RANK"])))
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=datetime.timedelta(seconds=timeout))
        atexit.register(_leave_group)
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(timeout: float) -> Any:
    """Under torchrun, a key space of this restart attempt's own in the store the agent shares with
    its workers (``TORCHELASTIC_USE_AGENT_STORE``), else ``None`` (``env://`` as usual).

    That store outlives a restart (torch's shared rendezvous store; pytorch/pytorch#135712), so the
    ranks of attempt n+1 could read what the dead ranks of attempt n left there, e.g. gloo's listening
    addresses ("Gloo connectFullMesh failed ... Connection refused"), and never connect. Every agent
    counts the same failed attempts (``TORCHELASTIC_RESTART_COUNT``), so the count names the space.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(f"hgraph/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def _leave_group() -> None:
    """At exit: destroy the process group ``init_from_env`` created, unless the script did."""
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer may already be gone; exiting anyway
            dist.barrier()  # no rank closes its connections while a peer still uses them
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
