"""hgraph: heterogeneous parallel training for variable-length data, as torch.fx passes.

Public API: layouts (``Layout``, ``LayoutUnion``, ``Shard``, ``Replicate``, ``Partial``), strategies
(``Strategy``, ``Pipeline``), the layout solver (``hgraph.lnk``), the planner (``hgraph.planner``),
``compile``, the runtime (``launch``, ``Trainer``, ``CheckpointManager``, ``MetricsConfig``), data (``hgraph.data``) and ``export_pretrained``.
Errors derive from ``HGraphError``.
"""

from hgraph.core.errors import (
    CheckpointError,
    CommunicationError,
    CostModelError,
    HGraphError,
    InputError,
    LayoutError,
    PackingError,
    PlanError,
    ShardingRuleError,
    StrategyError,
    TraceError,
    TrainingError,
)
from hgraph.core.layout import Layout, LayoutUnion
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.core.strategy import Pipeline, Strategy


def __getattr__(name: str):
    # Heavy parts (torch.export, the runtime) load on first use, so `import hgraph` stays light.
    if name == "compile":
        from hgraph.compiler.entry import compile

        return compile
    if name == "CompiledModel":
        from hgraph.compiler.compiled_model import CompiledModel

        return CompiledModel
    if name == "Pass":
        from hgraph.passes.pipeline import Pass

        return Pass
    if name == "launch":
        from hgraph.runtime.launch import launch

        return launch
    if name == "init_from_env":
        from hgraph.runtime.launch import init_from_env

        return init_from_env
    if name == "export_pretrained":
        from hgraph.training.export import export_pretrained

        return export_pretrained
    if name == "Trainer":
        from hgraph.training.trainer import Trainer

        return Trainer
    if name == "CheckpointManager":
        from hgraph.runtime.checkpoint_manager import CheckpointManager

        return CheckpointManager
    if name == "MetricsConfig":
        from hgraph.runtime.metrics import MetricsConfig

        return MetricsConfig
    if name in ("Planner", "CostModel", "propose", "load_cost_model", "IterationPlan"):
        from hgraph import planner

        return getattr(planner, name)
    if name in ("trace", "TracedModel"):
        from hgraph import frontend

        return getattr(frontend, name)
    if name in ("rules", "lnk", "planner", "frontend", "models", "data"):
        import importlib

        return importlib.import_module(f"hgraph.{name}")
    raise AttributeError(f"module 'hgraph' has no attribute {name!r}")

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CompiledModel",
    "CostModel",
    "IterationPlan",
    "Pass",
    "Planner",
    "TracedModel",
    "Trainer",
    "compile",
    "export_pretrained",
    "init_from_env",
    "launch",
    "load_cost_model",
    "propose",
    "trace",
    "CommunicationError",
    "CostModelError",
    "HGraphError",
    "InputError",
    "Layout",
    "LayoutError",
    "PackingError",
    "LayoutUnion",
    "MetricsConfig",
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
