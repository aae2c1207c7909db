"""A directory of step checkpoints, written off the training path: resume from the newest, keep the last K.

::

    checkpoints = CheckpointManager("runs/x/checkpoint", interval=100, keep=2)   # every rank
    checkpoints.resume(trainer, data)        # the newest complete step-N, if there is one
    while trainer.iteration < iterations:
        trainer.step_data(data)
        checkpoints.step(trainer)            # every `interval` iterations: save (in the background)
    checkpoints.close()                      # waits for the write in flight; raises its error

Layout: ``DIR/step-00000100/`` per checkpoint (``hgraph.runtime.checkpoint``'s format). A restarted
job (``torchrun --max-restarts``) that calls ``resume`` continues exactly where the newest checkpoint
stopped: parameters, Adam state, learning-rate schedule, data position, RNG and planner state.

A folder belongs to one run (``checkpoint.run_identity``: the model and the data, in the manifest):

* ``resume`` loads the newest checkpoint that verifies on every rank (manifest by type, the checksum of
  every rank file each rank reads); a damaged newer one is skipped with a ``CheckpointWarning`` naming
  it. Checkpoints of another run make it refuse, naming the folder and what to do. A crash between the
  two renames of a replacing save left ``.step-N.old``: it is put back as ``step-N`` first.
* the first ``save`` of a manager refuses (before writing anything) to write into a folder holding
  checkpoints it did not resume from: another run's, or this run's newer ones (a restart without
  ``resume`` would write over them and retention would then delete the new ones).
* after a new checkpoint is complete, this run's oldest beyond ``keep`` are deleted (``keep=0``: none);
  never another run's.

Asynchronous writes (``async_write=True``, the default on process groups): ``save`` copies the
rank's shards to host memory on the training thread (``checkpoint.snapshot``), then DCP's
``async_save`` writes them in its background thread (the rank's file, fsynced, and ``.metadata``) and
the same thread takes part in the commit (``checkpoint.write_async``: the digests are all-gathered,
rank 0 writes the manifest and renames ``.step-N.partial`` to ``step-N``). The writer uses a gloo
process group of its own, so its collectives never interleave with the training's. At
most one write is in flight: a second ``save`` first waits for the first. A write that failed raises
its error at the next ``save``, ``wait`` or ``close``. A kill at any moment leaves every complete
checkpoint as it was. On simulated ranks (threads) or a single process the write is synchronous.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from hgraph.errors import CheckpointError, HGraphError
from hgraph.runtime import checkpoint
from hgraph.runtime.agreement import first_failure
from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm
from hgraph.runtime.kernels.failures import comm_timeout

STEP = re.compile(r"^step-(\d+)$")
OLD = re.compile(r"^\.step-(\d+)\.old$")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged) or recovered; the message names it."""


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


def recover_replaced(directory: str | Path) -> list[Path]:
    """Put back ``.step-N.old`` as ``step-N`` where a save that replaced ``step-N`` was killed between
    its two renames (``step-N`` has no manifest); returns the checkpoints put back. Rank 0 only."""
    root = Path(directory)
    if not root.is_dir():
        return []
    back = []
    for child in sorted(root.iterdir()):
        m = OLD.match(child.name)
        final = root / step_name(int(m.group(1))) if m else None
        if final is None or (final / checkpoint.MANIFEST).is_file() or not (child / checkpoint.MANIFEST).is_file():
            continue
        shutil.rmtree(final, ignore_errors=True)
        child.rename(final)
        back.append(final)
        warnings.warn(f"checkpoint {final} put back from {child.name}: a save that replaced it was interrupted",
                      CheckpointWarning, stacklevel=3)
    return back


def _identity_of(path: Path) -> tuple[Optional[dict[str, Any]], str]:
    """``(run identity, "")`` of checkpoint ``path``, or ``(None, why it cannot be read)``; a manifest
    written before run identities were recorded reads as ``({}, "")``."""
    try:
        return checkpoint.read_manifest(path).get("run") or {}, ""
    except CheckpointError as exc:
        return None, str(exc)


def same_run(saved: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether a checkpoint's run identity is this run's: the same model, and the same data where both
    say (a resume given no loader knows none); one recorded before identities were: by its model."""
    if not saved:
        return True
    keys = [k for k in set(saved) | set(mine) if k != "data" or (saved.get(k) is not None and mine.get(k) is not None)]
    return all(saved.get(k) == mine.get(k) for k in keys)


def latest(directory: str | Path) -> Optional[Path]:
    """The newest complete checkpoint in ``directory`` (a ``step-N`` folder, or a single checkpoint
    saved at ``directory`` itself by ``trainer.save``), else ``None``."""
    steps = complete_steps(directory)
    if steps:
        return steps[-1][1]
    single = checkpoint.resolve(directory)
    return single if (single / checkpoint.MANIFEST).is_file() else None


class _SideComm:
    """``all_gather`` and ``barrier`` over a gloo group of all ranks that only the writer thread uses
    (DCP's ``async_save`` runs on ``group`` too)."""

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
        self._write: Optional[Future] = None
        self._pending: Optional[Path] = None
        self.saved: list[Path] = []  # checkpoints this manager completed, oldest first
        self._resumed: Optional[Path] = None  # the checkpoint resume() loaded
        self._skipped: list[Path] = []  # damaged newer checkpoints resume() skipped (a save may replace them)
        self._identity: Optional[dict[str, Any]] = None  # this run's, once the folder was checked
        self.write_seconds: list[float] = []  # how long each write took (snapshot to commit)

    def __str__(self) -> str:
        mode = "asynchronous" if self.async_write else "synchronous"
        return f"CheckpointManager({self.directory}, every {self.interval or '-'} iterations, keep {self.keep}, {mode})"

    # ------------------------------------------------------------------ resume
    def resume(self, trainer: Any, data: Any = None) -> Optional[Path]:
        """Load the newest verified checkpoint of this run into ``trainer`` (and ``data``'s position) on
        every rank; returns it, or ``None`` when the folder holds none (a fresh start). Rank 0 lists
        the candidates; each is verified on every rank before any state is loaded."""
        message, candidates = "", []
        if trainer.rank == 0:
            recover_replaced(self.directory)
            for leftover in self.directory.glob(".step-*.partial"):  # saves a crash interrupted
                shutil.rmtree(leftover, ignore_errors=True)
            message, candidates = self._candidates(checkpoint.run_identity(trainer, data))
        message, candidates = json.loads(trainer._broadcast_bytes(json.dumps([message, candidates]).encode()))
        if message:
            raise CheckpointError(message)
        skipped = []
        for path in candidates:
            problem = None
            try:
                checkpoint.verify(trainer, path)
            except CheckpointError as exc:
                problem = str(exc)
            failure = first_failure(problem, trainer.comm, trainer.world, trainer.device)
            if failure is None:
                self._resumed, self._skipped = Path(path), [Path(p) for p in skipped]
                manifest = checkpoint.read_manifest(path)
                trainer.load(path, data=data if data is not None and manifest.get("data") else None)
                return Path(path)
            skipped.append(path)
            if trainer.rank == 0:
                warnings.warn(f"checkpoint {path} skipped, rank {failure[0]} cannot use it: {failure[1]}",
                              CheckpointWarning, stacklevel=2)
        if skipped:
            raise CheckpointError(f"{self.directory}: none of its {len(skipped)} checkpoints of this run "
                                  f"verifies (newest {skipped[0]}); see the warnings for each, or start "
                                  "afresh in another folder")
        return None

    def _candidates(self, mine: dict[str, Any]) -> tuple[str, list[str]]:
        """Rank 0: this run's checkpoints in the folder, newest first, or why the folder is not this
        run's (``(message, [])``)."""
        found, foreign = [], []
        for _, path in reversed(complete_steps(self.directory)):
            identity, _ = _identity_of(path)
            if identity is None or same_run(identity, mine):  # unreadable: verify() says why, then skipped
                found.append(str(path))
            else:
                foreign.append((path, identity))
        if foreign:
            return self._foreign_message(foreign[0], mine), []
        return "", found

    def _foreign_message(self, other: tuple[Path, dict[str, Any]], mine: dict[str, Any]) -> str:
        path, identity = other
        diff = ", ".join(f"{k}: {identity.get(k)!r} there, {mine.get(k)!r} here"
                         for k in sorted(set(identity) | set(mine))
                         if identity.get(k) != mine.get(k) and not same_run({k: identity.get(k)}, {k: mine.get(k)}))
        return (f"checkpoint folder {self.directory} holds another run's checkpoints ({path.name}: {diff}); "
                "hgraph never writes over them: give this run another checkpoint folder, or delete those "
                "checkpoints if they are not needed")

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
        if self._identity is None:
            self._check_folder(trainer)
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
        self._write = checkpoint.write_async(snap, path, self._side,
                                             then=lambda done: self._completed(done, snap.rank, started))
        if blocking:
            self.wait()
        return path

    def _check_folder(self, trainer: Any) -> None:
        """Before the first save, on every rank: refuse (``CheckpointError``) a folder whose checkpoints
        this manager did not resume from, so that nothing of another run, or later, is written over."""
        mine = checkpoint.run_identity(trainer)
        message = ""
        if trainer.rank == 0:
            recover_replaced(self.directory)
            base = -1 if self._resumed is None else int(STEP.match(self._resumed.name).group(1))
            skipped = {p.name for p in self._skipped}
            for iteration, path in reversed(complete_steps(self.directory)):
                identity, problem = _identity_of(path)
                if identity is not None and not same_run(identity, mine):
                    message = self._foreign_message((path, identity), mine)
                elif path.name not in skipped and iteration > base:
                    what = "resumed from " + self._resumed.name if self._resumed else "did not resume"
                    message = (f"checkpoint folder {self.directory} holds {path.name}, newer than where this run "
                               f"starts (it {what}): saving would write over or mix with it. Resume from it "
                               "(CheckpointManager.resume; `checkpoint.resume = true`), give this run another "
                               "checkpoint folder, or delete that checkpoint")
                if message:
                    break
        message = json.loads(trainer._broadcast_bytes(json.dumps(message).encode()))
        if message:
            raise CheckpointError(message)
        self._identity = mine

    def _completed(self, path: Path, rank: int, started: float) -> None:
        self.write_seconds.append(time.perf_counter() - started)
        self.saved.append(path)
        if rank == 0 and self.keep:
            ours = [p for _, p in complete_steps(self.directory)
                    if (identity := _identity_of(p)[0]) is not None and same_run(identity, self._identity or {})]
            for old in ours[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    @property
    def in_flight(self) -> bool:
        """Whether a background write has not finished yet."""
        return self._write is not None and not self._write.done()

    def wait(self) -> None:
        """Wait for the write in flight (if any); raise its error as a ``CheckpointError``."""
        write, self._write = self._write, None
        exc = write.exception() if write is not None else None
        if exc is not None:
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
