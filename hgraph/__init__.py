"""hgraph: heterogeneous parallel training for variable-length data, as torch.fx passes.

The top level holds sixteen names: ``compile`` and its options (``CompileOptions``, ``ScheduleConfig``,
``RecomputeConfig``, ``BuildConfig``), strategies (``Strategy``, ``Pipeline``), the layouts users write
(``Layout``, ``Shard``, ``Replicate``), training (``Trainer`` with ``AdamWConfig`` and ``RunConfig``),
``launch``, ``init_from_env`` and ``HGraphError``. Everything else is reached through its subpackage:
``hgraph.errors`` (every error class), ``hgraph.program.options.OverlapConfig``,
``hgraph.core.placement`` (``Partial``), ``hgraph.core.layout`` (``LayoutUnion``), ``hgraph.planner`` (``Planner``, ``CostModel``,
``propose``), ``hgraph.frontend`` (``trace``), ``hgraph.lnk``, ``hgraph.data``, ``hgraph.models``,
``hgraph.compiler.compiled_model.CompiledModel``, ``hgraph.passes.pipeline.Pass``,
``hgraph.runtime.checkpoint_manager.CheckpointManager``, ``hgraph.runtime.metrics.MetricsConfig`` and
``hgraph.training.export.export_pretrained``.
"""

import importlib

from hgraph.core.layout import Layout
from hgraph.core.placement import Replicate, Shard
from hgraph.core.strategy import Pipeline, Strategy
from hgraph.errors import HGraphError

# Heavy parts (torch.export, the runtime) load on first use, so `import hgraph` stays light:
# name -> the module defining it (a subpackage named for itself is the module).
_LAZY = {
    "compile": "hgraph.compiler.entry",
    "CompileOptions": "hgraph.program.options",
    "ScheduleConfig": "hgraph.program.options",
    "RecomputeConfig": "hgraph.program.options",
    "BuildConfig": "hgraph.program.options",
    "Trainer": "hgraph.training.trainer",
    "AdamWConfig": "hgraph.training.configs",
    "RunConfig": "hgraph.training.configs",
    "launch": "hgraph.runtime.launch",
    "init_from_env": "hgraph.runtime.launch",
    **{name: f"hgraph.{name}" for name in (
        "cli", "compiler", "core", "data", "errors", "frontend", "lnk", "models", "passes", "planner",
        "profiling", "program", "rules", "runtime", "schedule", "training",
    )},
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hgraph' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    return module if _LAZY[name] == f"hgraph.{name}" else getattr(module, name)


__all__ = [
    "AdamWConfig",
    "BuildConfig",
    "CompileOptions",
    "HGraphError",
    "Layout",
    "Pipeline",
    "RecomputeConfig",
    "Replicate",
    "RunConfig",
    "ScheduleConfig",
    "Shard",
    "Strategy",
    "Trainer",
    "compile",
    "init_from_env",
    "launch",
]
