"""Sharded checkpoints of the optimization side: atomic to write, verified to read, reshardable.

A checkpoint is a directory: a ``torch.distributed.checkpoint`` (DCP) checkpoint and hgraph's
manifest on top::

    manifest.json        format, world size, iteration, parameter shapes and optimizer layouts,
                         sha256 and size of every file below, learning-rate state, data position,
                         planner state (online correction), run identity, user ``extra``
    .metadata            DCP's: every tensor's chunks (global offsets and sizes) and where they lie
    __0_0.distcp ...     per rank (DCP's names): its boxes of the fp32 master weights and Adam moments
                         (one chunk per box: ``checkpoint_dcp.ShardBoxes``), its RNG state (CPU, CUDA),
                         the step counts (written once)

Only the optimizer side is saved (the propagation side is rebuilt by Pull Parameter), so a
checkpoint does not depend on the strategies that trained it. A save is ``snapshot`` (host copies of
the state: the only part on the training path) then ``write`` (in this thread, or in the background
with DCP's ``async_save``: ``checkpoint_manager.py``). Atomicity: every rank writes into
``.<name>.partial``; once DCP has written ``.metadata`` rank 0 writes the manifest last and renames the
directory to ``<name>``; a crash anywhere before the rename leaves no directory that ``load`` accepts,
and a crash while a save replaces ``<name>`` leaves the previous checkpoint at ``.<name>.old``
(``resolve``). Safety: a file's checksum is checked against the manifest before it is read;
``.metadata`` is unpickled by an unpickler that builds DCP's metadata types only, tensors are read with
``torch.load(weights_only=True)``. ``load`` at any world size or optimizer layout asks DCP for this
rank's boxes of each tensor: it reads only the stored chunks that overlap them, from the files that
hold those, straight into the optimizer's tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hgraph.errors import CheckpointError, HGraphError
from hgraph.core import atomic_files
from hgraph.core.layout import Layout
from hgraph.core.placement import Replicate
from hgraph.lnk import solve
from hgraph.runtime import checkpoint_dcp
from hgraph.runtime.checkpoint_dcp import METADATA, ShardBoxes
from hgraph.runtime.kernels.reshard import execute
from hgraph.runtime.checkpoint_manifest import (FORMAT, MANIFEST, MANIFEST_KEYS, check_file, digest_tensor,
                                                layout_json, rank_file, read_manifest, saved_layouts, sha256)

__all__ = ["FORMAT", "MANIFEST", "MANIFEST_KEYS", "Snapshot", "full_state", "load", "rank_file", "read_manifest",
           "resolve", "run_identity", "save", "snapshot", "verify", "write", "write_async"]

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
PathLike = Union[str, os.PathLike]


def run_identity(trainer: Any, data: Any = None) -> dict[str, Any]:
    """What makes two checkpoints the same run's: the model (class, parameter names and shapes) and,
    when a ``TokenLoader`` feeds it, the data it reads in which order (``data``, else ``trainer.data``;
    rank 0 holds it). Not the world size, strategies or learning rate: a run may resume under others."""
    shapes = json.dumps(sorted((fqn, list(layout.shape)) for fqn, layout in trainer.compiled.optimizer_layouts.items()))
    source = data if data is not None else getattr(trainer, "data", None)
    loader = source.state_dict().get("loader") if hasattr(source, "state_dict") else None
    return {"model": type(trainer.compiled.model).__name__,
            "parameters": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "data": json.loads(json.dumps(loader)) if loader is not None else None}


def _rank_state(trainer: Any) -> dict[str, torch.Tensor]:
    """What this rank writes: its optimizer shards and RNG, as host (CPU) copies."""
    tensors = {}
    for name, entry in trainer.optimizer.shard_state().items():
        for key, value in entry.items():
            tensors[f"{key}/{name}"] = value.to("cpu", copy=True) if value.device.type != "cpu" else value
    tensors["rng/cpu"] = torch.get_rng_state()
    if trainer.device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(trainer.device)
    return tensors


@dataclass(frozen=True)
class Snapshot:
    """One rank's checkpoint content, copied off the training state at one iteration: its host tensors
    and (on every rank, written by the first) the manifest fields that describe them."""

    rank: int
    world: tuple[int, ...]
    iteration: int
    tensors: dict[str, torch.Tensor]
    manifest: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __str__(self) -> str:
        return f"Snapshot(rank {self.rank}, iteration {self.iteration}, {len(self.tensors)} tensors, {self.nbytes} bytes)"


def snapshot(trainer: Any, extra: Optional[dict[str, Any]] = None) -> Snapshot:
    """Copy ``trainer``'s state to host memory (the only part of a save on the training path);
    ``write`` puts a snapshot on disk, in this thread or another."""
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"extra={extra!r} is not JSON-serialisable ({exc}); use numbers, strings, lists and dicts"
        ) from None
    tensors = _rank_state(trainer)
    compiled = trainer.compiled
    group = trainer.optimizer.param_groups[0]
    planner = getattr(trainer, "planner", None)
    manifest = {
        "format": FORMAT,
        "world_size": len(trainer.world),
        "iteration": trainer.iteration,
        "strategies": [str(s) for s in compiled.strategies],
        "parameters": {
            fqn: {"shape": list(layout.shape), "dtype": "torch.float32",
                  "optimizer_layout": layout_json(layout)}
            for fqn, layout in compiled.optimizer_layouts.items()
        },
        "optimizer": {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"},
        "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
        "extra": extra_json,
        # the position of the TokenLoader that Trainer.step_data reads (rank 0 holds it)
        "data": trainer.data.state_dict() if getattr(trainer, "data", None) is not None else None,
        # what the planner learnt (its online correction); rank 0's is the one that plans
        "planner": planner.state_dict() if hasattr(planner, "state_dict") else None,
        "run": run_identity(trainer),
    }
    try:
        json.dumps(manifest)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the learning-rate scheduler state is not JSON-serialisable ({exc})") from None
    return Snapshot(trainer.rank, tuple(trainer.world), trainer.iteration, tensors, manifest)


def save(trainer: Any, path: PathLike, extra: Optional[dict[str, Any]] = None) -> Path:
    """Write ``trainer``'s optimizer state to the checkpoint directory ``path``; call on every rank.

    ``extra`` (JSON-serialisable) is stored in the manifest and returned by ``load``. An existing
    checkpoint at ``path`` is replaced only once the new one is complete.
    """
    return write(snapshot(trainer, extra), path, trainer.comm)


def _partial(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


def _rng_key(kind: str, rank: int) -> str:
    return f"rng/{kind}/rank{rank:05d}"


def _dcp_state(snap: Snapshot) -> dict[str, Any]:
    """What ``snap``'s rank gives DCP: its boxes of every state tensor, its RNG under its rank's name, the
    step counts (the same on every rank; DCP writes each once)."""
    layouts = saved_layouts(snap.manifest)
    state: dict[str, Any] = {}
    for key, value in snap.tensors.items():
        kind, name = key.split("/", 1)
        if kind in STATE_KEYS:
            state[key] = ShardBoxes.of(layouts[name], snap.rank, value)
        elif kind == "rng":
            state[_rng_key(name, snap.rank)] = value
        else:
            state[key] = value
    return state


def write(snap: Snapshot, path: PathLike, comm: Any) -> Path:
    """Put ``snap`` (every rank's, at the same iteration) on disk at ``path``: DCP writes each rank's
    file and ``.metadata`` into ``.<name>.partial``, then ``commit``. ``comm``: any communicator of the
    ranks (``all_gather`` and ``barrier`` over ``snap.world``) that no other thread is using."""
    final = Path(path)
    checkpoint_dcp.save(_dcp_state(snap), _partial(final), comm, snap.world, snap.rank)
    return commit(snap, final, comm)


def write_async(snap: Snapshot, path: PathLike, comm: Any,
                then: Optional[Callable[[Path], None]] = None) -> "Future[Path]":
    """``write`` in the background: DCP's ``async_save`` on ``comm.group`` (a gloo group that only the
    checkpoint writer uses), then ``commit`` and ``then(path)`` in its thread. The future holds the
    path once all of that is done, or the error."""
    final = Path(path)
    upload = dcp.async_save(_dcp_state(snap), storage_writer=checkpoint_dcp.FreshWriter(_partial(final)),
                            planner=checkpoint_dcp.BoxSavePlanner(), process_group=comm.group)
    done: Future[Path] = Future()

    def then_commit(saved: Future) -> None:
        try:
            saved.result()
            commit(snap, final, comm)
            if then is not None:
                then(final)
            done.set_result(final)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            done.set_exception(exc)

    upload.add_done_callback(then_commit)
    return done


def commit(snap: Snapshot, final: Path, comm: Any) -> Path:
    """After DCP wrote ``.<name>.partial``: the files' digests are all-gathered, the first rank writes
    the manifest and renames the directory to ``final``; every rank returns once it is there."""
    partial, world, rank = _partial(final), snap.world, snap.rank
    file = partial / rank_file(rank)
    if not file.is_file():
        raise CheckpointError(f"rank {rank} did not write {file}; the checkpoint is incomplete")
    digests = comm.all_gather(digest_tensor(sha256(file), file.stat().st_size).to(comm.device), world)
    if rank == world[0]:
        _write_manifest(snap, partial, digests.cpu())
        if final.exists():
            # a crash between these renames leaves the previous checkpoint complete at .<name>.old,
            # where load finds it
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(final)
        _fsync_directory(final.parent)
    comm.barrier(world)
    return final


def _fsync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (where the platform allows opening directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_manifest(snap: Snapshot, partial: Path, digests: torch.Tensor) -> None:
    manifest = dict(snap.manifest)
    files = {}
    for rank in snap.world:
        row = digests[rank].tolist()
        files[rank_file(rank)] = {"sha256": bytes(row[:32]).hex(), "bytes": row[32]}
    metadata = partial / METADATA
    files[METADATA] = {"sha256": sha256(metadata), "bytes": metadata.stat().st_size}
    manifest["files"] = files
    text = json.dumps(manifest, indent=1, sort_keys=True)
    atomic_files.write_text(partial / MANIFEST, text)


# ----------------------------------------------------------------------------- reading
def resolve(path: PathLike) -> Path:
    """``path``, or the previous checkpoint a save that replaced ``path`` left complete at
    ``.<name>.old`` when it was killed between its two renames."""
    final = Path(path)
    old = final.with_name(f".{final.name}.old")
    if not (final / MANIFEST).is_file() and (old / MANIFEST).is_file():
        return old
    return final


def _check_model(manifest: dict[str, Any], trainer: Any, path: PathLike) -> None:
    saved = manifest["parameters"]
    current = trainer.compiled.optimizer_layouts
    if set(saved) != set(current):
        missing, unknown = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        raise CheckpointError(f"checkpoint {path} does not match the model: missing parameters {missing}, "
                              f"unknown parameters {unknown}")
    for fqn, layout in current.items():
        if tuple(saved[fqn]["shape"]) != layout.shape:
            raise CheckpointError(
                f"checkpoint {path}: parameter {fqn!r} has shape {tuple(saved[fqn]['shape'])}, "
                f"the model's is {layout.shape}"
            )


def _load_state(trainer: Any, manifest: dict[str, Any], metadata: Metadata,
                tensors: dict[str, dict[str, torch.Tensor]], path: Path) -> dict[str, Any]:
    """What this rank asks DCP for: its boxes of every state tensor (views of ``tensors``, its local
    tensors in today's layouts), the step counts, and the RNG state of saved rank ``rank % saved world``."""
    rank, layouts = trainer.rank, trainer.compiled.optimizer_layouts
    state: dict[str, Any] = {}
    for name, layout in layouts.items():
        for key in STATE_KEYS:
            state[f"{key}/{name}"] = ShardBoxes.of(layout, rank, tensors[name][key])
        state[f"step/{name}"] = torch.zeros((), dtype=torch.int64)
    source = rank % int(manifest["world_size"])
    kinds = ("cpu", "cuda") if trainer.device.type == "cuda" else ("cpu",)
    for kind in kinds:
        stored = metadata.state_dict_metadata.get(_rng_key(kind, source))
        if isinstance(stored, TensorStorageMetadata):
            state[_rng_key(kind, source)] = torch.empty(stored.size, dtype=torch.uint8)
        elif kind == "cpu":
            raise CheckpointError(f"checkpoint {path} holds no CPU RNG state of rank {source}")
    return state


def _placeholders(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Storage-free local tensors of today's layouts (to plan a load without touching the optimizer)."""
    return {name: {key: torch.empty(layout.local_shape(trainer.rank), device="meta") for key in STATE_KEYS}
            for name, layout in trainer.compiled.optimizer_layouts.items()}


def _verified(trainer: Any, path: Path) -> tuple[dict[str, Any], Metadata]:
    """The manifest and DCP metadata of checkpoint ``path``, after the model, ``.metadata`` and every
    file this rank would read from were checked (``CheckpointError``)."""
    manifest = read_manifest(path)
    _check_model(manifest, trainer, path)
    check_file(path, manifest, METADATA)
    metadata = checkpoint_dcp.read_metadata(path)
    state = _load_state(trainer, manifest, metadata, _placeholders(trainer), path)
    for name in checkpoint_dcp.files_read(metadata, state):
        check_file(path, manifest, name)
    return manifest, metadata


def verify(trainer: Any, path: PathLike) -> None:
    """Check, on this rank, that ``load(trainer, path)`` can read checkpoint ``path``: the manifest by
    type, the model, and the checksum of ``.metadata`` and of every file this rank reads (``CheckpointError``)."""
    _verified(trainer, resolve(path))


def load(trainer: Any, path: PathLike) -> dict[str, Any]:
    """Restore ``trainer`` from checkpoint ``path`` on every rank; returns the saved ``extra``.

    Each rank asks DCP for its boxes of every tensor in today's optimizer layouts, which reads the
    overlapping stored chunks into the optimizer's own tensors (at the saved world size and layouts:
    exactly the rank's own file). A read that fails after the checks leaves the optimizer state partly
    loaded: the ``CheckpointError`` says so; build the Trainer anew.
    """
    path = resolve(path)
    manifest, metadata = _verified(trainer, path)
    if (manifest["lr_scheduler"] is None) != (trainer.lr_scheduler is None):
        saved_with = "without" if manifest["lr_scheduler"] is None else "with"
        raise CheckpointError(
            f"checkpoint {path} was saved {saved_with} a learning-rate scheduler; "
            "construct the Trainer the same way to resume"
        )
    live = trainer.optimizer.state_tensors()
    state = _load_state(trainer, manifest, metadata, live, path)
    try:
        checkpoint_dcp.load(state, path, metadata)
    except Exception as exc:  # noqa: BLE001 - an unreadable chunk, whatever DCP raises for it
        raise CheckpointError(f"checkpoint {path} could not be read ({type(exc).__name__}: {exc}); the "
                              "optimizer state is partly loaded: build the Trainer anew") from None
    trainer.optimizer.load_shard_state({name: {**live[name], "step": state[f"step/{name}"]} for name in live})
    group = trainer.optimizer.param_groups[0]
    for key, value in manifest["optimizer"].items():
        group[key] = tuple(value) if isinstance(value, list) else value
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
    planner, planner_state = getattr(trainer, "planner", None), manifest.get("planner")
    if planner_state is not None and hasattr(planner, "load_state_dict"):
        try:
            planner.load_state_dict(planner_state)
        except HGraphError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
    source = trainer.rank % int(manifest["world_size"])
    torch.set_rng_state(state[_rng_key("cpu", source)])
    if _rng_key("cuda", source) in state:
        torch.cuda.set_rng_state(state[_rng_key("cuda", source)], trainer.device)
    trainer.iteration = int(manifest["iteration"])
    trainer.comm.barrier(trainer.world)  # no rank trains on until every rank has its state
    return manifest["extra"]


def full_state(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's fp32 master value and Adam moments in full, on every rank (for checks)."""
    world = trainer.world
    state = trainer.optimizer.shard_state()
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in STATE_KEYS}
    for name, src in trainer.compiled.optimizer_layouts.items():
        plan = solve(src, Layout(src.shape, world, (len(world),), (Replicate(),)))
        for key in STATE_KEYS:
            out[key][name] = execute(plan, state[name][key], trainer.comm)
    return out
