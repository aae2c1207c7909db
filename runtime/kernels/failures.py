"""Rank failures: collective timeouts, and transport errors turned into errors that name the step.

When a rank dies or stops, torch.distributed raises a bare ``RuntimeError`` on its peers (gloo:
"Connection closed by peer", or a timeout after ``HGRAPH_COMM_TIMEOUT`` seconds). ``comm_step``
turns that into a ``CommunicationError`` naming the calling rank and what it was doing (which
Pull Parameter, Push Gradient or activation exchange, with which peers), so the launcher can tell
the root cause (the rank that died or raised first) from its consequences.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Iterator

from hgraph.errors import CommunicationError

DEFAULT_COMM_TIMEOUT = 300.0
"""Seconds a collective may wait for its peers before it fails (``hgraph.launch`` passes its own)."""

TIMEOUT_ENV = "HGRAPH_COMM_TIMEOUT"

_TRANSPORT_MARKERS = (
    "gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out", "timeout",
    "socket", "process group", "processgroup",
)


def comm_timeout() -> datetime.timedelta:
    """The collective timeout of this process: ``$HGRAPH_COMM_TIMEOUT`` seconds, else the default."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return datetime.timedelta(seconds=DEFAULT_COMM_TIMEOUT)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise CommunicationError(f"{TIMEOUT_ENV}={text!r}; it must be a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` reports a failed or stuck peer rather than a bug in this rank's own work."""
    if isinstance(exc, CommunicationError):
        return True
    try:
        from torch.distributed import DistError

        if isinstance(exc, DistError):
            return True
    except ImportError:  # builds without torch.distributed
        pass
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _TRANSPORT_MARKERS)


@contextlib.contextmanager
def comm_step(rank: int, what: str) -> Iterator[None]:
    """Re-raise a transport failure in the block as ``CommunicationError`` naming ``rank`` and ``what``."""
    try:
        yield
    except BaseException as exc:
        if not is_transport_error(exc) or str(exc).startswith(f"rank {rank} failed in "):
            raise
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, CommunicationError):
            detail = f"a peer died, stopped or timed out ({detail})"
        raise CommunicationError(f"rank {rank} failed in {what}: {detail}") from exc
