"""Write a safetensors checkpoint tensor by tensor, in HF's sharded format when it is large.

The names, dtypes and shapes are known before any value (they are the model's), so each file's
header is written first and every tensor's bytes are appended the moment it arrives: the writer
holds one tensor at a time, whatever the size of the shard or the model. ``plan_shards`` groups the
tensors, in order, into files of at most ``max_shard_bytes`` (a larger tensor gets a file alone),
as ``save_pretrained(max_shard_size=...)`` does. One file is ``model.safetensors``; several are
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` (``metadata.total_size``
and the ``weight_map`` from tensor to file), which ``from_pretrained`` and ``SafetensorsCheckpoint``
read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from hgraph.checkpoint_files import CODES, INDEX_NAME, SINGLE_NAME
from hgraph.errors import InputError

DEFAULT_SHARD_SIZE = "5GB"  # HF's default in save_pretrained
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
    """One safetensors file: header written at once, tensors appended in header order."""

    def __init__(self, path: Path, specs: list[TensorSpec]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in specs:
            if spec.dtype not in CODES:
                raise InputError(f"cannot write tensor '{spec.name}' of dtype {spec.dtype} to safetensors")
            header[spec.name] = {"dtype": CODES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path, self.pending = path, list(specs)
        self.fh = open(path, "wb")
        self.fh.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, spec: TensorSpec, value: torch.Tensor) -> None:
        self.fh.write(value.detach().to(device="cpu", dtype=spec.dtype).contiguous().reshape(-1).view(torch.uint8).numpy())
        self.pending.pop(0)
        if not self.pending:
            self.fh.close()


class ShardedWriter:
    """Writes ``specs`` into ``directory`` as their values arrive (``write`` in order, then ``close``)."""

    def __init__(self, directory: Union[str, os.PathLike], specs: Sequence[TensorSpec],
                 max_shard_bytes: Union[int, str] = DEFAULT_SHARD_SIZE) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shards = plan_shards(specs, parse_size(max_shard_bytes))
        n = len(self.shards)
        self.names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.queue = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self.position = 0
        self.file: Optional[_File] = None

    def write(self, name: str, value: torch.Tensor) -> None:
        """Append tensor ``name`` (the next one in order); its values are cast to the planned dtype."""
        if self.position >= len(self.queue) or self.queue[self.position][1].name != name:
            expected = self.queue[self.position][1].name if self.position < len(self.queue) else "nothing"
            raise InputError(f"ShardedWriter got tensor '{name}', expected {expected!r}")
        shard, spec = self.queue[self.position]
        if tuple(value.shape) != spec.shape:
            raise InputError(f"tensor '{name}' has shape {tuple(value.shape)}, planned {spec.shape}")
        if self.file is None or self.file.path.name != self.names[shard]:
            self.file = _File(self.directory / self.names[shard], self.shards[shard])
        self.file.write(spec, value)
        self.position += 1

    def close(self) -> list[Path]:
        """Check every tensor arrived, write the index of a sharded checkpoint; returns the files written."""
        if self.position != len(self.queue):
            raise InputError(f"ShardedWriter closed after {self.position} of {len(self.queue)} tensors")
        files = [self.directory / name for name in self.names]
        if len(self.shards) > 1:
            weight_map = {spec.name: self.names[i] for i, shard in enumerate(self.shards) for spec in shard}
            total = sum(spec.nbytes for shard in self.shards for spec in shard)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            files.append(self.directory / INDEX_NAME)
        return files


__all__ = ["DEFAULT_SHARD_SIZE", "ShardedWriter", "TensorSpec", "parse_size", "plan_shards"]
