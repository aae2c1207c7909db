"""Documents from local files, streamed through HF ``datasets`` (local files only, nothing downloaded).

Formats: ``"text"`` (one document per file), ``"lines"`` (one per non-empty line), ``"jsonl"`` (JSON
Lines, the document in ``text_field``) and ``"parquet"`` (the document in column ``text_field``).
Streaming: ``datasets`` reads the files lazily, so a corpus larger than memory is fine. Each epoch
visits the files in a seeded order (a file is a stream shard); ``documents(epoch, skip)`` resumes
at any document of an epoch by skipping, so a data position is just ``(epoch, documents read)``.
"""

from __future__ import annotations

import glob
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from hgraph.errors import InputError

FORMATS = {"text": "text", "lines": "text", "jsonl": "json", "parquet": "parquet"}
SUFFIXES = {"text": ("",), "lines": ("",), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}


def expand_paths(paths: Sequence[str], format: str, pattern: str | None = None) -> tuple[str, ...]:
    """Files named by ``paths``: files as given, directories searched recursively (``pattern``, or
    the format's suffixes), globs expanded; sorted, so every rank and run sees the same list."""
    files: list[str] = []
    for raw in paths:
        p = os.path.expanduser(str(raw))
        if any(ch in p for ch in "*?["):
            hits = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
            if not hits:
                raise InputError(f"data path {raw!r}: the pattern matches no file")
            files += hits
        elif os.path.isdir(p):
            hits = sorted(
                str(f) for f in Path(p).rglob(pattern or "*")
                if f.is_file() and (pattern or any(f.name.endswith(s) for s in SUFFIXES[format]))
            )
            if not hits:
                raise InputError(f"data path {raw!r}: the directory holds no {pattern or format} file")
            files += hits
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise InputError(f"data path {raw!r}: no such file or directory")
    return tuple(sorted(dict.fromkeys(files)))


@dataclass(frozen=True)
class DocumentSource:
    """Where the documents are: ``files`` (see ``expand_paths``) in ``format``."""

    files: tuple[str, ...]
    format: str = "text"
    text_field: str = "text"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InputError(f"data format {self.format!r} is not supported; use one of {sorted(FORMATS)}")
        if not self.files:
            raise InputError("the corpus names no file; give at least one data path")

    @classmethod
    def from_paths(cls, paths: Sequence[str], format: str = "text", text_field: str = "text",
                   pattern: str | None = None) -> "DocumentSource":
        if format not in FORMATS:
            raise InputError(f"data format {format!r} is not supported; use one of {sorted(FORMATS)}")
        if isinstance(paths, (str, os.PathLike)):
            paths = [str(paths)]
        return cls(expand_paths(paths, format, pattern), format, text_field)

    def __str__(self) -> str:
        first = self.files[0] if len(self.files) == 1 else f"{self.files[0]} ... ({len(self.files)} files)"
        return f"{self.format} documents from {first}"

    def file_order(self, epoch: int, seed: int) -> list[str]:
        """The files of ``epoch`` in their seeded order."""
        order = list(self.files)
        random.Random(f"{seed}:{epoch}").shuffle(order)
        return order

    def documents(self, epoch: int = 0, seed: int = 0, skip: int = 0) -> Iterator[str]:
        """The documents of ``epoch`` in stream order, from document ``skip`` on."""
        files = self.file_order(epoch, seed)
        stream = _stream(files, self.format)
        if skip:
            stream = stream.skip(skip)
        field = self.text_field
        try:
            for row in stream:
                if field not in row:
                    raise InputError(f"{self}: a record has no field {field!r} (it has {sorted(row)}); "
                                     "set the text field")
                text = row[field]
                if not isinstance(text, str):
                    raise InputError(f"{self}: field {field!r} holds {type(text).__name__}, not text")
                if text.strip() if self.format == "lines" else text:
                    yield text
        except UnicodeDecodeError:
            raise InputError(_undecodable(files)) from None
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - datasets/pyarrow parse errors: name the corpus instead
            raise InputError(f"{self}: cannot read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None


def _stream(files: list[str], format: str):
    """An ``IterableDataset`` over ``files`` (offline, no progress bars)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    kwargs = {"sample_by": "document" if format == "text" else "line"} if format in ("text", "lines") else {}
    return datasets.load_dataset(FORMATS[format], data_files=files, split="train", streaming=True, **kwargs)


def _undecodable(files: Sequence[str]) -> str:
    """Name the first file that is not UTF-8, with the byte offset."""
    for f in files:
        data = Path(f).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"data file {f}: byte {exc.start} (0x{data[exc.start]:02x}) is not valid UTF-8; re-encode the file"
    return f"a data file among {len(files)} is not valid UTF-8"
