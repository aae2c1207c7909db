"""The manifest of a checkpoint (``hgraph.runtime.checkpoint``): hgraph's record on top of a DCP checkpoint
(run identity, layouts, planner and data state, file digests), its format, and its validation by key and
by type, so that a well-formed but wrong manifest is refused by name, not inside ``load``; the digests
and layout encodings it records, and the check of a file against it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Union

import torch

from hgraph.core.layout import Layout
from hgraph.core.placement import parse_placement
from hgraph.errors import CheckpointError
from hgraph.runtime.checkpoint_dcp import METADATA

PathLike = Union[str, os.PathLike]
FORMAT = "hgraph-checkpoint-v2"  # v1: one torch.save file per rank (rankNNNNN.pt), before DCP
MANIFEST = "manifest.json"
MANIFEST_KEYS = ("format", "world_size", "iteration", "strategies", "parameters", "optimizer", "lr_scheduler",
                 "files", "extra")


def rank_file(rank: int) -> str:
    """The file DCP's writer gives ``rank`` (one per rank: ``single_file_per_rank``, one writer thread)."""
    return f"__{rank}_0.distcp"


def sha256(path: Path) -> str:
    """The hex sha256 of file ``path`` (read 1 MB at a time)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def layout_json(layout: Layout) -> dict[str, Any]:
    """An optimizer layout as the manifest records it (its shape is recorded beside it)."""
    placements = [str(p) for p in layout.placements]
    return {"mesh": list(layout.mesh), "ranks": list(layout.ranks), "placements": placements}


def layout_from_json(shape: list[int], entry: dict[str, Any]) -> Layout:
    return Layout(tuple(shape), tuple(entry["ranks"]), tuple(entry["mesh"]),
                  tuple(parse_placement(p) for p in entry["placements"]))


def digest_tensor(hexdigest: str, size: int) -> torch.Tensor:
    """sha256 and file size as int64s, so every rank's can be all-gathered (gloo has no strings)."""
    return torch.tensor(list(bytes.fromhex(hexdigest)) + [size], dtype=torch.int64)


def saved_layouts(manifest: dict[str, Any]) -> dict[str, Layout]:
    """The optimizer layouts the checkpoint was saved in, by parameter."""
    return {fqn: layout_from_json(p["shape"], p["optimizer_layout"]) for fqn, p in manifest["parameters"].items()}


def check_file(path: Path, manifest: dict[str, Any], name: str) -> None:
    """``name`` is listed in the manifest, present, and has the manifest's sha256."""
    file = path / name
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{name} is not listed in {path / MANIFEST}")
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the manifest lists it")
    digest = sha256(file)
    if digest != entry["sha256"]:
        raise CheckpointError(
            f"{file} is corrupt: sha256 {digest} does not match the manifest's {entry['sha256']}"
        )


def read_manifest(path: PathLike) -> dict[str, Any]:
    """The manifest of checkpoint ``path``; ``CheckpointError`` when it is missing or malformed."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {MANIFEST} is missing "
                              "(a save that did not finish, or the wrong directory)")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc})") from None
    if isinstance(manifest, dict) and manifest.get("format") == "hgraph-checkpoint-v1":
        raise CheckpointError(f"{file} is a {manifest['format']} checkpoint (rankNNNNN.pt files, written before "
                              f"hgraph saved through torch.distributed.checkpoint); this hgraph reads {FORMAT}: "
                              "resume it with the hgraph that wrote it and save again, or start afresh")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{file} has format {found!r}; expected {FORMAT!r}")
    missing = sorted(set(MANIFEST_KEYS) - set(manifest))
    if missing:
        raise CheckpointError(f"{file} lacks the fields {missing}; a manifest has {list(MANIFEST_KEYS)}")
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{file} is malformed: {problem}")
    return manifest


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


def _manifest_problem(manifest: dict[str, Any]) -> str:
    """What is wrong with the types of a manifest's fields (``""``: nothing), so that a well-formed but
    wrong manifest is refused by name instead of failing later inside ``load``."""
    if not _is_int(manifest["world_size"], 1):
        return f"world_size is {manifest['world_size']!r}; expected an integer >= 1"
    if not _is_int(manifest["iteration"]):
        return f"iteration is {manifest['iteration']!r}; expected an integer >= 0"
    for key, kind in (("strategies", list), ("parameters", dict), ("optimizer", dict), ("files", dict),
                      ("extra", dict)):
        if not isinstance(manifest[key], kind):
            return f"{key} is a {type(manifest[key]).__name__}; expected a {kind.__name__}"
    if manifest["lr_scheduler"] is not None and not isinstance(manifest["lr_scheduler"], dict):
        return f"lr_scheduler is a {type(manifest['lr_scheduler']).__name__}; expected a dict or null"
    for fqn, entry in manifest["parameters"].items():
        layout = entry.get("optimizer_layout") if isinstance(entry, dict) else None
        if not (isinstance(layout, dict) and _is_shape(entry.get("shape")) and _is_shape(layout.get("mesh"))
                and _is_shape(layout.get("ranks")) and isinstance(layout.get("placements"), list)
                and all(isinstance(p, str) for p in layout["placements"])):
            return (f"parameters[{fqn!r}] is {entry!r}; expected {{'shape': [ints], 'optimizer_layout': "
                    "{'mesh': [ints], 'ranks': [ints], 'placements': [strings]}}")
    for name, entry in manifest["files"].items():
        ok = isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _is_int(entry.get("bytes"))
        if not ok:
            return f"files[{name!r}] is {entry!r}; expected {{'sha256': string, 'bytes': int}}"
    missing = [rank_file(r) for r in range(manifest["world_size"]) if rank_file(r) not in manifest["files"]]
    if missing:
        return f"files lacks {missing[0]} of a world of {manifest['world_size']}"
    if METADATA not in manifest["files"]:
        return f"files lacks {METADATA} (DCP's metadata)"
    return ""
