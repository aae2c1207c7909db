"""Write a safetensors checkpoint tensor by tensor, in HF's sharded format when it is large.

The names, dtypes and shapes are known before any value (they are the model's), so each file's
header is written first and every tensor's bytes are written at their offset the moment they arrive
(in any order): the writer holds one tensor at a time, whatever the size of the shard or the model. ``plan_shards`` groups the
tensors, in order, into files of at most ``max_shard_bytes`` (a larger tensor gets a file alone),
as ``save_pretrained(max_shard_size=...)`` does. One file is ``model.safetensors``; several are
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` (``metadata.total_size``
and the ``weight_map`` from tensor to file), which ``from_pretrained`` and ``SafetensorsCheckpoint``
read.

Each file is written under a temporary name and moved into place only when ``close`` has every
tensor, so a killed export leaves no file at a final name; ``close`` then removes the weight files
and index a previous export left in the folder (as ``save_pretrained`` does), so a reader never
mixes two exports.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import torch

from hgraph.core import atomic_files
from hgraph.core.checkpoint_files import CODES, INDEX_NAME, SINGLE_NAME
from hgraph.core.progress import progress
from hgraph.errors import InputError

DEFAULT_SHARD_SIZE = "5GB"  # HF's default in save_pretrained
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: Union[int, str]) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"``."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match:
        raise InputError(f"max_shard_size={size!r}; expected a positive number of bytes or a string like '5GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """``specs`` in order, cut into files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (size + spec.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


class _File:
    """One safetensors file, under a temporary name: its header written at once, each tensor written
    at its offset when it arrives (in any order); closed when the last one is in."""

    def __init__(self, path: Path, specs: list[TensorSpec]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offsets, offset = {}, 0
        for spec in specs:
            if spec.dtype not in CODES:
                raise InputError(f"cannot write tensor '{spec.name}' of dtype {spec.dtype} to safetensors")
            header[spec.name] = {"dtype": CODES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offsets[spec.name] = offset
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path = path
        self.offsets = {name: 8 + len(raw) + at for name, at in offsets.items()}
        self.temporary, self.fh = atomic_files.create_temporary(path)
        self.fh.write(len(raw).to_bytes(8, "little") + raw)
        self.fh.truncate(8 + len(raw) + offset)

    def write(self, spec: TensorSpec, value: torch.Tensor) -> None:
        data = value.detach().to(device="cpu", dtype=spec.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        self.fh.seek(self.offsets.pop(spec.name))
        self.fh.write(memoryview(data))
        if not self.offsets:
            self.fh.close()


class ShardedWriter:
    """Writes ``specs`` into ``directory`` as their values arrive (``write`` each once, in any order,
    then ``close``); a file is open from its first tensor to its last."""

    def __init__(self, directory: Union[str, os.PathLike], specs: Sequence[TensorSpec],
                 max_shard_bytes: Union[int, str] = DEFAULT_SHARD_SIZE) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shards = plan_shards(specs, parse_size(max_shard_bytes))
        n = len(self.shards)
        self.names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.pending = {spec.name: (i, spec) for i, shard in enumerate(self.shards) for spec in shard}
        self.files: dict[int, _File] = {}
        self.bar = progress(desc=f"writing {self.directory.name}", total=sum(s.nbytes for s in specs), unit="B")

    def write(self, name: str, value: torch.Tensor) -> None:
        """Write tensor ``name`` (planned, not yet written); its values are cast to the planned dtype."""
        if name not in self.pending:
            raise InputError(f"ShardedWriter got tensor '{name}', which is not planned or already written")
        shard, spec = self.pending[name]
        if tuple(value.shape) != spec.shape:
            raise InputError(f"tensor '{name}' has shape {tuple(value.shape)}, planned {spec.shape}")
        del self.pending[name]
        if shard not in self.files:
            self.files[shard] = _File(self.directory / self.names[shard], self.shards[shard])
        self.files[shard].write(spec, value)
        self.bar.update(spec.nbytes)

    def close(self) -> list[Path]:
        """Check every tensor arrived, move the files into place, write the index of a sharded
        checkpoint and remove a previous export's other weight files; returns the files written."""
        self.bar.close()
        if self.pending:
            self.abort()
            raise InputError(f"ShardedWriter closed with {len(self.pending)} tensors not written, e.g. "
                             f"{next(iter(self.pending))!r}")
        files = [self.directory / name for name in self.names]
        for i, file in sorted(self.files.items()):
            atomic_files.publish(file.temporary, self.directory / self.names[i])
        if len(self.shards) > 1:
            weight_map = {spec.name: self.names[i] for i, shard in enumerate(self.shards) for spec in shard}
            total = sum(spec.nbytes for shard in self.shards for spec in shard)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_files.write_text(self.directory / INDEX_NAME, json.dumps(index, indent=2) + "\n")
            files.append(self.directory / INDEX_NAME)
        self._remove_stale(files)
        return files

    def abort(self) -> None:
        """Remove the unfinished temporary files (no final name is touched)."""
        self.bar.close()
        for file in self.files.values():
            file.fh.close()
            atomic_files.discard(file.temporary)

    def _remove_stale(self, written: list[Path]) -> None:
        """Remove the weight files and index of an earlier export that this one did not write
        (the index first: a reader prefers it)."""
        keep = {p.name for p in written}
        stale = sorted((p for p in self.directory.iterdir() if _WEIGHT_FILE.fullmatch(p.name) and p.name not in keep),
                       key=lambda p: p.name != INDEX_NAME)
        for path in stale:
            path.unlink()
        if stale:
            atomic_files.fsync_directory(self.directory)


__all__ = ["DEFAULT_SHARD_SIZE", "ShardedWriter", "TensorSpec", "parse_size", "plan_shards"]
