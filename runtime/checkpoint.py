"""Sharded checkpoints of the optimization side: atomic to write, verified to read, reshardable.

A checkpoint is a directory::

    manifest.json        format, world size, iteration, parameter shapes and optimizer layouts,
                         per-file tensor shapes/dtypes and sha256, learning-rate state, data
                         position, planner state (online correction), user ``extra``
    rank00000.pt ...     per rank: fp32 master shards, Adam moments and steps, RNG state (CPU, CUDA)

Only the optimizer side is saved (the propagation side is rebuilt by Pull Parameter), so a
checkpoint does not depend on the strategies that trained it. A save is ``snapshot`` (host copies of
the state: the only part on the training path) then ``write`` (in this thread, or in the background:
``checkpoint_manager.py``). Atomicity: every rank writes into ``.<name>.partial``; after a barrier
rank 0 checks nothing is missing, writes the manifest last and renames the directory to ``<name>``;
a crash anywhere before the rename leaves no directory that ``load`` accepts, and a crash while a
save replaces ``<name>`` leaves the previous checkpoint at ``.<name>.old`` (``resolve``). Safety: rank files are read with ``torch.load(weights_only=True)`` after their
checksum matched, the manifest is JSON. ``load`` into another world size or optimizer layout
reshards every shard with the LNK solver (``hgraph.lnk.solve`` + ``simulate``) from the saved layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from hgraph.errors import CheckpointError, HGraphError
from hgraph.core import atomic_files
from hgraph.core.layout import Layout
from hgraph.core.placement import parse_placement, Replicate
from hgraph.core.progress import progress_writes
from hgraph.runtime.kernels.simulate import simulate
from hgraph.lnk import solve
from hgraph.runtime.kernels.reshard import execute
from hgraph.runtime.checkpoint_manifest import FORMAT, MANIFEST, MANIFEST_KEYS, rank_file, read_manifest

__all__ = ["FORMAT", "MANIFEST", "MANIFEST_KEYS", "Snapshot", "full_state", "load", "rank_file", "read_manifest",
           "read_rank_file", "resolve", "run_identity", "save", "snapshot", "verify", "write"]

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
PathLike = Union[str, os.PathLike]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _layout_json(layout: Layout) -> dict[str, Any]:
    placements = [str(p) for p in layout.placements]
    return {"mesh": list(layout.mesh), "ranks": list(layout.ranks), "placements": placements}


def _layout_from_json(shape: list[int], entry: dict[str, Any]) -> Layout:
    return Layout(tuple(shape), tuple(entry["ranks"]), tuple(entry["mesh"]),
                  tuple(parse_placement(p) for p in entry["placements"]))


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


def _digest_tensor(hexdigest: str, size: int) -> torch.Tensor:
    """sha256 and file size as int64s, so every rank's can be all-gathered (gloo has no strings)."""
    return torch.tensor(list(bytes.fromhex(hexdigest)) + [size], dtype=torch.int64)


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
                  "optimizer_layout": _layout_json(layout)}
            for fqn, layout in compiled.optimizer_layouts.items()
        },
        "optimizer": {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"},
        "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
        "extra": extra_json,
        # the position of the TokenLoader that Trainer.step_data reads (rank 0 holds it)
        "data": trainer.data.state_dict() if getattr(trainer, "data", None) is not None else None,
        # what the planner learnt (its online correction); rank 0's is the one that plans
        "planner": planner.state_dict() if hasattr(planner, "state_dict") else None,
        "tensors": {key: {"shape": list(v.shape), "dtype": str(v.dtype)} for key, v in tensors.items()},
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


def write(snap: Snapshot, path: PathLike, comm: Any) -> Path:
    """Put ``snap`` (every rank's, at the same iteration) on disk at ``path``: each rank its file in
    ``.<name>.partial``, then the first rank the manifest and the rename. ``comm``: any communicator
    of the ranks (``all_gather`` and ``barrier`` over ``snap.world``) that no other thread is using."""
    final = Path(path)
    partial = final.with_name(f".{final.name}.partial")
    world, rank = snap.world, snap.rank
    if rank == world[0]:
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of a crashed save
        partial.mkdir(parents=True)
    comm.barrier(world)
    file = partial / rank_file(rank)
    with atomic_files.atomic_open(file, "wb") as fh, progress_writes(
            fh, desc=f"writing checkpoint {final.name}", total=snap.nbytes, show=rank == world[0]) as counted:
        torch.save(snap.tensors, counted)
    digests = comm.all_gather(_digest_tensor(_sha256(file), file.stat().st_size).to(comm.device), world)
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
    manifest = {k: v for k, v in snap.manifest.items() if k != "tensors"}
    layouts = {fqn: _layout_from_json(p["shape"], p["optimizer_layout"]) for fqn, p in manifest["parameters"].items()}
    files = {}
    for rank in snap.world:
        name = rank_file(rank)
        if not (partial / name).is_file():
            raise CheckpointError(f"rank {rank} did not write {partial / name}; the checkpoint is incomplete")
        row = digests[rank].tolist()
        tensors = {}
        for key, spec in snap.manifest["tensors"].items():
            if key.startswith("rng/") or key.startswith("step/"):
                tensors[key] = spec
                continue
            tensors[key] = {"shape": list(layouts[key.split("/", 1)[1]].local_shape(rank)), "dtype": spec["dtype"]}
        files[name] = {"sha256": bytes(row[:32]).hex(), "bytes": row[32], "tensors": tensors}
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


def read_rank_file(path: PathLike, manifest: dict[str, Any], name: str) -> dict[str, torch.Tensor]:
    """One rank file, verified: checksum first, then ``weights_only`` load, then shapes and dtypes."""
    file = Path(path) / name
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{name} is not listed in {Path(path) / MANIFEST}")
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the manifest lists it")
    digest = _sha256(file)
    if digest != entry["sha256"]:
        raise CheckpointError(
            f"{file} is corrupt: sha256 {digest} does not match the manifest's {entry['sha256']}"
        )
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise CheckpointError(f"{file} cannot be read safely ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or set(state) != set(entry["tensors"]):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{file} holds {got}; the manifest lists {sorted(entry['tensors'])}")
    for key, spec in entry["tensors"].items():
        value = state[key]
        ok = isinstance(value, torch.Tensor) and list(value.shape) == spec["shape"]
        if not ok or str(value.dtype) != spec["dtype"]:
            got = f"{getattr(value, 'dtype', type(value).__name__)} {list(getattr(value, 'shape', []))}"
            raise CheckpointError(
                f"{file}: {key} is {got}; the manifest says {spec['dtype']} {spec['shape']}"
            )
    return state


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


def _same_layouts(manifest: dict[str, Any], trainer: Any) -> bool:
    """Whether the checkpoint was saved at this world size and optimizer layout (no resharding)."""
    layouts = trainer.compiled.optimizer_layouts
    return int(manifest["world_size"]) == len(trainer.world) and all(
        _layout_from_json(p["shape"], p["optimizer_layout"]) == layouts[fqn]
        for fqn, p in manifest["parameters"].items()
    )


def _files_to_read(manifest: dict[str, Any], trainer: Any) -> list[str]:
    """The rank files ``load`` reads on this rank: its own at the same layouts, else all."""
    if _same_layouts(manifest, trainer):
        return [rank_file(trainer.rank)]
    return [rank_file(r) for r in range(int(manifest["world_size"]))]


def verify(trainer: Any, path: PathLike) -> None:
    """Check, on this rank, that ``load(trainer, path)`` can read checkpoint ``path``: the manifest by
    type, the model, and the checksum and contents of every rank file this rank reads (``CheckpointError``)."""
    path = resolve(path)
    manifest = read_manifest(path)
    _check_model(manifest, trainer, path)
    for name in _files_to_read(manifest, trainer):
        read_rank_file(path, manifest, name)


def load(trainer: Any, path: PathLike) -> dict[str, Any]:
    """Restore ``trainer`` from checkpoint ``path`` on every rank; returns the saved ``extra``.

    Same world and layouts: each rank reads its own file. Otherwise every rank reads all rank files
    and reshards each tensor from the saved optimizer layout to its own (LNK plan, simulated).
    """
    path = resolve(path)
    manifest = read_manifest(path)
    _check_model(manifest, trainer, path)
    rank = trainer.rank
    saved_world = int(manifest["world_size"])
    layouts = trainer.compiled.optimizer_layouts
    if _same_layouts(manifest, trainer):
        mine = read_rank_file(path, manifest, rank_file(rank))
        rng, cuda_rng = mine["rng/cpu"], mine.get("rng/cuda")
        shards = {name: {key: mine[f"{key}/{name}"] for key in STATE_KEYS + ("step",)} for name in layouts}
    else:
        files = [read_rank_file(path, manifest, rank_file(r)) for r in range(saved_world)]
        rng, cuda_rng = files[rank % saved_world]["rng/cpu"], files[rank % saved_world].get("rng/cuda")
        shards = {}
        for name, layout in layouts.items():
            entry = manifest["parameters"][name]
            src = _layout_from_json(entry["shape"], entry["optimizer_layout"])
            plan = solve(src, layout, itemsize=4)
            shards[name] = {
                key: simulate(plan, {r: files[r][f"{key}/{name}"] for r in src.ranks})[rank]
                for key in STATE_KEYS
            }
            shards[name]["step"] = files[0][f"step/{name}"]
    trainer.optimizer.load_shard_state(shards)
    group = trainer.optimizer.param_groups[0]
    for key, value in manifest["optimizer"].items():
        group[key] = tuple(value) if isinstance(value, list) else value
    if (manifest["lr_scheduler"] is None) != (trainer.lr_scheduler is None):
        saved_with = "without" if manifest["lr_scheduler"] is None else "with"
        raise CheckpointError(
            f"checkpoint {path} was saved {saved_with} a learning-rate scheduler; "
            "construct the Trainer the same way to resume"
        )
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
    planner, planner_state = getattr(trainer, "planner", None), manifest.get("planner")
    if planner_state is not None and hasattr(planner, "load_state_dict"):
        try:
            planner.load_state_dict(planner_state)
        except HGraphError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
    torch.set_rng_state(rng)
    if cuda_rng is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(cuda_rng, trainer.device)
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
