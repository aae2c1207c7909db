"""Every file hgraph writes goes through here: written whole or not at all.

A file is written under a temporary name in its own folder, flushed and fsynced, moved over the
final name with ``os.replace`` (atomic on POSIX) and the folder fsynced, so a reader (another job
sharing the folder, or a run restarted after a crash) sees the old file or the new one, never a
half-written one. A writer that fails or is killed leaves only a hidden ``.<name>.*.tmp`` file.
``tests/reliability/test_atomic_writes.py`` forbids writing a final name any other way.
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Union

PathLike = Union[str, os.PathLike]


def temporary_name(path: PathLike) -> Path:
    """A fresh hidden name beside ``path`` (same folder, so ``os.replace`` stays one rename)."""
    final = Path(path)
    return final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def fsync_directory(directory: PathLike) -> None:
    """Make the names in ``directory`` (a rename, a removal) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(temporary: PathLike, path: PathLike) -> None:
    """fsync the finished ``temporary``, move it over ``path`` and fsync the folder."""
    fd = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    fsync_directory(Path(path).parent)


def discard(temporary: PathLike) -> None:
    """Remove an unfinished temporary file (absent is fine)."""
    try:
        os.unlink(temporary)
    except FileNotFoundError:
        pass


def create_temporary(path: PathLike) -> tuple[Path, IO[bytes]]:
    """A new temporary file beside ``path``, open for binary writing, for a writer that fills it
    piece by piece and then ``publish``es it (or ``discard``s it)."""
    final = Path(path)
    temporary = temporary_name(final)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    return temporary, os.fdopen(fd, "wb")


@contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """A temporary path for a library that writes by name (``tokenizer.save(str(tmp))``); published
    at ``path`` when the block ends, removed when it raises."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(final)
    try:
        yield temporary
        publish(temporary, final)
    except BaseException:
        discard(temporary)
        raise


@contextmanager
def atomic_open(path: PathLike, mode: str = "w", *, encoding: str | None = None,
                permissions: int = 0o666) -> Iterator[IO[Any]]:
    """``open(path, mode)`` for writing (``"w"`` or ``"wb"``), but the file appears at ``path`` only
    when the block ends without an exception, whole and fsynced. ``permissions``: as ``os.open``'s
    (the umask applies)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode {mode!r}; expected 'w' or 'wb'")
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    with atomic_path(path) as temporary:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, permissions)
        with os.fdopen(fd, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()


def write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_open(path, "w") as fh:
        fh.write(text)
    return Path(path)


def write_bytes(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)
    return Path(path)


__all__ = ["atomic_open", "atomic_path", "create_temporary", "discard", "fsync_directory", "publish", "temporary_name",
           "write_bytes", "write_text"]
