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

from hgraph.rules.mesh import MESH_DIMS, ShardingOptions
from hgraph.rules.base import Decision, RuleInput, Spec, spec_str
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
