"""hgraph: heterogeneous parallel training for variable-length data, as torch.fx passes.

Public API: layouts (``Layout``, ``LayoutUnion``, ``Shard``, ``Replicate``, ``Partial``), strategies
(``Strategy``, ``Pipeline``), the layout solver (``hgraph.lnk``), the planner (``hgraph.planner``),
``compile`` and the runtime (``launch``, ``Trainer``). Errors derive from ``HGraphError``.
"""

from hgraph.errors import (
    CheckpointError,
    CommunicationError,
    CostModelError,
    HGraphError,
    InputError,
    LayoutError,
    PlanError,
    ShardingRuleError,
    StrategyError,
    TraceError,
    TrainingError,
)
from hgraph.layout import Layout, LayoutUnion, Partial, Replicate, Shard
from hgraph.strategy import Pipeline, Strategy

__all__ = [
    "CheckpointError",
    "CommunicationError",
    "CostModelError",
    "HGraphError",
    "InputError",
    "Layout",
    "LayoutError",
    "LayoutUnion",
    "Partial",
    "Pipeline",
    "PlanError",
    "Replicate",
    "Shard",
    "ShardingRuleError",
    "Strategy",
    "StrategyError",
    "TraceError",
    "TrainingError",
]
