"""``hgraph.errors``: the one error hierarchy of hgraph; every user-facing failure is an ``HGraphError``.

Messages name the offending value and what would be valid, so the user can fix the input
without reading hgraph's source.
"""

from __future__ import annotations


class HGraphError(Exception):
    """Base class of every error hgraph raises on purpose."""


class LayoutError(HGraphError, ValueError):
    """A layout, placement or layout union is malformed, or two layouts do not fit together."""


class StrategyError(HGraphError, ValueError):
    """A parallel strategy is invalid for the model or the world size."""


class TraceError(HGraphError):
    """The model could not be captured as a graph (unsupported construct)."""


class ShardingRuleError(HGraphError):
    """An op in the graph has no sharding rule, or its rule cannot handle the given layouts."""


class PlanError(HGraphError, ValueError):
    """The planner cannot place a batch (e.g. a sequence longer than every MaxLen)."""


class CostModelError(HGraphError, ValueError):
    """A cost table or hardware/model description is malformed or lacks a needed scheme."""


class InputError(HGraphError, ValueError):
    """Inputs at run time do not match what the program was compiled for."""


class CommunicationError(HGraphError, RuntimeError):
    """A collective or point-to-point transfer failed or timed out (names the rank and the step)."""


class CheckpointError(HGraphError):
    """A checkpoint is incomplete, corrupt or does not match the model."""


class TrainingError(HGraphError, RuntimeError):
    """Training cannot continue (e.g. a non-finite loss); optimizer state is left unchanged."""


class PackingError(HGraphError):
    """Packing documents into one micro-batch is not proved exact for this model, and packing was required."""


__all__ = [
    "CheckpointError", "CommunicationError", "CostModelError", "HGraphError", "InputError", "LayoutError",
    "PackingError", "PlanError", "ShardingRuleError", "StrategyError", "TraceError", "TrainingError",
]
