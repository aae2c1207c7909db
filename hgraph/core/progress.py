"""Progress bars for long library work: profiling, compiling many strategies, export, checkpoint writes.

A bar is tqdm's, on stderr, shown only when stderr is a terminal (a log file or a pipe gets none) and
never when ``HGRAPH_PROGRESS=0`` (the CLI's ``--quiet`` sets it); ``HGRAPH_PROGRESS=1`` shows bars
on any stderr. Bars appear after ``DELAY_S`` (work that ends sooner shows none) and are transient
(``leave=False``): what a run reports stays in its log records.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, Optional, TypeVar

from tqdm.auto import tqdm

from hgraph.errors import InputError

PROGRESS_ENV = "HGRAPH_PROGRESS"
DELAY_S = 0.5
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")

T = TypeVar("T")


def progress_enabled() -> bool:
    """Whether bars are shown: ``HGRAPH_PROGRESS`` when set, else whether stderr is a terminal."""
    setting = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if setting in _ON:
        return True
    if setting in _OFF:
        return False
    if setting:
        raise InputError(f"{PROGRESS_ENV}={os.environ[PROGRESS_ENV]!r}; expected 1 (bars on any stderr), "
                         "0 (no bars) or unset (bars when stderr is a terminal)")
    return sys.stderr.isatty()


def progress(iterable: Optional[Iterable[T]] = None, *, desc: str, total: Optional[float] = None,
             unit: str = "it", show: bool = True, **options: Any) -> "tqdm[T]":
    """A tqdm bar over ``iterable`` (or one to ``update`` by hand), silent unless ``progress_enabled``
    and ``show`` (e.g. ``show=rank == 0``); ``unit="B"`` counts bytes in KB/MB/GB."""
    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False, file=sys.stderr, delay=DELAY_S,
                disable=not (show and progress_enabled()), dynamic_ncols=True, **scale, **options)


__all__ = ["DELAY_S", "PROGRESS_ENV", "progress", "progress_enabled"]
