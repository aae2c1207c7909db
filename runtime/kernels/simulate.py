"""Run a plan in one process, every rank a thread: the executor itself on simulated ranks."""

from __future__ import annotations

from typing import Mapping

import torch

from hgraph.lnk.plan import ReshardPlan
from hgraph.runtime.kernels.reshard import execute
from hgraph.runtime.kernels.thread_comm import run_threads


def simulate(
    plan: ReshardPlan, shards: Mapping[int, torch.Tensor], timeout: float = 60.0
) -> dict[int, torch.Tensor]:
    """Execute ``plan`` on ``shards`` (source rank -> local tensor); returns destination rank -> tensor."""
    first = next(iter(shards.values()), None)
    dtype, device = (first.dtype, first.device) if first is not None else (None, None)
    world = max(plan.ranks) + 1

    def body(comm):
        if comm.rank not in plan.ranks:
            return None
        return execute(plan, shards.get(comm.rank), comm, dtype=dtype, device=device)

    results = run_threads(body, world, timeout)
    return {r: results[r] for r in plan.dst.ranks}
