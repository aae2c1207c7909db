"""Iteration terms measured on real ranks through the real runtime (``hgraph profile --strategies``).

``profile_iteration(model_factory, world_size, strategies, cost_model)`` launches ``world_size``
local gloo ranks once. Every rank:

1. times pipeline send/receive steps between rank pairs (``2r ↔ 2r+1``, all pairs at once, as
   pipelines run side by side): a header exchange then a payload exchange through the runtime's
   communicator, as the executor moves an activation, for several payload sizes;
2. compiles the model for the strategies under ``schedule="none"`` and ``"overlap"`` and trains with
   ``hgraph.Trainer(timeline=True)`` on a few batches (synthetic ones, or some of the training data's),
   each packed for each strategy by a ``Planner`` on the profiled ``T(l)`` as in training (one warm-up step per strategy and
   schedule, then ``repeats`` rounds; strategies and schedules interleaved inside each round, so load
   from other programs falls on all of them alike), keeping per step and rank the Pull / Push time
   (blocking schedule), the exposed Pull/Push (overlap), the optimizer time and the measured step.

The parent fits (``fit_terms``): the activation step ``alpha + beta·bytes`` (non-negative least
squares); per strategy and schedule the Pull (slowest rank) and Push (the rank that waited least,
i.e. the transfer itself) medians, the exposed fraction under overlap, and the fixed rest: the median
of measured minus simulated (``predict_iteration`` with the profiled ``T(l)``) over the profile steps.
Each term reports its noise (median relative deviation over repeats) and the fit's residual.

Raw measurements are cached in ``$HGRAPH_CACHE/profile`` keyed by machine (host, CPUs, torch),
model, world size, strategies, batches and repeats.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import nnls

from hgraph.compiler.entry import compile as compile_model
from hgraph.core.cache_entry import load_entry, store_entry
from hgraph.core.model_info import embedding_of
from hgraph.core.progress import progress
from hgraph.core.strategy import Strategy, as_strategies
from hgraph.errors import CostModelError
from hgraph.planner.assign import Planner
from hgraph.planner.cost import CostModel
from hgraph.planner.machine import machine
from hgraph.planner.terms import AlphaBeta, IterationTerms, StrategyTerms
from hgraph.planner.timing import predict_iteration
from hgraph.profiling.profile_ranks import ModelFactory, factory_name, model_facts, resolve_factory
from hgraph.program.options import CompileOptions, OverlapConfig, ScheduleConfig
from hgraph.runtime.clock import DeviceClock
from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm
from hgraph.runtime.launch import launch
from hgraph.runtime.timeline import exposed_communication
from hgraph.schedule.lowerings import PLACEMENTS
from hgraph.training.configs import AdamWConfig, RunConfig
from hgraph.training.trainer import Trainer

_METHOD = "trainer steps packed by the planner, strategies and schedules interleaved per round, pair exchanges, v2"
PAYLOAD_BYTES = (1 << 12, 1 << 15, 1 << 17, 1 << 19)
PULL_PUSH = ("pull_parameter", "push_gradient")


def profile_batches(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Synthetic batches spanning the shapes training sees: one of every length, the longest once
    per rank, the shortest twice per rank."""
    lengths = sorted(set(int(l) for l in lengths), reverse=True)
    return [lengths, [lengths[0]] * world_size, [lengths[-1]] * (2 * world_size)]


# -- on every rank ---------------------------------------------------------------------------------


def _pair_exchanges(comm: Any, sizes: Sequence[int], repeats: int) -> dict[str, list[float]]:
    """Milliseconds of header + payload exchanges with the partner rank, per payload size."""
    peer = comm.rank ^ 1
    if peer >= comm.world_size:
        return {}
    out: dict[str, list[float]] = {}
    header, header_in = torch.zeros(10, dtype=torch.int64), torch.zeros(10, dtype=torch.int64)
    for nbytes in sizes:
        payload, buf = torch.zeros(nbytes // 4), torch.empty(nbytes // 4)
        clock = DeviceClock(payload.device)
        samples = []
        for i in range(repeats + 1):  # the first is a warm-up
            start = clock.mark()
            comm.exchange([(peer, header)], [(peer, header_in)])
            comm.exchange([(peer, payload)], [(peer, buf)])
            if i:
                samples.append(clock.elapsed_ms(start, clock.mark()))
        out[str(nbytes)] = samples
    return out


def _rank_main(factory: ModelFactory, strategies: list[str], batches: list[list[int]], repeats: int,
               table: dict) -> dict:
    comm = ProcessGroupComm()
    rank = comm.rank
    out: dict[str, Any] = {"exchange_ms": _pair_exchanges(comm, PAYLOAD_BYTES, max(repeats, 3)), "steps": []}
    torch.manual_seed(0)
    model = resolve_factory(factory)()
    vocab = embedding_of(model).num_embeddings
    example = torch.randint(0, vocab, (1, 16))
    trainers = {sc: Trainer(compile_model(model, strategies, example_inputs=example,
                                          options=CompileOptions(schedule=ScheduleConfig(
                                              overlap=OverlapConfig() if sc == "overlap" else None))),
                            optimizer=AdamWConfig(lr=1e-4), run=RunConfig(timeline=True), comm=comm)
                for sc in PLACEMENTS}
    gen = torch.Generator().manual_seed(1)
    sequences = [[torch.randint(0, vocab, (n,), generator=gen) for n in b] for b in batches]
    out["strategies"] = [str(s) for s in trainers["none"].compiled.strategies]
    cost = CostModel.from_table(table)  # each strategy's batches packed as its planner packs them in training
    planners = [Planner(cost, [s]) for s in trainers["none"].compiled.strategies]

    def step(trainer: Any, schedule: str, k: int, b: int, repeat: int) -> None:
        trainer.planner = planners[k]
        trainer.step(sequences[b])
        rec = trainer.history[-1]
        events = [e for e in trainer.timeline.events if e.iteration == rec["iteration"]]
        trainer.timeline.clear()
        if repeat < 0:
            return
        out["steps"].append({
            "schedule": schedule, "strategy": k, "batch": b, "repeat": repeat,
            "measured_ms": rec["measured_ms"], "optimizer_ms": rec["optimizer_ms"],
            "pull_ms": 1e3 * sum(e.duration for e in events if e.kind == "pull_parameter"),
            "push_ms": 1e3 * sum(e.duration for e in events if e.kind == "push_gradient"),
            "exposed_ms": 1e3 * exposed_communication(events, PULL_PUSH).get(rank, {}).get(rec["iteration"], 0.0),
            "dispatch": [[[rec["lengths"][i] for i in mb] for mb in p] for p in rec["dispatch"]],
        })

    for k in range(len(strategies)):  # warm-up: first programs, dry runs, allocator
        for sc, trainer in trainers.items():
            step(trainer, sc, k, 0, -1)
    bar = progress(desc=f"profiling {len(strategies)} strategies", unit="step", show=rank == 0,
                   total=repeats * len(batches) * len(strategies) * len(trainers))
    for repeat in range(repeats):
        for b in range(len(batches)):
            for k in range(len(strategies)):
                for sc, trainer in trainers.items():
                    step(trainer, sc, k, b, repeat)
                    bar.update()
    bar.close()
    return out


# -- in the parent ---------------------------------------------------------------------------------


def _cache_path(key: dict[str, Any]) -> Path:
    root = Path(os.environ.get("HGRAPH_CACHE", Path.home() / ".cache" / "hgraph"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / "profile" / f"iteration-{digest}.json"


def measure_iteration(
    model_factory: ModelFactory, world_size: int, strategies: Sequence[Any], cost_model: CostModel,
    lengths: Sequence[int], repeats: int = 3, use_cache: bool = True, timeout: float = 600.0,
    batches: Sequence[Sequence[int]] | None = None,
) -> tuple[dict[str, Any], Path, bool]:
    """Raw measurements (from the cache when present): ``(raw, cache_path, cached)``. ``batches``
    (lists of sequence lengths; default ``profile_batches(lengths)``) are packed per strategy by a
    ``Planner`` on ``cost_model``, as in training."""
    if repeats < 1:
        raise CostModelError(f"repeats={repeats}; need at least 1")
    names = [str(s) for s in as_strategies(strategies)]
    if not names:
        raise CostModelError("no strategies to profile; give e.g. ['4x tp1', 'tp2 + 2x tp1']")
    bad = [s for s in as_strategies(strategies) if s.world_size != world_size]
    if bad:
        raise CostModelError(f"strategy {bad[0]} spans {bad[0].world_size} ranks, not world size {world_size}")
    model = resolve_factory(model_factory)()
    batches = [list(map(int, b)) for b in batches] if batches else profile_batches(lengths, world_size)
    table = cost_model.to_table()
    key = {
        "machine": machine(), "model": factory_name(model_factory), **model_facts(model),
        "parameters": sum(p.numel() for p in model.parameters()), "world_size": world_size,
        "strategies": names, "batches": batches, "repeats": repeats, "method": _METHOD,
        "stage_costs": table["strategies"],
    }
    path = _cache_path(key)
    cached = load_entry(path, "profile-iteration", key, ("per_rank", "seconds", *key)) if use_cache else None
    if cached is not None:
        return cached, path, True
    start = time.perf_counter()
    per_rank = launch(_rank_main, world_size, args=(model_factory, names, batches, repeats, table),
                      timeout=timeout)
    raw = {**key, "per_rank": per_rank, "seconds": time.perf_counter() - start}
    store_entry(path, "profile-iteration", key, raw)
    return raw, path, False


def _spread(values: Sequence[float]) -> float:
    """Median relative deviation from the median."""
    mid = statistics.median(values)
    return statistics.median(abs(v - mid) for v in values) / mid if mid > 0 else 0.0


def fit_activation(per_rank: Sequence[dict[str, Any]]) -> AlphaBeta:
    """``alpha + beta·bytes`` by non-negative least squares on relative error over the sizes' medians."""
    sizes = sorted({int(n) for r in per_rank for n in r["exchange_ms"]})
    if len(sizes) < 2:
        return AlphaBeta(0.0, 0.0)
    ms = np.array([statistics.median(t for r in per_rank for t in r["exchange_ms"].get(str(n), [])) for n in sizes])
    x = np.array(sizes, dtype=np.float64)
    design = np.stack([np.ones_like(x), x], axis=1) / ms[:, None]
    scale = np.linalg.norm(design, axis=0)
    coef, _ = nnls(design / scale, np.ones_like(ms))
    alpha, beta = (coef / scale).tolist()
    fitted = alpha + beta * x
    return AlphaBeta(alpha, beta, float(np.max(np.abs(fitted - ms) / ms)))


# compute_scale candidates 0.25 .. 4, nearest to 1 first: a scale the data cannot tell apart stays near 1
SCALE_PENALTY = 0.03  # median relative error a factor e away from scale 1 must save to be chosen
SCALES = tuple(sorted((round(0.25 + 0.01 * i, 2) for i in range(376)), key=lambda s: abs(s - 1.0)))


def _fit_scale_and_fixed(
    terms: StrategyTerms, strategy: Any, rows: Sequence[dict], cost_model: CostModel, base: IterationTerms
) -> tuple[StrategyTerms, float]:
    """``compute_scale`` and ``fixed_ms`` minimising the median relative error over ``rows`` (the scale
    by grid search, penalised by ``SCALE_PENALTY · |ln scale|`` so that noise does not pull it far from
    1; the fixed cost as the median residual at each scale); returns the terms and the error."""
    best: tuple[float, StrategyTerms] = (float("inf"), terms)
    measured = [r["measured_ms"] for r in rows]
    for scale in SCALES if len(rows) > 1 else (1.0,):
        probe = replace(terms, compute_scale=scale, fixed_ms=0.0)
        with_probe = replace(base, strategies={(terms.strategy, terms.schedule): probe})
        modelled = [predict_iteration(strategy, r["dispatch"], cost_model, with_probe, terms.schedule).total_ms
                    for r in rows]
        fixed = statistics.median(m - p for m, p in zip(measured, modelled))
        error = statistics.median(abs(p + fixed - m) / m for m, p in zip(measured, modelled))
        if error + SCALE_PENALTY * abs(math.log(scale)) < best[0] - 1e-12:
            best = (error + SCALE_PENALTY * abs(math.log(scale)), replace(probe, fixed_ms=fixed))
    final = best[1]
    probe = replace(base, strategies={(final.strategy, final.schedule): final})
    modelled = [predict_iteration(strategy, r["dispatch"], cost_model, probe, final.schedule).total_ms for r in rows]
    return final, statistics.median(abs(p - m) / m for m, p in zip(measured, modelled))


def fit_terms(raw: dict[str, Any], cost_model: CostModel) -> IterationTerms:
    """Fit the iteration terms of every measured strategy and schedule (see the module docstring)."""
    per_rank = raw["per_rank"]
    steps = [{(s["schedule"], s["strategy"], s["batch"], s["repeat"]): s for s in r["steps"]} for r in per_rank]
    base = IterationTerms(fit_activation(per_rank), 4.0 * raw["hidden"], raw["layers"])
    found: dict[tuple[str, str], StrategyTerms] = {}
    for k, name in enumerate(per_rank[0]["strategies"]):
        strategy = Strategy.parse(name)
        keys = {sc: [key for key in steps[0] if key[:2] == (sc, k)] for sc in PLACEMENTS}
        pull = statistics.median(max(r[key]["pull_ms"] for r in steps) for key in keys["none"])
        push = statistics.median(min(r[key]["push_ms"] for r in steps) for key in keys["none"])
        for sc in PLACEMENTS:
            rows = [steps[0][key] for key in keys[sc]]
            exposed = 1.0
            if sc == "overlap" and pull + push > 0:
                worst = statistics.median(max(r[key]["exposed_ms"] for r in steps) for key in keys[sc])
                exposed = min(1.0, worst / (pull + push))
            terms = StrategyTerms(name, sc, pull, push, exposed, statistics.median(r["optimizer_ms"] for r in rows), 0.0)
            terms, residual = _fit_scale_and_fixed(terms, strategy, rows, cost_model, base)
            by_batch: dict[int, list[float]] = {}
            for r in rows:
                by_batch.setdefault(r["batch"], []).append(r["measured_ms"])
            noise = statistics.median(_spread(v) for v in by_batch.values())
            found[(name, sc)] = replace(terms, noise=noise, residual=residual, samples=len(rows))
    return replace(base, strategies=found)


@dataclass(frozen=True)
class IterationProfile:
    """Fitted iteration terms with where they came from."""

    terms: IterationTerms
    seconds: float
    cache_path: Path
    cached: bool

    def __str__(self) -> str:
        source = f"measured in {self.seconds:.1f} s" + (f", cached in {self.cache_path}" if self.cached else "")
        return f"iteration terms ({source}):\n{self.terms}"


def profile_iteration(
    model_factory: ModelFactory, world_size: int, strategies: Sequence[Any], cost_model: CostModel,
    lengths: Sequence[int] = (64, 128, 256, 512), *, repeats: int = 3, use_cache: bool = True,
    timeout: float = 600.0, batches: Sequence[Sequence[int]] | None = None,
) -> IterationProfile:
    """Measure (or read from the cache) and fit the iteration terms of ``strategies``; ``cost_model``
    holds the profiled ``T(l)`` of their schemes (``hgraph.profiling.profile_ranks``); ``batches``: the
    batches to measure on (e.g. a few of the training data's), default ``profile_batches(lengths)``."""
    start = time.perf_counter()
    raw, path, cached = measure_iteration(model_factory, world_size, strategies, cost_model, lengths, repeats,
                                          use_cache, timeout, batches)
    terms = fit_terms(raw, cost_model)
    return IterationProfile(terms, raw["seconds"] if cached else time.perf_counter() - start, path, cached)
