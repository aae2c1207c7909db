"""How ``hgraph train`` plans, decided before training starts: the cost table the planner uses (the
``[planner] cost_table``, else ``T(l)`` of the strategies' schemes profiled once and cached in
``$HGRAPH_CACHE``: on this machine's local ranks, or under torchrun on the job's own ranks), the
run's cost model (its world size and recompute mode), and whether the context fits some strategy."""

from __future__ import annotations

import json
from typing import Any, Callable

from hgraph.core.degrees import Degrees
from hgraph.errors import CostModelError, InputError
from hgraph.planner.assign import Planner
from hgraph.planner.cost import CostModel, load_cost_model
from hgraph.profiling.profile import profile_cost_model
from hgraph.profiling.profile_job import profile_job
from hgraph.profiling.profile_ranks import DEFAULT_MEMORY_GB
from hgraph.core.strategy import as_strategies
from hgraph.training.train_config import TrainConfig


def profile_lengths(context: int) -> list[int]:
    """The lengths ``T(l)`` is measured at for batches of at most ``context`` tokens per sequence."""
    return sorted({max(16, context * k // 4) for k in (1, 2, 3, 4)} | {n for n in (64, 128, 256) if n < context})


def profiled_table(cfg: TrainConfig, model_factory: Callable[[], Any], schemes: list[str],
                   measure: bool = True) -> str:
    """The cost table (JSON) of ``schemes`` of the model ``model_factory`` builds (a picklable
    callable), profiled on ``cfg.world_size`` local ranks (cached in ``$HGRAPH_CACHE``;
    ``measure=False``: only a cached profile, else ``CostModelError``)."""
    cm = profile_cost_model(model_factory, cfg.world_size, schemes, profile_lengths(cfg.context),
                            memory_gb=cfg.planner.memory_gb or DEFAULT_MEMORY_GB, measure=measure)
    return json.dumps(cm.to_table())


def planner_table(cfg: TrainConfig, model_factory: Callable[[], Any], torchrun: bool,
                  say: Callable[[str], None] = print) -> tuple[str, str]:
    """The cost table (JSON) the planner plans ``cfg.strategies`` with, and where it came from: the
    ``[planner] cost_table``, else this machine profiled on local ranks, or under torchrun (every rank
    calls it, in the job's process group) the job's own ranks profiled; cached either way. ``say``
    reports when a profile on the job's ranks starts and ends (rank 0's; its rounds are log records)."""
    if cfg.planner.cost_table:
        return json.dumps(load_cost_model(cfg.planner.cost_table).to_table()), f"cost table {cfg.planner.cost_table}"
    schemes = list(dict.fromkeys(str(p.stage_key) for s in as_strategies(cfg.strategies) for p in s.pipelines))
    if not torchrun:
        table = profiled_table(cfg, model_factory, schemes)
        return table, f"T(l) profiled on this machine ({', '.join(schemes)}; cached in $HGRAPH_CACHE)"
    try:
        profile = profile_job(model_factory, [Degrees.parse(s) for s in schemes], profile_lengths(cfg.context),
                              memory_gb=cfg.planner.memory_gb or DEFAULT_MEMORY_GB, say=say)
    except CostModelError as exc:
        raise InputError(
            f"config {cfg.source}: planner: under torchrun hgraph train profiles T(l) on the job's own ranks, "
            f"which cannot run here: {exc}. Give [planner] cost_table (a preset or a file from "
            "`hgraph profile ... --out table.json`), or set planner = \"none\" to rotate the strategies") from None
    when = f"read from {profile.cache_path}" if profile.cached else f"now, cached in {profile.cache_path}"
    return (json.dumps(profile.cost_model.to_table()),
            f"T(l) profiled on this job's {cfg.world_size} ranks ({', '.join(schemes)}; {when})")


def planning_cost_model(cfg: TrainConfig, table: str) -> CostModel:
    """The ``CostModel`` of a table for this run: its world size and recompute mode."""
    cm = CostModel.from_table(json.loads(table)).with_world_size(cfg.world_size)
    mode = cfg.compile.recompute_for(Degrees(1, 1, 1)).mode  # one RecomputeConfig for every pipeline ([compile.recompute])
    return cm.with_recompute(mode) if mode != "none" else cm


def check_fits(cfg: TrainConfig, table: str) -> None:
    """``InputError`` when a sequence as long as the context fits no strategy under the cost model."""
    try:
        planner = Planner(planning_cost_model(cfg, table), list(cfg.strategies),
                          pipeline_schedule=cfg.compile.schedule.pipeline)
    except CostModelError as exc:
        raise InputError(f"config {cfg.source}: planner: the cost model cannot plan these strategies: {exc}") from None
    if cfg.context > planner.largest_max_len:
        key = "data.context" if cfg.documents else "data.max_len"
        raise InputError(
            f"config {cfg.source}: {key} = {cfg.context}: no strategy takes a sequence that long under the cost "
            f"model (the largest MaxLen is {planner.largest_max_len} tokens); lower {key}, add a strategy with "
            "more tp / pp / cp ranks per pipeline, or give more memory ([planner] memory_gb)")
