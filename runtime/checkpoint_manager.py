"""A directory of step checkpoints, written off the training path: resume from the newest, keep the last K.

::

    checkpoints = CheckpointManager("runs/x/checkpoint", interval=100, keep=2)   # every rank
    checkpoints.resume(trainer, data)        # the newest complete step-N, if there is one
    while trainer.iteration < iterations:
        trainer.step_data(data)
        checkpoints.step(trainer)            # every `interval` iterations: save (in the background)
    checkpoints.close()                      # waits for the write in flight; raises its error

Layout: ``DIR/step-00000100/`` per checkpoint (``hgraph.runtime.checkpoint``'s format); the newest
complete one (with a manifest) is the one to resume, and rank 0 decides it for every rank. After a
new checkpoint is complete the oldest beyond ``keep`` are deleted (``keep=0``: none). A restarted job
(``torchrun --max-restarts``) that calls ``resume`` continues exactly where the newest checkpoint
stopped: parameters, Adam state, learning-rate schedule, data position, RNG and planner state.

Asynchronous writes (``async_write=True``, the default on process groups): ``save`` copies the
rank's shards to host memory on the training thread (``checkpoint.snapshot``), then a background
thread writes the file, fsyncs it and takes part in the commit (``checkpoint.write``: the digests are
all-gathered, rank 0 writes the manifest and renames ``.step-N.partial`` to ``step-N``). The thread
uses a gloo process group of its own, so its collectives never interleave with the training's. At
most one write is in flight: a second ``save`` first waits for the first. A write that failed raises
its error at the next ``save``, ``wait`` or ``close``. A kill at any moment leaves every complete
checkpoint as it was. On simulated ranks (threads) or a single process the write is synchronous.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from hgraph.errors import CheckpointError, HGraphError
from hgraph.runtime import checkpoint
from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm
from hgraph.runtime.kernels.failures import comm_timeout

STEP = re.compile(r"^step-(\d+)$")


def step_name(iteration: int) -> str:
    return f"step-{iteration:08d}"


def complete_steps(directory: str | Path) -> list[tuple[int, Path]]:
    """``(iteration, path)`` of the complete checkpoints in ``directory``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP.match(child.name)
        if m and (child / checkpoint.MANIFEST).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(directory: str | Path) -> Optional[Path]:
    """The newest complete checkpoint in ``directory`` (a ``step-N`` folder, or a single checkpoint
    saved at ``directory`` itself by ``trainer.save``), else ``None``."""
    steps = complete_steps(directory)
    if steps:
        return steps[-1][1]
    single = checkpoint.resolve(directory)
    return single if (single / checkpoint.MANIFEST).is_file() else None


class _SideComm:
    """``all_gather`` and ``barrier`` over a gloo group of all ranks that only the writer thread uses."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.dist = dist
        self.group = dist.new_group(backend="gloo", timeout=comm_timeout())

    def all_gather(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        flat = tensor.contiguous().reshape(-1)
        out = torch.empty(len(group) * flat.numel(), dtype=tensor.dtype)
        gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        gather(out, flat, group=self.group)
        return out.reshape(len(group), *tensor.shape)

    def barrier(self, group: Any) -> None:
        self.dist.barrier(group=self.group)


class CheckpointManager:
    """Step checkpoints in ``directory``: ``resume``, ``step``/``save`` (asynchronous), ``wait``, ``close``."""

    def __init__(self, directory: str, interval: int = 0, keep: int = 2, async_write: bool = True) -> None:
        if interval < 0 or keep < 0:
            raise CheckpointError(f"CheckpointManager(interval={interval}, keep={keep}): both must be >= 0")
        self.directory = Path(directory)
        self.interval, self.keep, self.async_write = interval, keep, async_write
        self._side: Optional[_SideComm] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._pending: Optional[Path] = None
        self.saved: list[Path] = []  # checkpoints this manager completed, oldest first
        self.write_seconds: list[float] = []  # how long each write took (snapshot to commit)

    def __str__(self) -> str:
        mode = "asynchronous" if self.async_write else "synchronous"
        return f"CheckpointManager({self.directory}, every {self.interval or '-'} iterations, keep {self.keep}, {mode})"

    # ------------------------------------------------------------------ resume
    def resume(self, trainer: Any, data: Any = None) -> Optional[Path]:
        """Load the newest complete checkpoint into ``trainer`` (and ``data``'s position) on every rank;
        returns it, or ``None`` when there is none (a fresh start). Rank 0 chooses for all ranks."""
        found = latest(self.directory) if trainer.rank == 0 else None
        if trainer.rank == 0:
            for leftover in self.directory.glob(".step-*.partial"):  # saves a crash interrupted
                shutil.rmtree(leftover, ignore_errors=True)
        chosen = json.loads(trainer._broadcast_bytes(json.dumps(str(found or "")).encode()))
        if not chosen:
            return None
        trainer.load(chosen, data=data if data is not None and checkpoint.read_manifest(chosen).get("data") else None)
        return Path(chosen)

    # ------------------------------------------------------------------ saving
    def step(self, trainer: Any) -> Optional[Path]:
        """After an iteration: save if ``trainer.iteration`` is a multiple of ``interval``."""
        if self.interval and trainer.iteration % self.interval == 0:
            return self.save(trainer)
        return None

    def save(self, trainer: Any, blocking: bool = False, extra: Optional[dict[str, Any]] = None) -> Path:
        """Checkpoint ``trainer`` as ``step-<iteration>``; every rank, at the same iteration. Returns at
        once (the write continues in the background) unless ``blocking`` or writes are synchronous."""
        self.wait()
        path = self.directory / step_name(trainer.iteration)
        if trainer.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        snap = checkpoint.snapshot(trainer, extra)
        background = self.async_write and isinstance(trainer.comm, ProcessGroupComm)
        if not background:
            checkpoint.write(snap, path, trainer.comm)
            self._completed(path, trainer.rank, started)
            return path
        if self._side is None:
            self._side = _SideComm()  # collective: every rank reaches its first save together
        self._pending = path
        self._thread = threading.Thread(target=self._write, args=(snap, path, started), name="hgraph-checkpoint",
                                        daemon=True)
        self._thread.start()
        if blocking:
            self.wait()
        return path

    def _write(self, snap: checkpoint.Snapshot, path: Path, started: float) -> None:
        try:
            checkpoint.write(snap, path, self._side)
            self._completed(path, snap.rank, started)
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = exc

    def _completed(self, path: Path, rank: int, started: float) -> None:
        self.write_seconds.append(time.perf_counter() - started)
        self.saved.append(path)
        if rank == 0 and self.keep:
            for _, old in complete_steps(self.directory)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    @property
    def in_flight(self) -> bool:
        """Whether a background write has not finished yet."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the write in flight (if any); raise its error as a ``CheckpointError``."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            if isinstance(exc, HGraphError):
                raise exc
            raise CheckpointError(f"writing checkpoint {self._pending} failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Finish the write in flight and release the writer's process group."""
        try:
            self.wait()
        finally:
            if self._side is not None:
                side, self._side = self._side, None
                try:
                    side.dist.destroy_process_group(side.group)
                except Exception:  # noqa: BLE001 - the world may be gone already; nothing to release then
                    pass
