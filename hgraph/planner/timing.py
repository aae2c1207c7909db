"""Predicted iteration time of a plan: 1F1B per pipeline, the slowest pipeline, plus exposed Pull/Push.

Per pipeline (DESIGN.md A5) with micro-batch times ``T(mb) = Σ (a·lᵢ² + b·lᵢ) + c``::

    compute = Σ T(mb) + (pp − 1) · max T(mb)

The quadratic term is per sequence because packed attention never crosses a sequence boundary.
The iteration time is the largest ``compute + exposed_comm`` over the strategy's pipelines.

Pull Parameter and Push Gradient (DESIGN.md A3) overlap with compute, layer by layer; what stays
exposed is the larger of one layer's share (the first Pull and the last Push cannot overlap) and
whatever does not fit under the compute::

    exposed_comm = max(total / layers_per_stage, total − compute)

``total`` comes from a ``CommModel``. The default, ``AlphaBetaComm``, is a simple alpha-beta model:
every rank pulls its stage's compute-dtype parameters (``bytes_per_param · P / (tp · pp)``) and pushes
as many gradient bytes, at ``inter_node_gbps`` (GB/s per GPU) once the world spans several nodes
(``intra_node_gbps`` otherwise), with ``alpha_ms`` per step of a ``log2(world)``-step collective.
The default figures (25 GB/s, i.e. one 200 Gb/s NIC per GPU; 300 GB/s NVLink; 20 µs) are
deliberately plain; plug in the LNK topology model by passing any object with the same
``pull_push_ms`` method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from hgraph.errors import PlanError
from hgraph.planner.terms import IterationTerms
from hgraph.core.strategy import Strategy
from hgraph.schedule.bubble import pipeline_time



class PipelineShare(Protocol):
    """What the formula reads of one pipeline's share of a plan (``plan.PipelinePlan``)."""

    pipeline: Any
    cost: "PipelineCost"
    micro_batches: tuple[tuple[int, ...], ...]
    micro_batch_lengths: tuple[tuple[int, ...], ...]


class IterationPlan(Protocol):
    """What the formula reads of a plan (``hgraph.planner.plan.IterationPlan``, which holds
    ``PipelineCost`` values and so imports this module, not the other way round)."""

    strategy: Strategy
    pipelines: Sequence[PipelineShare]
    lengths: tuple[int, ...]
    sources: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PipelineCost:
    """What the planner needs to know about one pipeline: per-stage ``T(l) = a·l² + b·l + c``
    (ms), its depth ``pp`` and its ``max_len`` (tokens one micro-batch may hold)."""

    a: float
    b: float
    c: float
    pp: int
    max_len: int
    schedule: str = "1f1b"  # the pipeline schedule (hgraph.schedule.lowerings.PIPELINE_SCHEDULES)
    vpp: int = 1  # virtual stages per stage (interleaved 1F1B when > 1)

    def seq_time(self, length: int) -> float:
        """Per-stage time of one sequence inside a micro-batch, without the fixed ``c``."""
        return self.a * length * length + self.b * length

    def micro_batch_time(self, lengths: Sequence[int]) -> float:
        """``T(mb) = Σ (a·l² + b·l) + c``."""
        return sum(self.a * l * l + self.b * l for l in lengths) + self.c

    def time(self, micro_batches: Sequence[Sequence[int]]) -> float:
        """Time of these micro-batches (lists of lengths) under the pipeline's schedule; 0 when idle
        (``hgraph.schedule.bubble.pipeline_time``)."""
        times = [self.micro_batch_time(mb) for mb in micro_batches if len(mb)]
        return pipeline_time(times, self.pp, self.schedule, self.vpp)

    def __str__(self) -> str:
        return f"T(l)={self.a:.3g}·l²+{self.b:.3g}·l+{self.c:.3g} ms, pp={self.pp}, MaxLen={self.max_len}"


class CommModel(Protocol):
    """Pull Parameter + Push Gradient time of one pipeline of a strategy (ms, before overlap);
    ``layers`` is the model's layer count (the overlap granularity)."""

    layers: int

    def pull_push_ms(self, strategy: Strategy, index: int) -> float: ...


@dataclass(frozen=True)
class AlphaBetaComm:
    """Alpha-beta Pull/Push model (see the module docstring for the formula and the figures)."""

    param_count: float
    layers: int
    bytes_per_param: float = 2.0
    inter_node_gbps: float = 25.0
    intra_node_gbps: float = 300.0
    alpha_ms: float = 0.02
    gpus_per_node: int = 8
    expert_param_count: float = 0.0  # routed experts' parameters (of param_count): an ep pipeline pulls 1/(cp·tp) of them

    @classmethod
    def for_model(cls, hidden: int, layers: int, vocab: int, **figures: Any) -> "AlphaBetaComm":
        """Parameters of a LLaMA-style model: ``12·H²`` per layer plus embedding and LM head."""
        return cls(12.0 * hidden * hidden * layers + 2.0 * vocab * hidden, layers, **figures)

    def pull_push_ms(self, strategy: Strategy, index: int) -> float:
        p = strategy.pipelines[index]
        world = strategy.world_size
        if world <= 1:
            return 0.0
        gbps = self.intra_node_gbps if world <= self.gpus_per_node else self.inter_node_gbps
        experts = self.expert_param_count
        ep_split = p.cp if getattr(p, "ep", 1) > 1 else 1  # ep: E/ep experts cut over etp = cp·tp/ep ranks
        shard_bytes = self.bytes_per_param * ((self.param_count - experts) + experts / ep_split) / (p.tp * p.pp)
        steps = math.ceil(math.log2(world))
        return 2.0 * (shard_bytes / (gbps * 1e9) * 1e3 + steps * self.alpha_ms)


def comm_model_for(cost_model: Any) -> Optional[AlphaBetaComm]:
    """The default comm model of a cost model's table (``model_config`` H, L, V), or None."""
    try:
        config = cost_model.to_table()["model_config"]
        return AlphaBetaComm.for_model(
            int(config["H"]), int(config["L"]), int(config["V"]),
            gpus_per_node=int(getattr(cost_model, "gpus_per_node", 8)),
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def exposed_comm_ms(total_ms: float, compute_ms: float, layers_per_stage: float) -> float:
    """Pull/Push time left on the critical path after overlapping it with compute layer by layer."""
    if total_ms <= 0:
        return 0.0
    return max(total_ms / max(layers_per_stage, 1.0), total_ms - compute_ms)


def pipeline_times(plan: "IterationPlan", comm: Optional[CommModel] = None) -> tuple[float, ...]:
    """Predicted time (ms) of every pipeline of ``plan``: 1F1B compute plus exposed Pull/Push."""
    out = []
    for i, pp in enumerate(plan.pipelines):
        compute = pp.cost.time(pp.micro_batch_lengths)
        if comm is not None:
            per_stage = comm.layers / pp.cost.pp
            compute += exposed_comm_ms(comm.pull_push_ms(plan.strategy, i), compute, per_stage)
        out.append(compute)
    return tuple(out)


def predict(plan: "IterationPlan", comm: Optional[CommModel] = None) -> float:
    """Predicted iteration time (ms): the slowest pipeline of ``plan``."""
    return max(pipeline_times(plan, comm))


def check_plan(plan: "IterationPlan", lengths: Sequence[int]) -> None:
    """Raise ``PlanError`` unless every piece of the batch is placed once and every micro-batch fits."""
    seen = [0] * len(plan.lengths)
    for pp in plan.pipelines:
        for mb, mb_lengths in zip(pp.micro_batches, pp.micro_batch_lengths):
            tokens = sum(mb_lengths)
            if tokens > pp.cost.max_len:
                raise PlanError(
                    f"micro-batch {list(mb)} of pipeline {pp.pipeline} holds {tokens} tokens, "
                    f"more than its MaxLen {pp.cost.max_len}"
                )
            for i in mb:
                seen[i] += 1
    bad = [i for i, n in enumerate(seen) if n != 1]
    if bad:
        raise PlanError(f"plan places pieces {bad[:10]} {[seen[i] for i in bad[:10]]} times; each must appear once")
    by_source: dict[int, int] = {}
    for (src, _), l in zip(plan.sources, plan.lengths):
        by_source[src] = by_source.get(src, 0) + l
    if [by_source.get(i, 0) for i in range(len(lengths))] != list(lengths):
        raise PlanError("plan pieces do not add up to the batch's sequence lengths")


@dataclass(frozen=True)
class IterationPrediction:
    """A predicted iteration (ms) split into the terms an online correction scales: the critical
    pipeline's compute (``T(l)`` with activation steps, 1F1B), its exposed Pull/Push, and the fixed
    rest. ``total_ms`` is their sum; ``pipeline_ms`` holds every pipeline's compute + exposed comm."""

    strategy: str
    compute_ms: float
    comm_ms: float
    fixed_ms: float
    pipeline_ms: tuple[float, ...]

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms + self.fixed_ms

    @property
    def terms(self) -> tuple[float, float, float]:
        return (self.compute_ms, self.comm_ms, self.fixed_ms)

    def __str__(self) -> str:
        return (f"{self.strategy}: {self.total_ms:.1f} ms = compute {self.compute_ms:.1f} + exposed comm "
                f"{self.comm_ms:.1f} + fixed {self.fixed_ms:.1f}")


def iteration_from_compute(
    strategy: Strategy, compute_ms: Sequence[float], terms: IterationTerms, schedule: str
) -> IterationPrediction:
    """The iteration of ``strategy`` whose pipelines compute for ``compute_ms`` (1F1B from the profiled
    ``T(l)``, activation steps included; times the strategy's measured ``compute_scale``): the slowest
    pipeline's compute plus its exposed Pull/Push, plus the fixed rest."""
    st = terms.of(strategy, schedule)
    compute_ms = [st.compute_scale * t for t in compute_ms]
    per = [t + st.exposed_comm_ms(t) for t in compute_ms]
    k = max(range(len(per)), key=per.__getitem__)
    return IterationPrediction(str(strategy), compute_ms[k], per[k] - compute_ms[k], st.fixed_ms, tuple(per))


def predict_iteration(
    strategy: Strategy, micro_batch_lengths: Sequence[Sequence[Sequence[int]]], cost_model: Any,
    terms: IterationTerms, schedule: str = "none", pipeline_schedule: str = "1f1b",
) -> IterationPrediction:
    """Predicted iteration of ``strategy`` running these micro-batches (per pipeline, lists of
    sequence lengths) under ``schedule``, from the profiled ``T(l)`` of ``cost_model`` and the
    measured ``terms``. Overlap-aware: under ``schedule="overlap"`` only the exposed part of
    Pull/Push counts (``StrategyTerms.exposed_comm_ms``), not their sum."""
    if len(micro_batch_lengths) != len(strategy.pipelines):
        raise PlanError(f"{len(micro_batch_lengths)} pipelines of micro-batches for strategy {strategy} "
                        f"with {len(strategy.pipelines)} pipelines")
    compute = []
    for p, mbs in zip(strategy.pipelines, micro_batch_lengths):
        stage = terms.stage_cost(cost_model.stage_cost(p.stage_key), p.pp)
        times = [stage.micro_batch_time(mb) for mb in mbs if len(mb)]
        compute.append(pipeline_time(times, p.pp, pipeline_schedule, p.vpp))
    return iteration_from_compute(strategy, compute, terms, schedule)
