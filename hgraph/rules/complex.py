"""Rules for complex-number rotary embeddings (Llama 4, DeepSeek-V2's ``freqs_cis``).

The rotation is written as ``polar(ones, freqs)`` (a pointwise complex table), ``view_as_complex`` of
the features viewed as ``[..., d/2, 2]`` pairs, a complex ``mul`` (pointwise) and ``view_as_real``
back. The views only pair or unpair the trailing size-2 dim, so every other dim keeps its shard
(heads on tp, tokens on cp) and a Partial value stays Partial (both views are linear); the pair dim
itself must be whole.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from hgraph.core.placement import Partial, Shard
from hgraph.rules.base import P, R, Decision, RuleInput
from hgraph.rules.elementwise import pointwise_rule
from hgraph.rules.registry import register

aten = torch.ops.aten


def view_as_complex_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``[..., 2]`` real pairs -> ``[...]`` complex: the pair dim whole, the others kept."""
    x = node.args[0]
    last = rin.ndim(x) - 1
    req = [R if isinstance(p, Shard) and p.dim % (last + 1) == last else p for p in rin.spec(x)]
    out = [dataclasses.replace(p, dim=p.dim % (last + 1)) if isinstance(p, Shard) else p for p in req]
    return Decision(output=(out[0], out[1]), inputs={x: (req[0], req[1])})


def view_as_real_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``[...]`` complex -> ``[..., 2]`` real pairs: every shard kept (a new trailing dim)."""
    x = node.args[0]
    nd = rin.ndim(x)
    spec = rin.spec(x)
    out = [dataclasses.replace(p, dim=p.dim % nd) if isinstance(p, Shard) else P if isinstance(p, Partial) else p
           for p in spec]
    return Decision(output=(out[0], out[1]), inputs={x: spec})


register(aten.polar, pointwise_rule)
register(aten.view_as_complex, view_as_complex_rule)
register(aten.view_as_real, view_as_real_rule)
