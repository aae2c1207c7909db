"""Seeded model construction that rank threads can share.

torch's global CPU generator belongs to the process, not to a thread: simulated ranks
(``run_threads``, ``compiled.simulate``) that build "the same" model with ``fork_rng`` +
``manual_seed`` at the same time interleave their draws and end up with different parameters (and
``fork_rng`` restoring the state on exit rewinds the other threads' draws). ``seeded_model`` builds
once per key and seed under a process-wide lock, with the global state restored afterwards, and hands
every caller its own deep copy: every rank thread gets the model a fresh process would build, and
later calls draw nothing from the global generator. A draw by some other thread during the very first
build can still perturb it; the Trainer's parameter agreement check then raises instead of training.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Callable, Hashable, TypeVar

import torch

Model = TypeVar("Model")

_LOCK = threading.RLock()
_BUILT: "OrderedDict[tuple[Hashable, int], object]" = OrderedDict()
_KEEP = 4  # the latest few models: what concurrent ranks build together


def seeded_model(key: Hashable, seed: int, build: Callable[[], Model]) -> Model:
    """``build()`` as it returns right after ``torch.manual_seed(seed)``, the global RNG untouched.

    ``key`` names what ``build`` builds (equal keys must mean equal models); the result is a private
    deep copy of one cached build, so concurrent callers (rank threads) all get identical models.
    """
    with _LOCK:
        entry = (key, seed)
        if entry not in _BUILT:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                _BUILT[entry] = build()
            while len(_BUILT) > _KEEP:
                _BUILT.popitem(last=False)
        _BUILT.move_to_end(entry)
        return copy.deepcopy(_BUILT[entry])  # type: ignore[return-value]
