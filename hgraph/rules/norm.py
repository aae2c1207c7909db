"""Rules for reductions, softmax and layer/RMS norm.

A norm or softmax needs its whole normalised dim on every rank, so a shard there is gathered
first; other dims (tokens under cp or sequence parallelism) stay split. A ``sum`` (or ``mean``) over
a sharded dim leaves a Partial result — the summed loss over cp-split tokens is one. Norm weights
stay replicated; when the activations are sharded their gradient is Partial (``annotate`` records it).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from hgraph.core.layout import Partial, Shard
from hgraph.rules.base import P, R, Decision, RuleInput
from hgraph.rules.registry import register

aten = torch.ops.aten


def reduction_rule(node: fx.Node, rin: RuleInput) -> Decision:
    x = node.args[0]
    nd = rin.ndim(x)
    dims_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims_arg, int):
        dims_arg = [dims_arg]
    dims = {d % nd for d in dims_arg} if dims_arg else set(range(nd))
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    linear = node.target.overloadpacket in (aten.sum, aten.mean)
    mean = node.target.overloadpacket is aten.mean
    spec = rin.spec(x)
    req, out = list(spec), [R, R]
    for m, p in enumerate(spec):
        if rin.degree(m) == 1:
            continue
        if isinstance(p, Partial):
            if linear:
                out[m] = P
            else:
                req[m] = R
        elif isinstance(p, Shard):
            d = p.dim % nd
            if d in dims:
                if linear and not mean:
                    out[m] = P
                else:
                    req[m] = R
            else:
                out[m] = dataclasses.replace(p, dim=d if keepdim else d - sum(r < d for r in dims))
    return Decision(output=(out[0], out[1]), inputs={x: (req[0], req[1])})


def softmax_rule(node: fx.Node, rin: RuleInput) -> Decision:
    x = node.args[0]
    nd = rin.ndim(x)
    dim = node.args[1] % nd
    spec = rin.spec(x)
    req = [R if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim % nd == dim) else p for p in spec]
    return Decision(output=(req[0], req[1]), inputs={x: (req[0], req[1])})


def norm_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """layer_norm(x, shape, weight, bias, ...) and rms_norm(x, shape, weight, eps)."""
    x, normalized = node.args[0], node.args[1]
    nd = rin.ndim(x)
    first = nd - len(normalized)
    spec = rin.spec(x)
    req = list(spec)
    for m, p in enumerate(spec):
        if isinstance(p, Partial):
            req[m] = rin.partial_target(m, nd, rin.shape(x))
            p = req[m]
        if isinstance(p, Shard) and p.dim % nd >= first:
            req[m] = R
    inputs = {x: (req[0], req[1])}
    for extra in node.args[2:4]:
        if isinstance(extra, fx.Node) and rin.is_tensor(extra):
            inputs[extra] = (R, R)
    return Decision(output=(req[0], req[1]), inputs=inputs)


for _op in (aten.sum, aten.mean, aten.amax, aten.amin, aten.logsumexp, aten.prod):
    register(_op, reduction_rule)
for _op in (aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax):
    register(_op, softmax_rule)
for _op in (aten.layer_norm, aten.rms_norm):
    register(_op, norm_rule)
