"""The cost table of a multi-rank profile: fit ``T(l)`` per scheme and the memory regression.

``build_ranks_table`` reads the raw measurements of ``hgraph.profiling.profile_ranks`` (per rank,
per scheme: the F+B milliseconds of each length's micro-batch per repeat, and the bytes saved for
backward in the warm-up). ``T(l)`` is the slowest stage's median over all its samples (the ranks
holding that stage, TP ranks and data-parallel replicas, times the repeats), and ``a, b, c >= 0`` are
fitted per scheme (``fit_stage_cost``, least squares on relative error).

Memory (MaxLen, DESIGN.md A5): the warm-up iteration counts, per rank and micro-batch, the bytes of
the distinct storages autograd saves for backward in that micro-batch's forward
(``saved_tensors_hooks``). Their slope between the two largest lengths is the activation bytes per
token on that rank (parameters and other fixed bytes cancel; packed attention saves nothing
quadratic). Summing the slope over the stages (the largest rank of each stage) gives the whole
model's bytes per token per TP rank, embedding and LM head included, and
``A_tp = that / (L · H/tp)`` (the largest over the schemes of one ``tp``). ``B`` comes from one
decoder block's parameters (16 B/param), the device memory is the ``memory_gb`` budget given (CPU
ranks have no device limit of their own; the default makes MaxLen a few thousand tokens for the
demo-sized models), ``safe_bound`` 10% of it, no context gap. ``utilization_seqlen`` per tp: the
shortest multiple of 128 at which ``a·l² + b·l >= 2·c``.
"""

from __future__ import annotations

import statistics
from typing import Any

from hgraph.core.degrees import Degrees
from hgraph.core.strategy import homogeneous
from hgraph.errors import CostModelError
from hgraph.planner.cost import CostModel, StageCost
from hgraph.planner.fit import Fit, fit_stage_cost
from hgraph.planner.memory import MemoryRegression


def by_scheme(measured: dict[str, Any], scheme: Degrees, default: Any = None) -> Any:
    """``measured``'s entry for ``scheme``: its keys are scheme strings (``str(Degrees)``; profiles
    and tables saved before keep the older ``"tp2,pp1"``, which parses to the same degrees)."""
    return next((v for k, v in measured.items() if Degrees.parse(k) == scheme), default)


def _stage_ranks(world_size: int, scheme: Degrees) -> list[list[int]]:
    """Ranks of each stage over all replicas of the homogeneous strategy of ``scheme``."""
    pipelines = homogeneous(world_size, scheme.tp, scheme.pp, scheme.cp).pipelines
    return [[r for p in pipelines for r in p.stage_ranks(s)] for s in range(scheme.pp)]


def stage_times(raw: dict[str, Any], scheme: Degrees) -> list[float]:
    """``T(l)`` per length: the slowest stage's median forward+backward time of the ``l``-token
    micro-batch, the median taken over every sample of that stage (its ranks times the repeats)."""
    ms = [by_scheme(rank["compute_ms"], scheme) for rank in raw["per_rank"]]  # [rank][repeat][length]
    stages = _stage_ranks(raw["world_size"], scheme)
    repeats = range(raw["repeats"])
    return [
        max(statistics.median(ms[r][rep][i] for r in ranks for rep in repeats) for ranks in stages)
        for i in range(len(raw["lengths"]))
    ]


def stage_noise(raw: dict[str, Any], scheme: Degrees) -> float:
    """Measurement noise of ``T(l)``: per length, the median relative deviation of the slowest stage's
    samples from their median; the median over the lengths."""
    ms = [by_scheme(rank["compute_ms"], scheme) for rank in raw["per_rank"]]
    out = []
    for i in range(len(raw["lengths"])):
        stages = [[ms[r][rep][i] for r in ranks for rep in range(raw["repeats"])]
                  for ranks in _stage_ranks(raw["world_size"], scheme)]
        samples = max(stages, key=statistics.median)
        mid = statistics.median(samples)
        out.append(statistics.median(abs(v - mid) for v in samples) / mid if mid > 0 else 0.0)
    return statistics.median(out)


def activation_per_token(raw: dict[str, Any], scheme: Degrees) -> float:
    """Saved-for-backward bytes per token of the whole model on one TP rank (see module docstring);
    under cp, per token of the micro-batch's ``1/cp`` share on the rank."""
    hi, lo = len(raw["lengths"]) - 1, len(raw["lengths"]) - 2
    dl = raw["lengths"][hi] - raw["lengths"][lo]
    saved = [by_scheme(r["saved_bytes"], scheme) for r in raw["per_rank"]]
    slope = [(s[hi] - s[lo]) / dl * scheme.cp for s in saved]
    return sum(max(slope[r] for r in ranks) for ranks in _stage_ranks(raw["world_size"], scheme))


def utilization_seqlen(cost: StageCost, longest: int) -> int:
    """Shortest length (a multiple of 128) whose variable time ``a·l² + b·l`` is at least ``2·c``."""
    length = 128
    while cost.seq_time(length) < 2 * cost.c and length < longest:
        length += 128
    return length


def build_ranks_table(
    raw: dict[str, Any], memory_gb: float, name: str = "profiled"
) -> tuple[CostModel, dict[Degrees, Fit], dict[Degrees, list[float]]]:
    """Fit every scheme of the raw measurements and assemble the cost model (MaxLen from ``memory_gb``)."""
    if not memory_gb > 0:
        raise CostModelError(f"memory budget {memory_gb} GB; give a positive number of GB")
    schemes = [Degrees.parse(s) for s in raw["schemes"]]
    hidden, layers = raw["hidden"], raw["layers"]
    times = {s: stage_times(raw, s) for s in schemes}
    fits = {s: fit_stage_cost(raw["lengths"], times[s]) for s in schemes}
    activation: dict[int, float] = {}
    for s in schemes:
        a_tp = max(activation_per_token(raw, s), 1.0) / (layers * hidden / s.tp)
        activation[s.tp] = max(activation.get(s.tp, 0.0), a_tp)
    memory = float(memory_gb) * 1e9
    regression = MemoryRegression(
        activation=tuple(sorted(activation.items())),
        bytes_per_layer_h2=16.0 * raw["block_params"] / hidden**2,
        alpha=0.75,
        gap=(("node", 0.0),),
        safe_bound=0.1 * memory,
        gpu_memory=memory,
        hidden=hidden,
        layers=layers,
        vocab=raw["vocab"],
    )
    util: dict[str, int] = {}
    for s in sorted(schemes, key=lambda s: (s.tp, s.pp), reverse=True):  # the smallest pp of each tp wins
        util[f"tp{s.tp}"] = utilization_seqlen(fits[s].cost, max(raw["lengths"]))
    extra = {
        "_about": (
            f"Profiled by hgraph profile on {raw['world_size']} local gloo ranks ({raw['model']}), lengths "
            f"{raw['lengths']}: T(l) = per-stage forward+backward ms of one l-token micro-batch (slowest "
            "stage); see hgraph.profiling.profile_ranks."
        ),
        "_fit": {
            str(s): {"r2": f.r2, "max_rel_error": f.max_rel_error, "times_ms": times[s], "noise": stage_noise(raw, s)}
            for s, f in fits.items()
        },
        "utilization_seqlen": dict(sorted(util.items(), key=lambda kv: int(kv[0][2:]))),
    }
    model = CostModel(
        name, {s: f.cost for s, f in fits.items()}, regression, gpus_per_node=raw["world_size"],
        world_size=raw["world_size"], extra=extra, sources={s: "profiled" for s in fits},
    )
    return model, fits, times
