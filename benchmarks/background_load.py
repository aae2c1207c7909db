"""A background load for benchmarks: one busy Python process (half of a 2-core machine)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator

BUSY = "while True:\n    sum(range(10000))\n"


@contextlib.contextmanager
def background_load(on: bool = True) -> Iterator[None]:
    """Runs one busy process for the duration of the ``with`` block (nothing when ``on`` is false)."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY]) if on else None
    try:
        yield
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
