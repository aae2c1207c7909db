"""Preemption: on SIGTERM (how clusters and torchrun stop a job) finish the iteration, checkpoint, exit 0.

``install()`` replaces the default action of the signals (SIGTERM, by default) in this process with
a flag. Nothing stops in the middle of a step: ``Trainer`` carries the flag in the all-reduce that
closes every iteration, so *every* rank learns at the same iteration that *some* rank was asked to
stop (``trainer.stop_requested``), even when the signal reached the ranks at different moments or only
one of them. The training loop then writes a checkpoint and returns::

    hgraph.runtime.preemption.install()              # every rank, before training
    while trainer.iteration < iterations:
        trainer.step_data(data)
        if trainer.stop_requested:
            checkpoints.save(trainer, blocking=True)   # then exit 0; a restart resumes exactly
            break

``hgraph train`` does this; ``hgraph.launch(..., preemptible=True)`` installs the handler in every
local rank before ``fn`` runs and forwards a SIGTERM the launcher gets to its ranks.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Iterable

from hgraph.errors import InputError

_requested = threading.Event()


def _on_signal(signum: int, frame: Any) -> None:
    _requested.set()


def install(signals: Iterable[int] = (signal.SIGTERM,)) -> None:
    """Turn ``signals`` into a stop request in this process (call from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        raise InputError("preemption.install() must run in the main thread (Python delivers signals there)")
    for sig in signals:
        signal.signal(sig, _on_signal)


def uninstall() -> None:
    """Give the signals ``install`` took their default action back, and forget any request
    (the process's signal table says which: those whose handler is ours)."""
    for sig in signal.valid_signals():
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, signal.SIG_DFL)
    _requested.clear()


def request() -> None:
    """Ask this process to stop after the current iteration, as a signal would."""
    _requested.set()


def requested() -> bool:
    """Whether this process got a stop signal (or ``request()``) since ``install``."""
    return _requested.is_set()
