"""On-disk cache of a compile's Pull / Push plans (``BuildConfig(cache_dir=...)`` or ``$HGRAPH_COMPILE_CACHE``).

The plans are the part of a compile that grows with the world. They are a pure function of what each
parameter moves between: its shape, the optimizer layout, the (pipeline, stage) users of every
strategy and their compute / gradient placements (which the traced graph, the sharding rules and
the user passes decide), the byte sizes and the topology, and of the solver's code. The key hashes
exactly those, with the hgraph and torch versions and the cache format, so another model, strategy,
option, rule or hgraph release gives another key.

An entry ``<key>.json`` is data, never code: a header line ``{"hgraph_compile_cache": FORMAT, "key",
"sha256"}`` and the payload, JSON (``hgraph.program.plan_codec``), loaded with ``json.loads`` and rebuilt
into frozen dataclasses field by field. An entry that is truncated, corrupt, for another key, not
JSON or JSON of another shape is reported (``CacheWarning``) and rebuilt, never used.

Like ssh with its keys, the cache is used only if no one else can write it: a directory that is
group- or other-writable, or owned by another user, is refused (``InputError`` naming
``chmod go-w DIR``) unless ``BuildConfig(trust_shared_cache=True)`` says that everyone who can write it is
trusted; an entry file writable by others is ignored and rewritten. The checksum catches damage,
not tampering: the permissions keep tampering out.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Optional, TypeVar

import torch

from hgraph.core import atomic_files
from hgraph.core.cache_entry import CacheWarning
from hgraph.errors import InputError

ENV = "HGRAPH_COMPILE_CACHE"
FORMAT = 2  # 1: a pickle (before 0.2); 2: JSON data
_HEADER_KEYS = {"hgraph_compile_cache", "key", "sha256"}
T = TypeVar("T")


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


def others_can_write(st: os.stat_result) -> Optional[str]:
    """Why someone other than this user could change what ``st`` describes, or ``None``."""
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "its group and others" if st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IWOTH else \
            "its group" if st.st_mode & stat.S_IWGRP else "other users"
        return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_uid not in (os.geteuid(), 0):
        return f"it is owned by another user (uid {st.st_uid})"
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number hgraph writes")


@dataclass(frozen=True)
class CompileCache:
    """One cache entry: ``directory/<key>.json``. ``trust_shared``: skip the permission checks."""

    directory: str
    key: str
    trust_shared: bool = False

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"{self.key}.json")

    def check_directory(self) -> None:
        """``InputError`` if others could write the directory (unless ``trust_shared``)."""
        if self.trust_shared:
            return
        try:
            st = os.stat(self.directory)
        except FileNotFoundError:
            return  # made private by ``store``
        problem = others_can_write(st)
        if problem is not None:
            raise InputError(
                f"compile cache directory {self.directory} refused: {problem}, so another user could plant "
                f"plans every job reading it would run. Fix: `chmod go-w {self.directory}` (and own it), "
                "or, if everyone who can write it is trusted, CompileOptions(build=BuildConfig(trust_shared_cache=True))")

    def load(self, decode: Callable[[Any], T]) -> Optional[T]:
        """``decode(payload)`` of the stored entry, or ``None`` when absent or unusable (warned; the
        caller rebuilds). ``decode`` raises ``ValueError`` / ``TypeError`` on data of the wrong shape."""
        self.check_directory()
        try:
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())
                blob = fh.read()
        except FileNotFoundError:
            return None
        problem = None if self.trust_shared else others_can_write(st)
        if problem is None:
            problem, payload = self._payload(blob)
        if problem is None:
            try:
                return decode(json.loads(payload, parse_constant=_reject_constant))
            except (ValueError, TypeError, KeyError, RecursionError) as exc:  # JSON, or data of another shape
                problem = f"it holds no plans hgraph can read ({type(exc).__name__}: {exc})"
        warnings.warn(f"compile cache entry {self.path} ignored and rebuilt: {problem}", CacheWarning, stacklevel=3)
        return None

    def _payload(self, blob: bytes) -> tuple[Optional[str], bytes]:
        """(what is wrong with the entry ``blob`` or ``None``, its payload)."""
        head, _, payload = blob.partition(b"\n")
        try:
            header = json.loads(head)
        except ValueError:
            return "it is not a JSON compile cache entry (no header line)", b""
        if type(header) is not dict or header.keys() != _HEADER_KEYS or header["hgraph_compile_cache"] != FORMAT:
            return f"it is not a format-{FORMAT} compile cache entry", b""
        if header["key"] != self.key:
            return "it is not an entry for this key", b""
        if hashlib.sha256(payload).hexdigest() != header["sha256"]:
            return "its checksum does not match (truncated or corrupt)", b""
        return None, payload

    def store(self, data: Any) -> None:
        """Write the JSON-ready ``data`` atomically (a temporary file renamed over the entry), readable
        by others but writable by this user only (unless ``trust_shared``: then the umask decides)."""
        os.makedirs(self.directory, mode=0o755, exist_ok=True)
        self.check_directory()
        payload = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
        header = json.dumps({"hgraph_compile_cache": FORMAT, "key": self.key,
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        with atomic_files.atomic_open(self.path, "wb", permissions=0o666 if self.trust_shared else 0o644) as fh:
            fh.write(header + b"\n" + payload)
