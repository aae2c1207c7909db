"""Profiling on the job's own ranks: ``T(l)`` measured on the process group that is already running
(torchrun's workers, each on its own device), not on local ranks started for the purpose.

``profile_job`` runs on every rank of an initialised torch.distributed group. Rank 0 looks the
profile up in ``$HGRAPH_CACHE`` under the key of a local profile (``profile_ranks.profile_key``:
model, schemes, lengths, repeats, world size, ranks per node, device kind, machine, torch) and tells
every rank whether the job measures. If it does, every rank runs the measurement of a local profile
(``measure_on_rank``), the results are gathered on rank 0, which caches them. Rank 0 fits the table
(``hgraph.profiling.ranks_table``) and broadcasts the ``Profile``: every rank plans with the same one,
also where the nodes' caches differ. Rank 0 says when it measures and when it is done through ``say``
(default: an INFO record of this module's logger); the timed rounds show as rank 0's progress bar
(``measure_on_rank``) and as INFO records.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hgraph.core.cache_entry import store_entry
from hgraph.core.degrees import Degrees
from hgraph.errors import CostModelError, HGraphError
from hgraph.profiling.profile_ranks import (
    DEFAULT_MEMORY_GB, ModelFactory, Profile, cache_path, fitted_profile, load_cached, measure_on_rank,
    profile_key,
)
from hgraph.runtime.kernels.process_group_comm import local_device_index

log = logging.getLogger(__name__)


def device_kind() -> str:
    """The kind of device this job's ranks compute on: ``"cpu"`` under gloo, the GPU's name under NCCL."""
    if dist.get_backend() == "nccl":
        return torch.cuda.get_device_name(local_device_index(dist.get_rank()))
    return "cpu"


def profile_job(
    model_factory: ModelFactory,
    schemes: Sequence[Degrees],
    lengths: Sequence[int],
    *,
    repeats: int = 3,
    memory_gb: float = DEFAULT_MEMORY_GB,
    name: str = "profiled",
    say: Callable[[str], None] = log.info,
) -> Profile:
    """The profile of ``schemes`` on this job's ranks: cached, else measured on them now (every rank
    calls it; rank 0 reports the start and the end through ``say``). ``CostModelError`` when it cannot
    run, on every rank."""
    if not dist.is_initialized():
        raise CostModelError("profiling on the job's ranks needs its torch.distributed group; "
                             "call hgraph.runtime.launch.init_from_env first")
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = sorted(set(int(l) for l in lengths))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    key = profile_key(model_factory, world, schemes, lengths, repeats, device_kind(), per_node)
    path = cache_path(key)
    cached = load_cached(key) if rank == 0 else None
    measure = _from_rank0(cached is None)
    raw: dict[str, Any] = {}
    seconds = None
    if measure:
        if rank == 0:
            say(f"profiling T(l) on this job's {world} ranks ({key['device']}): schemes "
                f"{', '.join(map(str, schemes))} at lengths {lengths}, a warm-up and {repeats} timed rounds")
        start = time.perf_counter()
        per_rank = _gathered(model_factory, schemes, lengths, repeats, start)
        seconds = time.perf_counter() - start
        if rank == 0:
            raw = {**key, "per_rank": [m for m, _ in per_rank], "seconds": seconds,
                   "measured_by": [who for _, who in per_rank]}
            store_entry(path, "profile-ranks", key, raw)
    outcome: tuple[str, Any] = ("", None)
    if rank == 0:
        try:
            outcome = ("profile", fitted_profile(cached or raw, memory_gb, name, path, seconds))
        except HGraphError as exc:
            outcome = ("error", f"fitting the profile on rank 0: {exc}")
    outcome = _from_rank0(outcome)
    if outcome[0] == "error":
        raise CostModelError(outcome[1])
    if rank == 0 and measure:
        say(f"profiled in {seconds:.1f} s; cached in {path}")
    return outcome[1]


def _gathered(model_factory: ModelFactory, schemes: Sequence[Degrees], lengths: list[int], repeats: int,
              start: float) -> list[tuple[dict[str, Any], dict[str, int]]]:
    """Every rank's measurements and who measured them (rank, process, parent process), in rank order;
    a rank's ``HGraphError`` (e.g. its scheme does not compile) is raised on every rank, naming it.
    Rank 0 logs each timed round (INFO)."""

    def round_done(done: int, total: int) -> None:
        log.info("round %d/%d measured (%.1f s)", done, total, time.perf_counter() - start)

    rank = dist.get_rank()
    try:
        mine: Any = measure_on_rank(model_factory, [(s.tp, s.pp, s.cp, s.ep) for s in schemes], lengths, repeats,
                                    round_done if rank == 0 else None)
    except HGraphError as exc:
        mine = f"rank {rank}: {type(exc).__name__}: {exc}"
    who = {"rank": rank, "pid": os.getpid(), "parent_pid": os.getppid()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, who))
    failed = [m for m, _ in gathered if isinstance(m, str)]
    if failed:
        raise CostModelError("measuring on the job's ranks failed: " + "; ".join(failed))
    return gathered


def _from_rank0(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
