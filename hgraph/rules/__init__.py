"""Sharding rules: how each op's inputs and output are placed on a stage mesh ``(cp, tp)``.

``hgraph.rules.register(op, rule)`` adds a rule for a user's own op. A rule reads the specs of the
op's inputs and returns a ``Decision`` (see ``hgraph.rules.base``); for an elementwise custom op::

    from hgraph.rules import register
    from hgraph.rules.elementwise import pointwise_rule

    register(torch.ops.mylib.fused_gelu.default, pointwise_rule)  # follows its inputs' shards

or by hand::

    def rule(node, rin):            # rin: RuleInput (specs, example shapes, mesh degrees)
        x = node.args[0]
        spec = rin.spec(x)          # (cp placement, tp placement)
        return Decision(output=spec, inputs={x: spec})
"""

import threading

from hgraph.rules.base import MESH_DIMS, Decision, RuleInput, ShardingOptions, Spec, spec_str
from hgraph.rules.registry import lookup, register, registered_ops, unregister
from hgraph.rules.sharding_utils import assemble_grad, mesh_coord, mesh_groups, shard_for_rank

__all__ = [
    "MESH_DIMS",
    "Decision",
    "RuleInput",
    "ShardingOptions",
    "Spec",
    "assemble_grad",
    "lookup",
    "mesh_coord",
    "mesh_groups",
    "register",
    "registered_ops",
    "shard_for_rank",
    "spec_str",
    "unregister",
]

_BUILTIN_MODULES = ("elementwise", "shape", "linear", "embedding", "attention", "norm", "loss", "indexing", "moe")
_loaded = False
_LOAD_LOCK = threading.RLock()


def _load_builtin_rules() -> None:
    """Import the built-in rule modules once (they register themselves)."""
    global _loaded
    if _loaded:
        return
    with _LOAD_LOCK:  # a second thread must not see the flag before every rule is registered
        if _loaded:
            return
        import importlib

        for name in _BUILTIN_MODULES:
            importlib.import_module(f"hgraph.rules.{name}")
        _loaded = True
