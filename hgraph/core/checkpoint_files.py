"""Read an HF safetensors checkpoint by slices, after checking all of it that can be checked cheaply.

``SafetensorsCheckpoint(path)`` takes a ``.safetensors`` file, a directory holding
``model.safetensors``, or an HF sharded checkpoint (a directory with ``model.safetensors.index.json``
mapping each tensor to one of its shard files). Opening reads only the headers (8 bytes of length and
a JSON table of dtype, shape and byte range per tensor) and checks them: every file the index names
exists and holds the tensors the index puts there, every tensor's byte range fits its dtype and shape
and lies inside the file (a truncated file fails here, naming the first tensor it cuts). ``check``
then matches the model's parameters: each present, with the model's shape, in a float dtype hgraph
reads (F32, BF16, F16). Every failure is a ``CheckpointError`` naming the tensor and the file,
raised before anything is read.

``read(name, box)`` returns one box of a tensor (``((lo, hi), ...)`` per dim): only the bytes of that box
are read (one ``readinto`` per contiguous run: one for a block of rows), never the rest of the tensor,
and no file is memory-mapped, so a rank's memory holds what it reads and nothing else.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, Union

import torch

from hgraph.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
READABLE = ("F32", "BF16", "F16")  # upcast exactly into the fp32 master
CODES = {dtype: code for code, dtype in DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
PathLike = Union[str, os.PathLike]
Box = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies: its file, safetensors dtype code, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)} in {self.file.name} bytes {self.begin}..{self.end}"


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors listed in ``file``'s header, checked against the file's size and their dtypes."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 0 or length > min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"{file} is not a readable safetensors file: {size} bytes cannot hold the "
                                      f"header it announces ({length} bytes); the file is truncated or not safetensors")
            raw = fh.read(length)
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a table of tensors")
    header.pop("__metadata__", None)
    start = 8 + length
    out = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: the header entry of tensor '{name}' is malformed ({info!r})") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor '{name}' has dtype {dtype}, which hgraph does not know")
        itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
        if end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(f"{file}: tensor '{name}' ({dtype}{list(shape)}) spans {end - begin} bytes, "
                                  f"its shape needs {math.prod(shape) * itemsize}; the header is corrupt")
        if start + end > size:
            raise CheckpointError(f"{file} is truncated: tensor '{name}' needs bytes up to {start + end}, the file "
                                  f"has {size}")
        out[name] = StoredTensor(file, dtype, shape, start + begin, start + end)
    return out


def _resolve(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """Its files, and the index's tensor -> file map for a sharded checkpoint."""
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise CheckpointError(f"weights {path}: no such file or directory")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not an HF index (a JSON object with a 'weight_map'): {exc}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        files = []
        for name, file in weight_map.items():
            if not (path / file).is_file():
                raise CheckpointError(f"{index} puts tensor '{name}' in {file}, which is missing from {path}")
            files.append(path / file)
        return list(dict.fromkeys(files)), weight_map
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME], None
    raise CheckpointError(f"weights {path}: the directory holds neither {SINGLE_NAME} nor {INDEX_NAME}")


class SafetensorsCheckpoint:
    """A safetensors checkpoint (file, directory or HF sharded), its headers read and checked."""

    def __init__(self, path: PathLike) -> None:
        self.path = Path(os.path.expanduser(str(path)))
        files, weight_map = _resolve(self.path)
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            for name, stored in read_header(file).items():
                if weight_map is not None and weight_map.get(name) not in (None, file.name):
                    continue  # a tensor the index places in another file
                self.tensors.setdefault(name, stored)
        for name, file_name in (weight_map or {}).items():
            if name not in self.tensors:
                raise CheckpointError(f"{self.path / INDEX_NAME} puts tensor '{name}' in {file_name}, which does not "
                                      "hold it")
        self._handles: dict[Path, Any] | None = None

    def find(self, candidates: Sequence[str]) -> str | None:
        """The first of ``candidates`` (names a tensor may have) that the checkpoint holds."""
        return next((c for c in candidates if c in self.tensors), None)

    def check(self, expected: Mapping[str, tuple[tuple[int, ...], Sequence[str]]]) -> dict[str, str]:
        """Match ``expected`` (parameter -> (shape, names it may have in a checkpoint)); returns parameter ->
        checkpoint name, or raises ``CheckpointError`` on the first missing, misshapen or unreadable tensor."""
        found = {}
        for fqn, (shape, candidates) in expected.items():
            name = self.find(candidates)
            if name is None:
                raise CheckpointError(f"checkpoint {self.path} lacks tensor '{fqn}' (looked for {list(candidates)}); "
                                      f"it holds {len(self.tensors)} tensors, e.g. {sorted(self.tensors)[:3]}")
            stored = self.tensors[name]
            if stored.shape != tuple(shape):
                raise CheckpointError(f"checkpoint {stored.file}: tensor '{name}' has shape {list(stored.shape)}, the "
                                      f"model's parameter '{fqn}' has {list(shape)}")
            if stored.dtype not in READABLE:
                raise CheckpointError(f"checkpoint {stored.file}: tensor '{name}' has dtype {stored.dtype}; hgraph "
                                      f"reads {', '.join(READABLE)} into its fp32 master weights")
            found[fqn] = name
        return found

    @contextlib.contextmanager
    def open(self) -> Iterator["SafetensorsCheckpoint"]:
        """Within the block ``read`` works (the files stay open until it ends)."""
        self._handles = {}
        try:
            yield self
        finally:
            handles, self._handles = self._handles, None
            for fh in handles.values():
                fh.close()

    def read(self, name: str, box: Box) -> torch.Tensor:
        """The part ``box`` of tensor ``name`` (``()`` or a box per dim), in its stored dtype. Only the
        bytes of the box are read: one contiguous run per row of it that is not whole."""
        if self._handles is None:
            raise CheckpointError("SafetensorsCheckpoint.read outside `with checkpoint.open():`")
        stored = self.tensors[name]
        shape = stored.shape
        box = tuple(box) if box else tuple((0, n) for n in shape)
        fh = self._handles.get(stored.file)
        if fh is None:
            try:
                fh = self._handles[stored.file] = open(stored.file, "rb", buffering=0)
            except OSError as exc:
                raise CheckpointError(f"cannot open {stored.file}: {exc.strerror or exc}") from None
        out = torch.empty([hi - lo for lo, hi in box], dtype=DTYPES[stored.dtype])
        target = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        itemsize = out.element_size()
        strides = [math.prod(shape[d + 1:]) * itemsize for d in range(len(shape))]
        whole = len(shape)  # dims from ``whole`` on are read in full
        while whole > 0 and box[whole - 1] == (0, shape[whole - 1]):
            whole -= 1
        run = (box[whole - 1][1] - box[whole - 1][0]) * strides[whole - 1] if whole else target.nbytes
        outer = itertools.product(*(range(lo, hi) for lo, hi in box[: max(whole - 1, 0)]))
        first = box[whole - 1][0] * strides[whole - 1] if whole else 0
        for k, index in enumerate(outer):
            offset = stored.begin + first + sum(i * st for i, st in zip(index, strides))
            fh.seek(offset)
            got = fh.readinto(target[k * run:(k + 1) * run])
            if got != run:
                raise CheckpointError(f"{stored.file} ended while reading tensor '{name}' (offset {offset}); the file "
                                      "was truncated after it was opened")
        return out


__all__ = ["CODES", "DTYPES", "INDEX_NAME", "READABLE", "SINGLE_NAME", "SafetensorsCheckpoint", "StoredTensor",
           "read_header"]
