"""The rank program: everything one rank runs in an iteration of one strategy, and how it lowers into
the action IR (``RankProgram.actions``); the ``CompiledPrograms`` protocol the runtime reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

import torch
from torch import fx

from hgraph.core.layer_names import layer_runs
from hgraph.core.layout import Layout
from hgraph.core.placement import Partial
from hgraph.core.strategy import Pipeline, Strategy
from hgraph.program.options import CompileOptions
from hgraph.program.products import CommSubgraph, PackingProof, ParameterComm, StageGraph
from hgraph.schedule.actions import Action, ScheduleError, pipeline_peers, with_peers
from hgraph.schedule.lowerings import (
    FORWARD,
    LOWERINGS,
    PullPushOrder,
    blocking_order,
    lowering_name,
    pipeline_actions,
    place,
)

if TYPE_CHECKING:
    from hgraph.frontend import TracedModel


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
    overlap: Optional[PullPushOrder] = None  # under schedule="overlap" (hgraph.compiler.overlap_order)
    # under schedule="overlap": the stage graph with use nodes (``hgraph.passes.schedule.overlap_graph``)
    overlap_graph: Optional[fx.GraphModule] = None
    reduce_dtype: Optional[torch.dtype] = torch.float32
    coalesce: bool = False  # pull/push one layer's parameters together (runtime/kernels/coalesce.py)
    pipeline_schedule: str = "1f1b"  # hgraph.schedule.lowerings.PIPELINE_SCHEDULES
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

    def actions(self, num_micro_batches: int, mode: str = "train") -> list[Action]:
        """The rank's whole iteration. ``mode="train"``: the pipeline actions with the ``overlap``
        order placed around them (``hgraph.schedule.lowerings.place``) when it is set, else
        ``blocking_actions``. ``mode="eval"`` (held-out loss): every pull, then the ``"forward"``
        lowering (forwards and activation transfers); no backward, push or optimizer step."""
        if mode == "eval":
            local = LOWERINGS[FORWARD](self.pp, self.vpp, self.stage, num_micro_batches)
            peers = pipeline_peers(self.groups["pipeline"], self.pp, self.rank)
            return list(blocking_order(self._pulls(), ()).prelude) + with_peers(local, peers)
        if mode != "train":
            raise ScheduleError(f"RankProgram.actions(mode={mode!r}); expected 'train' or 'eval'")
        if self.overlap is None:
            return self.blocking_actions(num_micro_batches)
        return place(self.pipeline_actions(num_micro_batches), self.overlap)

    def blocking_actions(self, num_micro_batches: int) -> list[Action]:
        """The rank's whole iteration under ``schedule="none"``: every pull (one layer's together
        under ``coalesce``), the pipeline schedule, every push, the optimizer step."""
        pushes = [b[0].name for b in layer_buckets(self.pushes, self.coalesce)]
        return place(self.pipeline_actions(num_micro_batches), blocking_order(self._pulls(), pushes))

    def _pulls(self) -> list[str]:
        """The pull groups in layer order (one layer's together under ``coalesce``)."""
        return [b[0].name for b in layer_buckets(self.pulls, self.coalesce)]

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
                f"{lowering_name(self.pipeline_schedule, self.vpp)})")


def layer_buckets(comms: Sequence[ParameterComm], coalesce: bool) -> list[list[ParameterComm]]:
    """``comms`` cut into runs of one layer each when ``coalesce``, else singletons."""
    if not coalesce:
        return [[pc] for pc in comms]
    buckets: list[list[ParameterComm]] = []
    previous = None
    for pc, layer in zip(comms, layer_runs([pc.name for pc in comms])):
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
    packing: PackingProof

    def program(self, strategy: Union[int, Strategy], rank: int) -> RankProgram: ...

    def stage_graphs(self, pipeline: Pipeline) -> list[StageGraph]: ...

    def master_parameters(self) -> dict[str, torch.Tensor]: ...

    def packing_for(self, tokens: int) -> PackingProof: ...
