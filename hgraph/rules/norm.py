"""Rules for reductions, softmax and layer/RMS norm.

A norm or softmax needs its whole normalised dim on every rank, so a shard there is gathered
first; other dims (tokens under cp or sequence parallelism) stay split. A ``sum`` (or ``mean``) over
a sharded dim leaves a Partial result — the summed loss over cp-split tokens is one. ``max`` /
``min`` along a dim (values and indices: gpt-oss subtracts the row maximum next to its attention
sinks) and ``argmax`` / ``argmin`` need that dim whole; their elementwise forms
(``max.other``, ``min.other``) are pointwise. Norm weights
stay replicated; when the activations are sharded their gradient is Partial (``annotate`` records it).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from hgraph.core.placement import Partial, Shard
from hgraph.rules.base import CP, P, R, Decision, RuleInput, interleave_aware
from hgraph.rules.elementwise import pointwise_rule
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


def _whole_along(rin: RuleInput, x: fx.Node, dim: int, what: str) -> list:
    """Placements of ``x`` with ``dim`` whole (Partial reduced); a cp cut of ``dim`` is refused."""
    nd = rin.ndim(x)
    req = []
    for m, p in enumerate(rin.spec(x)):
        if isinstance(p, Shard) and p.dim % nd == dim:
            if m == CP and rin.degree(CP) > 1:
                raise rin.error(
                    f"{what} reads across dim {dim}, which context parallelism splits into load-balanced "
                    "token chunks; use a strategy without cp for this model"
                )
            p = R
        req.append(R if isinstance(p, Partial) else p)
    return req


def arg_reduction_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``max.dim`` / ``min.dim`` (values, indices) and ``argmax`` / ``argmin``: the dim whole, other
    shards kept (shifted down when the dim is dropped); without a dim, the whole tensor."""
    x = node.args[0]
    nd = rin.ndim(x)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if dim is None:
        return Decision(output=(R, R), inputs={x: (R, R)})
    dim %= nd
    req = _whole_along(rin, x, dim, str(node.target))
    out = [dataclasses.replace(p, dim=p.dim % nd - (not keepdim and p.dim % nd > dim)) if isinstance(p, Shard) else p
           for p in req]
    spec = (out[0], out[1])
    return Decision(output=(spec, spec) if isinstance(node.meta.get("val"), (list, tuple)) else spec,
                    inputs={x: (req[0], req[1])})


def max_min_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``max`` / ``min``: ``.other`` is elementwise, ``.dim`` picks along a dim, ``.default`` reduces all."""
    overload = node.target._overloadname
    if overload == "other":
        return pointwise_rule(node, rin)
    if overload == "default":
        return reduction_rule(node, rin)
    return arg_reduction_rule(node, rin)


register(aten.max, max_min_rule)
register(aten.min, max_min_rule)
for _op in (aten.argmax, aten.argmin):
    register(_op, arg_reduction_rule)
for _rule in (reduction_rule, softmax_rule, norm_rule):
    interleave_aware(_rule)  # a kept dim keeps its shard as it is; a reduced one is gathered or summed
for _op in (aten.sum, aten.mean, aten.amax, aten.amin, aten.logsumexp, aten.prod):
    register(_op, reduction_rule)
for _op in (aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax):
    register(_op, softmax_rule)
for _op in (aten.layer_norm, aten.rms_norm):
    register(_op, norm_rule)
