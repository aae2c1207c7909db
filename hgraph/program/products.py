"""Compile products: the typed values ``hgraph.compile`` builds and passes hand to each other.

Options in (``CompileOptions`` with ``RecomputeConfig`` and ``OverlapConfig``), the context a pass
sees (``CompileContext``), and what the passes make: stage programs (``StageGraph`` with its
``Boundary`` values), communication subgraphs (``CommSubgraph``, ``ParameterComm``), a rank's
overlap order (``RankSchedule``) and, finally, one ``RankProgram`` per (strategy, rank), which the
runtime executes. Everything here is data, frozen; the compiler (``hgraph.compiler``) builds it with
the passes of ``hgraph.passes``, and the runtime (``hgraph.runtime``) interprets it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence, Union

import torch
import torch.fx as fx

from hgraph.core.errors import HGraphError, InputError
from hgraph.core.layout import AnyLayout, Layout, Partial
from hgraph.core.strategy import Pipeline, Strategy
from hgraph.lnk.plan import ReshardPlan
from hgraph.lnk.rank_plan import RankPlan
from hgraph.lnk.topology import Topology
from hgraph.runtime.kernels.recompute import MODES
from hgraph.schedule.actions import (
    Action,
    Kind,
    overlap_actions,
    pipeline_actions,
    pipeline_peers,
    with_peers,
)

if TYPE_CHECKING:
    from hgraph.frontend import TracedModel

PULL, PUSH, ACTIVATION = "pull_parameter", "push_gradient", "communicate_activation"
Op = tuple[str, int]  # ("start" | "wait", pull index)


@dataclass(frozen=True)
class RecomputeConfig:
    """Recomputation mode and the layers it applies to (all when neither ``layers`` nor ``every``)."""

    mode: str = "none"
    layers: Optional[frozenset[int]] = None
    every: Optional[int] = None
    keep_communication: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise HGraphError(f"recompute={self.mode!r}; expected one of {', '.join(MODES)}")
        if self.layers is not None and self.every is not None:
            raise HGraphError("RecomputeConfig: give layers= or every=, not both")
        if self.every is not None and (not isinstance(self.every, int) or self.every < 1):
            raise HGraphError(f"RecomputeConfig(every={self.every!r}); expected an integer >= 1")
        if self.layers is not None:
            object.__setattr__(self, "layers", frozenset(int(i) for i in self.layers))

    @classmethod
    def of(cls, value: Union[str, "RecomputeConfig", None]) -> "RecomputeConfig":
        """A config from ``compile``'s ``recompute=`` argument (a mode name or a config)."""
        if value is None:
            return cls()
        if isinstance(value, RecomputeConfig):
            return value
        if isinstance(value, str):
            return cls(value)
        raise HGraphError(f"recompute={value!r}; expected 'none', 'selective', 'full' or a RecomputeConfig")

    def applies_to(self, layer: int) -> bool:
        if self.mode == "none":
            return False
        if self.layers is not None:
            return layer in self.layers
        return self.every is None or layer % self.every == 0

    def fraction(self, num_layers: int) -> float:
        """Share of the model's ``num_layers`` layers that are recomputed."""
        if num_layers < 1:
            return 0.0
        return sum(self.applies_to(i) for i in range(num_layers)) / num_layers

    def __str__(self) -> str:
        if self.mode == "none":
            return "none"
        which = (
            f"layers {sorted(self.layers)}" if self.layers is not None
            else f"every {self.every} layers" if self.every is not None else "all layers"
        )
        reissue = ", collectives reissued" if not self.keep_communication else ""
        return f"{self.mode} ({which}{reissue})"


@dataclass(frozen=True)
class OverlapConfig:
    """Knobs of the overlap scheduler (``hgraph.compile(..., schedule=OverlapConfig(...))``)."""

    prefetch_layers: int = 1
    bucket_bytes: int = 1 << 20
    max_inflight_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.prefetch_layers < 0:
            raise InputError(f"prefetch_layers={self.prefetch_layers}; expected an integer >= 0")
        if self.bucket_bytes < 0:
            raise InputError(f"bucket_bytes={self.bucket_bytes}; expected >= 0 (0: one push per bucket)")
        if self.max_inflight_bytes is not None and self.max_inflight_bytes <= 0:
            raise InputError(f"max_inflight_bytes={self.max_inflight_bytes}; expected None or > 0")


@dataclass(frozen=True)
class CompileOptions:
    """Knobs of ``compile`` (all optional)."""

    compute_dtype: Optional[torch.dtype] = None
    sequence_parallel: bool = False
    vocab_parallel: bool = True
    schedule: str = "none"
    layer_costs: Optional[tuple[float, ...]] = None
    topology: Optional[Topology] = None
    overlap: Optional[OverlapConfig] = None  # when schedule == "overlap"
    recompute: RecomputeConfig = RecomputeConfig()
    recompute_by_scheme: tuple[tuple[tuple[int, int, int], RecomputeConfig], ...] = ()  # (cp, tp, pp)
    reduce_dtype: Optional[torch.dtype] = torch.float32
    coalesce: bool = False
    pipeline_schedule: str = "1f1b"  # hgraph.schedule.actions.PIPELINE_SCHEDULES

    def recompute_for(self, cp: int, tp: int, pp: int) -> RecomputeConfig:
        """The recompute config of pipelines with these degrees."""
        return dict(self.recompute_by_scheme).get((cp, tp, pp), self.recompute)

    def __str__(self) -> str:
        changed = [f"{k}={getattr(self, k)}" for k in self.__dataclass_fields__
                   if getattr(self, k) != getattr(_DEFAULT_OPTIONS, k)]
        return "CompileOptions(" + ", ".join(changed) + ")"


_DEFAULT_OPTIONS = CompileOptions()


@dataclass(frozen=True)
class Boundary:
    """A value produced by stage ``src`` and consumed by stage ``dst``."""

    name: str
    src: int
    dst: int


@dataclass(frozen=True)
class StageGraph:
    """One stage's program: placeholders are ``params``, then ``inputs``, then ``recv`` values."""

    stage: int
    gm: fx.GraphModule
    params: list[str]
    inputs: list[str]
    recv: list[Boundary]
    send: list[Boundary]
    returns_loss: bool
    layers: tuple[int, ...] = field(default=())

    @property
    def output_names(self) -> list[str]:
        """Names of the values the stage returns, in order (``"loss"`` first on the last stage)."""
        names = ["loss"] if self.returns_loss else []
        seen = set()
        for b in self.send:
            if b.name not in seen:
                seen.add(b.name)
                names.append(b.name)
        return names

    def __str__(self) -> str:
        return (f"StageGraph(stage {self.stage}, layers {list(self.layers)}, {len(self.gm.graph.nodes)} nodes, "
                f"{len(self.params)} params, recv {[b.name for b in self.recv]}, send {[b.name for b in self.send]})")


@dataclass(frozen=True)
class CommSubgraph:
    """One named communication subgraph: its kind, tensor, layouts, logical bytes and LNK plan."""

    kind: str
    tensor: str
    src: Union[AnyLayout, str]
    dst: Union[AnyLayout, str]
    bytes: int
    plan: Union[ReshardPlan, RankPlan, None] = None  # a full plan, or one rank's part of it
    direction: str = "forward"

    def __str__(self) -> str:
        backward = " (backward)" if self.direction == "backward" and self.kind == ACTIVATION else ""
        return f"{self.kind:<22} {self.tensor:<44} {self.src} -> {self.dst}  {self.bytes} B{backward}"


@dataclass(frozen=True)
class ParameterLayouts:
    """The layouts one parameter moves between in a strategy: fixed optimizer layout, the compute
    layouts of its users (a "duplicate" union) and their gradients (a "partial" union)."""

    name: str
    holders: tuple[tuple[int, int], ...]
    optimizer: Layout
    compute: AnyLayout
    grads: AnyLayout

    def __str__(self) -> str:
        return f"ParameterLayouts({self.name}, holders {list(self.holders)}: {self.optimizer} <-> {self.compute})"



@dataclass(frozen=True)
class ParameterComm:
    """Pull and push of one parameter in one strategy, and which (pipeline, stage) pairs use it."""

    name: str
    holders: tuple[tuple[int, int], ...]
    pull: CommSubgraph
    push: CommSubgraph

    def __str__(self) -> str:
        return f"ParameterComm({self.name}, holders {list(self.holders)}, {self.pull.bytes} B pulled)"


@dataclass(frozen=True)
class RankSchedule:
    """One rank's pull/push order. Pull ops index ``program.pulls``; buckets index ``program.pushes``."""

    rank: int
    prelude: tuple[Op, ...]
    at_use: tuple[tuple[str, tuple[Op, ...]], ...]  # (parameter, ops run before its first use)
    after_forward: tuple[Op, ...]
    at_end: tuple[Op, ...]
    buckets: tuple[tuple[int, ...], ...]
    pull_names: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        label = lambda i: self.pull_names[i] if i < len(self.pull_names) else str(i)  # noqa: E731
        fmt = lambda ops: " ".join(f"{k}:{label(i)}" for k, i in ops)  # noqa: E731
        lines = [f"rank {self.rank}", f"  prelude: {fmt(self.prelude)}"]
        lines += [f"  before {name}: {fmt(ops)}" for name, ops in self.at_use]
        lines += [f"  after forward: {fmt(self.after_forward)}", f"  end: {fmt(self.at_end)}"]
        lines.append("  push buckets: " + " | ".join(",".join(map(str, b)) for b in self.buckets))
        return "\n".join(lines)


@dataclass(frozen=True)
class CompileContext:
    """What a pass sees besides the graph (read-only): the traced model, the stage mesh, the options,
    and the products of the compile steps before it (``stages`` after partition, ``parameter_layouts``
    after insert_comm, ``program`` at the rank level); the compiler hands each level a new context.
    """

    traced: "TracedModel"
    world_size: int
    options: CompileOptions
    cp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual stages per pipeline stage: partition cuts pp * vpp stage programs
    ep: int = 1  # expert-parallel degree: the MoE layers' experts split over the stage's ranks
    strategy: Optional[Strategy] = None
    stages: Optional[tuple[StageGraph, ...]] = None  # the partition step's
    parameter_layouts: Mapping[str, ParameterLayouts] = field(default_factory=lambda: MappingProxyType({}))  # insert_comm's
    recompute: Optional[RecomputeConfig] = None  # this pipeline scheme's, for the recompute pass
    stage: Optional[StageGraph] = None  # the stage program the stage-level passes are running on
    program: Optional["RankProgram"] = None  # the rank program the rank-level passes lower

    @property
    def mesh(self) -> tuple[int, int]:
        return (self.cp, self.tp)

    @property
    def sequence_parallel(self) -> bool:
        return self.options.sequence_parallel

    @property
    def vocab_parallel(self) -> bool:
        return self.options.vocab_parallel

    def __str__(self) -> str:
        where = f", strategy {self.strategy}" if self.strategy is not None else ""
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return f"CompileContext(world {self.world_size}, cp={self.cp}, tp={self.tp}{ep}, pp={self.pp}{where})"


def current_index(groups: dict[str, tuple[int, ...]], dim: str, rank: int) -> int:
    """``rank``'s index in its ``dim`` group (0 when the program has no such group)."""
    group = groups.get(dim, (rank,))
    return group.index(rank)


@dataclass(frozen=True)
class RankProgram:
    """Everything one rank runs in an iteration of one strategy (see ``CompiledModel.program``),
    built whole by the compiler (its overlap order included); a variant is a ``dataclasses.replace``."""

    strategy_index: int
    rank: int
    pipeline: int
    stage: int
    pp: int
    groups: dict[str, tuple[int, ...]]
    stage_graph: StageGraph
    param_of_placeholder: dict[str, str]
    pulls: tuple[ParameterComm, ...]  # layer order
    pushes: tuple[ParameterComm, ...]  # reverse layer order
    activations: tuple[CommSubgraph, ...] = ()
    compute_dtype: Optional[torch.dtype] = None
    overlap: Optional[RankSchedule] = None  # under schedule="overlap"
    reduce_dtype: Optional[torch.dtype] = torch.float32
    coalesce: bool = False  # pull/push one layer's parameters together (runtime/kernels/coalesce.py)
    pipeline_schedule: str = "1f1b"  # hgraph.schedule.actions.PIPELINE_SCHEDULES
    chunk_graphs: tuple[StageGraph, ...] = ()  # per chunk (vpp > 1); chunk 0 is stage_graph
    vpp: int = 1

    @property
    def chunks(self) -> tuple[StageGraph, ...]:
        """The stage programs this rank runs: ``stage_graph``, or every chunk under interleaving."""
        return self.chunk_graphs or (self.stage_graph,)

    @property
    def push_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced and moved in: ``reduce_dtype``, else the compute dtype."""
        return self.reduce_dtype or self.compute_dtype or torch.float32

    def push_source(self, param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A held parameter's gradient (zeros if autograd left none) in ``push_dtype``."""
        if param is None:
            return None
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        return grad.to(self.push_dtype)

    def pipeline_actions(self, num_micro_batches: int) -> list[Action]:
        """The compute and activation actions of this rank's pipeline schedule (peers are ranks)."""
        local = pipeline_actions(self.pipeline_schedule, self.pp, self.vpp, self.stage, num_micro_batches)
        return with_peers(local, pipeline_peers(self.groups["pipeline"], self.pp, self.rank))

    def actions(self, num_micro_batches: int) -> list[Action]:
        """The rank's whole iteration: the ``schedule="overlap"`` lowering (``overlap_actions``) when
        ``overlap`` is set, else ``blocking_actions``."""
        if self.overlap is None:
            return self.blocking_actions(num_micro_batches)
        return overlap_actions(self.pipeline_actions(num_micro_batches), [pc.name for pc in self.pulls],
                               self.overlap, [pc.name for pc in self.pushes])

    def blocking_actions(self, num_micro_batches: int) -> list[Action]:
        """The rank's whole iteration under ``schedule="none"``: every pull (one layer's together
        under ``coalesce``), the pipeline schedule, every push, the optimizer step."""
        pulls = [b[0].name for b in layer_buckets(self.pulls, self.coalesce)]
        pushes = [b[0].name for b in layer_buckets(self.pushes, self.coalesce)]
        out = [Action(k, group=g) for g in pulls for k in (Kind.PULL_START, Kind.PULL_WAIT)]
        out += self.pipeline_actions(num_micro_batches)
        out += [Action(k, group=g) for g in pushes for k in (Kind.PUSH_START, Kind.PUSH_WAIT)]
        return out + [Action(Kind.OPTIMIZER)]

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's loss counts in the iteration's total: on the last stage, one rank per
        replicated copy (tp index 0; cp index 0 too unless the loss stays partial over cp)."""
        if not self.is_last_stage or current_index(self.groups, "tp", self.rank) != 0:
            return False
        return self.loss_partial_over_cp or current_index(self.groups, "cp", self.rank) == 0

    @property
    def loss_partial_over_cp(self) -> bool:
        """True when the stage returns per-cp-rank partial loss sums (their sum is the loss)."""
        out = next(n for n in self.chunks[-1].gm.graph.nodes if n.op == "output")
        loss = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
        spec = loss.meta.get("hgraph_spec")
        return bool(spec) and isinstance(spec[0], Partial)

    def __str__(self) -> str:
        return (f"RankProgram(strategy {self.strategy_index}, rank {self.rank}: pipeline {self.pipeline}, "
                f"stage {self.stage}/{self.pp}, {len(self.pulls)} pulls, {len(self.activations)} activations, "
                f"schedule {'overlap' if self.overlap is not None else 'none'}, "
                f"{'interleaved' if self.vpp > 1 else self.pipeline_schedule})")


def layer_of(names: Sequence[str]) -> list[int]:
    """Layer index of each parameter (in order): consecutive parameters sharing the prefix up to the
    first numeric path component (``layers.3.``) are one layer; others are a layer each."""
    out, key_prev, layer = [], None, -1
    for name in names:
        m = re.match(r"^(.*?\.\d+)\.", name)
        key = m.group(1) if m else name
        if key != key_prev:
            layer += 1
            key_prev = key
        out.append(layer)
    return out


def layer_buckets(comms: Sequence[ParameterComm], coalesce: bool) -> list[list[ParameterComm]]:
    """``comms`` cut into runs of one layer each when ``coalesce``, else singletons."""
    if not coalesce:
        return [[pc] for pc in comms]
    buckets: list[list[ParameterComm]] = []
    previous = None
    for pc, layer in zip(comms, layer_of([pc.name for pc in comms])):
        if buckets and layer == previous:
            buckets[-1].append(pc)
        else:
            buckets.append([pc])
        previous = layer
    return buckets


class CompiledPrograms(Protocol):
    """What the runtime reads of a compiled model: ``hgraph.compiler.compiled_model.CompiledModel`` is one. The
    runtime sits below the compiler (``compiled.simulate`` runs it), so it names this, not the class."""

    traced: "TracedModel"
    strategies: list[Strategy]
    world_size: int
    options: CompileOptions
    optimizer_layouts: dict[str, Layout]

    def program(self, strategy: Union[int, Strategy], rank: int) -> RankProgram: ...

    def stage_graphs(self, pipeline: Pipeline) -> list[StageGraph]: ...

    def master_parameters(self) -> dict[str, torch.Tensor]: ...
