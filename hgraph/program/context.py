"""The context a pass sees besides its graph (``CompileContext``): read-only, a new one per level."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional

from hgraph.core.strategy import Strategy
from hgraph.program.options import CompileOptions, RecomputeConfig
from hgraph.program.products import ParameterLayouts, StageGraph
from hgraph.program.rank_program import RankProgram

if TYPE_CHECKING:
    from hgraph.frontend import TracedModel


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
        return f"CompileContext(world {self.world_size}, cp={self.cp}, tp={self.tp}, pp={self.pp}{where})"
