"""Rules for pointwise ops, copies/casts, triangular masks, factories and size queries.

Pointwise ops follow their inputs: on each mesh dim the first input sharded on a (broadcast-aligned)
dim decides the output shard, and every other input that is not broadcast along that dim is brought
to the same shard. Partial inputs are reduced first (all-reduce, or reduce-scatter to the sequence
dim under sequence parallelism): a nonlinear op of a pending sum is wrong, and reducing at the first
consumer is exactly where Megatron reduces (after a row-parallel linear). Copies and widening floating
casts keep a Partial value as it is; integer, bool and narrowing casts reduce it first.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from hgraph.core.placement import Partial, Shard
from hgraph.rules.base import CP, TP, P, R, Decision, RuleInput, Spec, interleave_aware
from hgraph.rules.registry import register

aten = torch.ops.aten


def pointwise_decision(node: fx.Node, rin: RuleInput, inputs: list[fx.Node], keep_partial: bool = False) -> Decision:
    """Decide a broadcasting pointwise op over ``inputs`` (see the module docstring)."""
    out_shape = rin.shape(node)
    out_ndim = len(out_shape)
    out: list = [R, R]
    req: dict[fx.Node, list] = {a: [R, R] for a in inputs}
    for m in (CP, TP):
        if rin.degree(m) == 1:
            continue
        places = {a: rin.placement(a, m) for a in inputs}
        if keep_partial and inputs and all(isinstance(p, Partial) for p in places.values()):
            out[m] = P
            for a in inputs:
                req[a][m] = P
            continue
        chosen = None
        for a in inputs:
            p = places[a]
            if isinstance(p, Shard):
                chosen = dataclasses.replace(p, dim=p.dim % rin.ndim(a) + out_ndim - rin.ndim(a))
                break
        if chosen is None and any(isinstance(p, Partial) for p in places.values()):
            target = rin.partial_target(m, out_ndim, out_shape)
            chosen = target if isinstance(target, Shard) else None
        if chosen is None:
            continue
        out[m] = chosen
        for a in inputs:
            d = chosen.dim - (out_ndim - rin.ndim(a))
            if d >= 0 and rin.shape(a)[d] != 1:
                req[a][m] = dataclasses.replace(chosen, dim=d)
    return Decision(output=(out[0], out[1]), inputs={a: (r[0], r[1]) for a, r in req.items()})


def pointwise_rule(node: fx.Node, rin: RuleInput) -> Decision:
    return pointwise_decision(node, rin, rin.tensor_inputs(node))


def copy_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """Copies and casts: the output has the input's spec (a ``type_as``/``to`` reference tensor only
    lends its dtype, so it is not converted). Partial is kept only where the cast is exact on every
    piece: a copy, or a cast to a floating/complex type that holds every value of the input's (the
    sum of the pieces' casts is then the cast of the sum). A cast to an integer or bool type (the sum
    of truncated pieces is not the truncated sum) or to a narrower float (each piece rounds on its
    own, and pieces larger than their sum lose the sum's digits) reduces a Partial input first, in
    the input's precision."""
    inputs = rin.tensor_inputs(node)[:1]
    return pointwise_decision(node, rin, inputs, keep_partial=bool(inputs) and _exact_cast(inputs[0], node))


def _exact_cast(source: fx.Node, node: fx.Node) -> bool:
    """Whether casting ``source``'s values to ``node``'s dtype is exact (a widening float cast)."""
    src, out = source.meta.get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if not (out.is_floating_point() or out.is_complex()) or not (src.is_floating_point() or src.is_complex()):
        return False
    if src.is_complex() and not out.is_complex():
        return False
    have, want = torch.finfo(_real(src.dtype)), torch.finfo(_real(out.dtype))
    return want.eps <= have.eps and want.max >= have.max and want.tiny <= have.tiny


def _real(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


def dropout_rule(node: fx.Node, rin: RuleInput) -> Decision:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    if train and p != 0:
        raise rin.error(
            f"dropout with p={p} in training mode: ranks holding replicated activations would draw "
            "different masks; call model.eval() before hgraph.compile (dropout off, the model's "
            "config unchanged) or set the dropout probability to 0"
        )
    return copy_rule(node, rin)


def like_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``zeros_like`` & co. read only the local shape: same shards, never Partial, no communication."""
    x = node.args[0]
    spec = rin.spec(x)
    out: Spec = tuple(R if isinstance(p, Partial) else p for p in spec)  # type: ignore[assignment]
    return Decision(output=out, inputs={})


def factory_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """Tensors created from constants (``arange``, ``zeros``, ``full``...) are the same on every rank.

    A constant-filled tensor (``zeros``, ``full``, ``new_empty``...) sized by the local size of a
    sharded dim — ``sym_size(t, d)`` of a tensor cut on ``d`` (MLA's ``k.new_empty(*k.shape[:-1], n)``
    under cp) — is that dim's local piece: it is cut like ``t``. Any other size read from a sharded
    dim (an ``arange`` over local tokens would number them wrongly) is refused.
    """
    out = [R, R]
    sizes = _size_list(node)
    for arg in node.all_input_nodes:
        if rin.is_tensor(arg) or (rin.size_cut(arg) or 1) == 1:
            continue
        cut = _cut_like(arg, rin) if node.target.overloadpacket not in _NUMBERED and arg in sizes else None
        if cut is None:
            raise rin.error(
                f"its size {arg.name} is the local size of a sharded dim; a factory op sized by sharded "
                "tokens or features has no sharding rule"
            )
        for m, placement in enumerate(cut):
            if placement is not None:
                out[m] = Shard(sizes.index(arg))
    return Decision(output=(out[0], out[1]), inputs={})


_NUMBERED = (aten.arange, aten.scalar_tensor)  # values depend on the size: never cut


def _size_list(node: fx.Node) -> list:
    """The size argument of a factory (``zeros(size)``, ``new_zeros(x, size)``...)."""
    position = 1 if node.target.overloadpacket.__name__.startswith("new_") else 0
    sizes = node.args[position] if len(node.args) > position else node.kwargs.get("size", ())
    return list(sizes) if isinstance(sizes, (list, tuple)) else []


def _cut_like(size: fx.Node, rin: RuleInput) -> "list | None":
    """Per mesh dim, whether ``size`` (``sym_size(t, d)``) is cut there because ``t`` is cut on ``d``."""
    if size.op != "call_function" or size.target is not aten.sym_size.int:
        return None
    tensor, dim = size.args
    spec = rin.spec(tensor)
    nd = rin.ndim(tensor)
    return [p if isinstance(p, Shard) and p.dim % nd == dim % nd else None for p in spec]


def triangle_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``tril`` / ``triu``: which elements of the last two dims survive depends on their global row and
    column, so those dims are whole on every rank; leading dims stay cut. A mask is linear: a Partial
    input stays Partial."""
    x = node.args[0]
    nd = rin.ndim(x)
    spec = tuple(R if isinstance(p, Shard) and p.dim % nd >= nd - 2 else p for p in rin.spec(x))
    return Decision(output=spec, inputs={x: spec})


def no_tensor_output_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """Size queries and metadata assertions read the local tensor; nothing to convert."""
    return Decision(output=None, inputs={})


POINTWISE = (
    "add", "sub", "mul", "div", "pow", "rsub", "maximum", "minimum", "where", "eq", "ne", "lt", "le",
    "gt", "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not",
    "masked_fill", "clamp", "clamp_min", "clamp_max", "remainder", "floor_divide", "neg", "rsqrt",
    "sqrt", "exp", "log", "sin", "cos", "tanh", "sigmoid", "silu", "gelu", "relu", "abs", "reciprocal",
    "erf", "square", "log1p", "expm1", "sign", "softplus", "fill", "addcmul", "__and__", "__or__", "floor", "ceil",
)
COPIES = ("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy", "to", "type_as")
FACTORIES = ("arange", "zeros", "ones", "full", "empty", "scalar_tensor", "new_zeros", "new_ones",
             "new_full", "new_empty")
LIKE = ("zeros_like", "ones_like", "empty_like", "full_like")

for _rule in (pointwise_rule, copy_rule, dropout_rule, like_rule, factory_rule, no_tensor_output_rule):
    interleave_aware(_rule)
for _name in POINTWISE:
    register(getattr(aten, _name), pointwise_rule)
for _name in COPIES:
    register(getattr(aten, _name), copy_rule)
for _name in FACTORIES:
    register(getattr(aten, _name), factory_rule)
for _name in LIKE:
    register(getattr(aten, _name), like_rule)
register(aten.dropout, dropout_rule)
register(aten.tril, triangle_rule)
register(aten.triu, triangle_rule)
for _op in (aten.sym_size, aten.sym_numel, aten.sym_stride, aten._assert_tensor_metadata):
    register(_op, no_tensor_output_rule)
