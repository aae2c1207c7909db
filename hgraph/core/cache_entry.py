"""Cache entries as data with a checksum: a header line (what the entry is, for which key, the
payload's sha256) and the JSON payload, written atomically (``hgraph.core.atomic_files``).

``load_entry`` returns ``None`` for an absent entry and, with a ``CacheWarning`` naming the file and
what is wrong, for a truncated, corrupt, foreign or malformed one: the caller measures again and
stores a fresh entry. Jobs sharing a cache folder see a whole entry or none.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from hgraph.core import atomic_files
from hgraph.core.atomic_files import PathLike

_HEADER_KEYS = {"hgraph_cache", "key", "sha256"}


class CacheWarning(UserWarning):
    """A cache entry was unusable (truncated, corrupt, foreign) and is rebuilt."""


def key_digest(key: Mapping[str, Any]) -> str:
    """A stable digest of the JSON-ready ``key``."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name} in a cache entry")


def store_entry(path: PathLike, kind: str, key: Mapping[str, Any], data: Any) -> None:
    """Write ``data`` (JSON-ready) as the ``kind`` entry of ``key`` at ``path``, atomically."""
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
    header = json.dumps({"hgraph_cache": kind, "key": key_digest(key),
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    atomic_files.write_bytes(path, header + b"\n" + payload)


def entry_problem(blob: bytes, kind: str, key: Mapping[str, Any], required: Sequence[str]) -> tuple[Optional[str], Any]:
    """(what is wrong with the entry ``blob`` or ``None``, its data)."""
    head, _, payload = blob.partition(b"\n")
    try:
        header = json.loads(head)
    except ValueError:
        return "it is not an hgraph cache entry (no header line)", None
    if type(header) is not dict or header.keys() != _HEADER_KEYS or header["hgraph_cache"] != kind:
        return f"it is not a {kind} cache entry", None
    if header["key"] != key_digest(key):
        return "it is an entry for another key", None
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        return "its checksum does not match (truncated or corrupt)", None
    try:
        data = json.loads(payload, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        return f"its payload is not JSON ({exc})", None
    missing = [name for name in required if type(data) is not dict or name not in data]
    if missing:
        return f"it lacks {missing}", None
    return None, data


def load_entry(path: PathLike, kind: str, key: Mapping[str, Any], required: Sequence[str] = ()) -> Optional[Any]:
    """The data of the ``kind`` entry of ``key`` at ``path`` (a dict holding ``required``), or
    ``None`` when absent or unusable (warned, naming the file; the caller rebuilds it)."""
    try:
        blob = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    problem, data = entry_problem(blob, kind, key, required)
    if problem is None:
        return data
    warnings.warn(f"{kind} cache entry {path} ignored and rebuilt: {problem}", CacheWarning, stacklevel=3)
    return None


__all__ = ["CacheWarning", "entry_problem", "key_digest", "load_entry", "store_entry"]
