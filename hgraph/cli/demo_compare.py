"""The planner against homogeneous strategies on the same batches, interleaved (``hgraph demo
--compare``, ``benchmarks/planner_gain_bench.py``).

Every rank builds one trainer per *arm* — the planner over its candidates, and each homogeneous
strategy alone, all through the same planner, dispatch and packing — from the same initial weights.
All arms first train the same ``warmup`` batches (not counted; they cover the planner's probing,
``probing_batches``). Once the trainers are built, the objects alive are frozen out of garbage
collection (``gc.freeze``): one process holds every arm's trainer, and a full collection over all of
them, a cost no single-trainer run pays, would land on whichever arm allocates most. Then each
repetition runs the batch
list in blocks of ``block`` iterations: every arm trains the block's batches in turn, the order of
the arms rotating from block to block, so load from other programs on the machine falls on all arms
alike. Counted per arm and repetition: the sum of the iterations' step seconds (planning, dispatch,
compute, communication, optimizer). The ratio of a repetition is the best homogeneous arm's sum (the
arm with the smallest median over repetitions) over the planner's; reported with its median and
range over repetitions.

``oracle`` arms (each candidate alone, e.g. one that does not take every document) train only the
batches they take and are not counted in the ratio; with them ``ratios`` reports ``gain_bound``: the
best homogeneous arm's time over the sum, batch by batch, of the fastest arm that took the batch
(each arm's median over repetitions). It is measured, not predicted: no planner choosing among those
strategies batch by batch can do better on this machine.
"""

from __future__ import annotations

import gc
import json
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hgraph.compiler import entry
from hgraph.planner.assign import Planner
from hgraph.planner.baselines import homogeneous_strategies
from hgraph.planner.correction import OnlineCorrection, fidelity
from hgraph.planner.cost import CostModel
from hgraph.planner.terms import terms_of
from hgraph.profiling.profile_ranks import resolve_factory
from hgraph.program.options import CompileOptions, OverlapConfig, ScheduleConfig
from hgraph.training.configs import AdamWConfig
from hgraph.training.trainer import Trainer

__all__ = ["CompareSpec", "ReplayLoader", "homogeneous_arms", "probing_batches", "rank_compare", "ratios"]

PLANNER = "planner"


@dataclass(frozen=True)
class CompareSpec:
    """What every rank needs for one interleaved comparison (picklable)."""

    model_factory: Any  # "module:function" or a picklable callable returning the model (same weights each call)
    candidates: tuple[str, ...]  # the planner's strategies
    homogeneous: tuple[str, ...]  # one arm each
    cost_table: str  # JSON, with the iteration terms of every candidate and homogeneous strategy
    batches: tuple[tuple[torch.Tensor, ...], ...]  # the measured batches, in order
    warmup: tuple[tuple[torch.Tensor, ...], ...] = ()  # trained by every arm first, not counted
    repeats: int = 3
    block: int = 2
    gpu_memory: Optional[float] = None  # a per-rank memory budget (bytes) for MaxLen; None: the table's
    schedule: str = "overlap"
    lr: float = 3e-3
    oracle: tuple[str, ...] = ()  # more one-strategy arms, on the batches they take, for the gain bound

    def __str__(self) -> str:
        lengths = [len(s) for b in self.batches for s in b]
        return (f"planner over {len(self.candidates)} candidates vs {', '.join(self.homogeneous)}: "
                f"{len(self.batches)} batches (longest {max(lengths)} tokens) x {self.repeats} repetitions, "
                f"blocks of {self.block}, after {len(self.warmup)} warm-up batches"
                + (f"; {len(self.oracle)} more arms for the gain bound" if self.oracle else ""))


class ReplayLoader:
    """A loader over given batches (``Trainer.step_data`` reads it on rank 0)."""

    def __init__(self, batches: Sequence[Sequence[torch.Tensor]]) -> None:
        self._todo = list(batches)

    def next_batch(self) -> Optional[list[torch.Tensor]]:
        return list(self._todo.pop(0)) if self._todo else None


def homogeneous_arms(cost_model: CostModel, world_size: int, lengths: Sequence[Sequence[int]],
                     most: Optional[int] = 3, schedule: str = "overlap") -> list[str]:
    """The homogeneous strategies of ``world_size`` ranks that take every document of ``lengths``
    (under the cost model's memory budget), the ``most`` best (None: all) by the time the planner
    predicts over the batches (with the table's iteration terms where it carries them)."""
    longest = max(max(b) for b in lengths)
    terms = terms_of(cost_model)
    found = []
    for strategy in homogeneous_strategies(cost_model, world_size):
        if terms is not None and not terms.has(strategy, schedule):
            continue
        planner = Planner(cost_model, [strategy], terms=terms, schedule=schedule)
        if planner.largest_max_len >= longest:
            found.append((sum(planner.plan(list(b)).predicted_ms for b in lengths), str(strategy)))
    return [s for _, s in sorted(found)[:most]]


def probing_batches(cost_model: CostModel, candidates: Sequence[str]) -> int:
    """Batches the planner over ``candidates`` probes before it settles (``Planner.probe_iterations``):
    a comparison's warm-up covers them, as the first few of a long run would."""
    return Planner(cost_model, candidates, correction=OnlineCorrection()).probe_iterations


def _trainer(spec: CompareSpec, candidates: Sequence[str]) -> Trainer:
    compiled = entry.compile(resolve_factory(spec.model_factory)(), list(candidates), example_inputs=torch.randint(0, 8, (1, 16)),
                             options=CompileOptions(schedule=ScheduleConfig(
                                 overlap=OverlapConfig() if spec.schedule == "overlap" else None)))
    cost_model = CostModel.from_table(json.loads(spec.cost_table))
    if spec.gpu_memory is not None:
        cost_model = cost_model.with_gpu_memory(spec.gpu_memory)
    planner = Planner(cost_model, compiled.strategies, terms=terms_of(cost_model), schedule=spec.schedule,
                      correction=OnlineCorrection())
    return Trainer(compiled, optimizer=AdamWConfig(lr=spec.lr, weight_decay=0.01, grad_clip=1.0), planner=planner)


def _train(trainer: Trainer, batches: Sequence[Sequence[torch.Tensor]], first: int = 0) -> list[dict[str, Any]]:
    """Train ``batches`` (numbered from ``first``), skipping those no candidate of ``trainer`` takes;
    the records of those trained, each with its batch number."""
    taken = [(first + i, b) for i, b in enumerate(batches)
             if max(len(s) for s in b) <= trainer.planner.largest_max_len]
    loader = ReplayLoader([b for _, b in taken])
    for _ in taken:
        trainer.step_data(loader)
    records = trainer.history[-len(taken):] if taken else []
    return [{**rec, "batch": i} for (i, _), rec in zip(taken, records)]


def rank_compare(spec: CompareSpec) -> dict[str, Any]:
    """Runs on every rank (under ``hgraph.runtime.launch``): the interleaved comparison; rank 0's
    result has, per arm, the seconds of every repetition and the records of every counted iteration."""
    arms = {PLANNER: spec.candidates, **{s: (s,) for s in spec.homogeneous + spec.oracle if s != PLANNER}}
    trainers = {name: _trainer(spec, candidates) for name, candidates in arms.items()}
    gc.collect()  # every arm's trainer in one process: see the module docstring
    gc.freeze()
    try:
        names = list(arms)
        warmup = {name: sum(rec["seconds"] for rec in _train(trainers[name], spec.warmup)) for name in names}
        seconds: dict[str, list[float]] = {n: [] for n in names}
        rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        turn = 0
        for _ in range(spec.repeats):
            spent = dict.fromkeys(names, 0.0)
            for start in range(0, len(spec.batches), spec.block):
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for name in order:
                    for rec in _train(trainers[name], spec.batches[start:start + spec.block], start):
                        spent[name] += rec["seconds"]
                        rows[name].append({k: rec[k] for k in ("strategy", "seconds", "measured_ms", "predicted_ms",
                                                               "predicted_raw_ms", "loss", "lengths", "batch")})
            for name in names:
                seconds[name].append(spent[name])
    finally:
        gc.unfreeze()
    return {"seconds": seconds, "rows": rows, "warmup_seconds": warmup, "oracle": list(spec.oracle),
            "warmup_strategies": [rec["strategy"] for rec in trainers[PLANNER].history[:len(spec.warmup)]],
            "planner_state": str(trainers[PLANNER].planner.correction)}


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    """The comparison's figures from ``rank_compare``'s rank-0 result: the best homogeneous arm, the
    ratio (its seconds / the planner's) per repetition with median and range, the strategies the
    planner used, and the planner's prediction fidelity over its counted iterations."""
    seconds = result["seconds"]
    oracle = set(result.get("oracle", ())) - {PLANNER}
    homogeneous = {n: s for n, s in seconds.items() if n != PLANNER and n not in oracle}
    best = min(homogeneous, key=lambda n: statistics.median(homogeneous[n]))
    per_rep = [b / p for b, p in zip(seconds[best], seconds[PLANNER])]
    rows = result["rows"][PLANNER]
    used: dict[str, int] = {}
    for r in rows:
        used[r["strategy"]] = used.get(r["strategy"], 0) + 1
    measured = [r["measured_ms"] for r in rows]
    return {
        "best_homogeneous": best,
        "ratio_median": statistics.median(per_rep), "ratio_min": min(per_rep), "ratio_max": max(per_rep),
        "ratio_per_repetition": per_rep,
        "seconds": {n: s for n, s in seconds.items()},
        "planner_strategies": used,
        "warmup_seconds": result.get("warmup_seconds"), "warmup_strategies": result.get("warmup_strategies"),
        "planner_state": result.get("planner_state"),
        "fidelity": fidelity([r["predicted_ms"] for r in rows], measured) if rows and rows[0]["predicted_ms"] else None,
        "measured_spread": max(measured) / min(measured) if measured else None,
        **_gain_bound(result, best),
        "iterations": {n: [(r["strategy"], round(r["seconds"], 4), round(r["measured_ms"], 1),
                            None if r["predicted_ms"] is None else round(r["predicted_ms"], 1)) for r in result["rows"][n]]
                       for n in (PLANNER, best)},
    }


def _gain_bound(result: dict[str, Any], best: str) -> dict[str, Any]:
    """``gain_bound`` and the per-batch fastest arm (see the module docstring)."""
    per_batch: dict[str, dict[int, list[float]]] = {}
    for name, rows in result["rows"].items():
        if name != PLANNER:
            for r in rows:
                per_batch.setdefault(name, {}).setdefault(r["batch"], []).append(r["seconds"])
    median = {n: {b: statistics.median(v) for b, v in got.items()} for n, got in per_batch.items()}
    fastest = {b: min((m[b], n) for n, m in median.items() if b in m) for b in median[best]}
    return {"gain_bound": sum(median[best].values()) / sum(t for t, _ in fastest.values()),
            "fastest_per_batch": [n for _, n in (fastest[b] for b in sorted(fastest))]}
