"""On-disk cache of a compile's Pull / Push plans (``compile(cache_dir=...)`` or ``$HGRAPH_COMPILE_CACHE``).

The plans are the part of a compile that grows with the world. They are a pure function of what each
parameter moves between: its shape, the optimizer layout, the (pipeline, stage) users of every
strategy and their compute / gradient placements (which the traced graph, the sharding rules and
the user passes decide), the byte sizes and the topology, and of the solver's code. The key hashes
exactly those, with the hgraph and torch versions and the cache format, so another model, strategy,
option, rule or hgraph release gives another key. An entry stores its key and a SHA-256 of its
payload; a truncated, corrupt or foreign entry is reported (``CacheWarning``) and rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Optional

import torch

ENV = "HGRAPH_COMPILE_CACHE"
FORMAT = 1
_MAGIC = b"hgraph-compile-cache\n"


class CacheWarning(UserWarning):
    """A compile cache entry could not be used and was rebuilt."""


def _version() -> str:
    try:
        return metadata.version("hgraph")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "source"


def cache_directory(explicit: Optional[str]) -> Optional[str]:
    """``explicit``, else ``$HGRAPH_COMPILE_CACHE``, else ``None`` (no cache)."""
    return explicit or os.environ.get(ENV) or None


def plan_key(inputs: Any) -> str:
    """Hex key of the plans built from ``inputs`` (a repr-stable structure of tuples, strings, ints)."""
    h = hashlib.sha256()
    h.update(repr((FORMAT, _version(), torch.__version__)).encode())
    h.update(repr(inputs).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class CompileCache:
    """One cache entry: ``directory/<key>.pkl``."""

    directory: str
    key: str

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"{self.key}.pkl")

    def load(self) -> Optional[dict]:
        """The stored products, or ``None`` when absent or unusable (warned; the caller rebuilds)."""
        try:
            with open(self.path, "rb") as fh:
                blob = fh.read()
        except FileNotFoundError:
            return None
        head = len(_MAGIC)
        digest, key, payload = blob[head:head + 64], blob[head + 64:head + 128], blob[head + 128:]
        problem = None
        if blob[:head] != _MAGIC or key != self.key.encode():
            problem = "it is not an entry for this key"
        elif hashlib.sha256(payload).hexdigest().encode() != digest:
            problem = "its checksum does not match (truncated or corrupt)"
        else:
            try:
                return pickle.loads(payload)
            except Exception as exc:  # noqa: BLE001 - any unpickling failure means: rebuild
                problem = f"it does not unpickle ({type(exc).__name__}: {exc})"
        warnings.warn(f"compile cache entry {self.path} ignored and rebuilt: {problem}", CacheWarning, stacklevel=3)
        return None

    def store(self, products: dict) -> None:
        """Write ``products`` atomically (a temporary file renamed over the entry)."""
        os.makedirs(self.directory, exist_ok=True)
        payload = pickle.dumps(products, protocol=pickle.HIGHEST_PROTOCOL)
        blob = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + self.key.encode() + payload
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, self.path)
