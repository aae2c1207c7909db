"""Rules for linear layers and matrix products: Megatron column/row pairing by propagation.

On tp, a linear whose input is replicated becomes *column-parallel* (weight cut on its output
features, output cut on the last dim); one whose input is cut on its last dim becomes *row-parallel*
(weight cut on its input features, output Partial, bias added after the reduction). A *fused*
column-parallel projection — its output only split, chunked or sliced on the last dim (GPT-2
``c_attn``, Phi-3 ``qkv_proj``/``gate_up_proj``) — cuts every block separately
(``InterleavedShard``): each rank holds its heads' q, k and v, and the split is local. A
sequence-parallel input (cut on a token dim) is gathered first. On cp the tokens stay split and the
weights are replicated. ``linear`` weights are ``[out, in]``; ``mm``/``addmm``/``matmul`` weights
(GPT-2's ``Conv1D``) are ``[in, out]``.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import torch
import torch.fx as fx

from hgraph.core.placement import InterleavedShard, Partial, Shard
from hgraph.rules.base import CP, TP, P, R, Decision, LowerContext, RuleInput, Spec, with_placement
from hgraph.rules.registry import register
from hgraph.rules.shape import split_sizes

aten = torch.ops.aten


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def fused_blocks(node: fx.Node, rin: RuleInput) -> Optional[tuple[int, ...]]:
    """Block sizes of a fused projection: every use of ``node``'s last dim (through views that keep
    it) is a split/chunk/slice of that dim, cut at the block boundaries; ``None`` otherwise or when a
    block does not divide over tp."""
    n = rin.shape(node)[-1]
    cuts: set[int] = set()
    frontier = [node]
    while frontier:
        value = frontier.pop()
        nd = rin.ndim(value)
        for user in value.users:
            target, args = user.target, user.args
            if target in _VIEWS and args[0] is value and rin.shape(user)[-1] == n:
                frontier.append(user)
            elif target in _VIEWS and args[0] is value and _packed_count(rin.shape(value), rin.shape(user), rin.degree(TP)):
                k = _packed_count(rin.shape(value), rin.shape(user), rin.degree(TP))
                cuts.update(n // k * i for i in range(1, k))
            elif target in (aten.sym_size.int,):
                continue
            elif target in _SPLITS and args[0] is value and (args[2] if len(args) > 2 else 0) % nd == nd - 1:
                sizes = split_sizes(target, args[1], n)
                if sizes is None:
                    return None
                offset = 0
                for size in sizes[:-1]:
                    offset += size
                    cuts.add(offset)
            elif target is aten.slice.Tensor and args[0] is value and (args[1] if len(args) > 1 else 0) % nd == nd - 1:
                start, end = (args[2] if len(args) > 2 else 0), (args[3] if len(args) > 3 else None)
                step = args[4] if len(args) > 4 else 1
                if step != 1 or not isinstance(start or 0, int) or not isinstance(end if end is not None else 0, int):
                    return None
                cuts.update(min(max(b + n if b < 0 else b, 0), n) for b in (start or 0, n if end is None else end))
            else:
                return None
    bounds = sorted(cuts | {0, n})
    blocks = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if len(blocks) < 2 or any(b % rin.degree(TP) for b in blocks):
        return None
    return blocks


def _packed_count(src: Sequence[int], dst: Sequence[int], degree: int) -> int:
    """``k`` when a view unflattens the last dim into ``(k, n // k, ...)`` with ``k`` not divisible by
    tp (``nn.MultiheadAttention``'s ``(..., 3 * E) -> (..., 3, E)``): ``k`` packed blocks, cut each on
    its own. 0 otherwise (``(..., heads, 3 * head_dim)`` cuts the heads as a plain shard)."""
    lead = len(src) - 1
    if len(dst) < lead + 2 or tuple(dst[:lead]) != tuple(src[:lead]) or math.prod(dst[lead:]) != src[-1]:
        return 0
    k = dst[lead]
    return k if k > 1 and k % degree and (src[-1] // k) % degree == 0 else 0


_FEATURE_PRESERVING = {aten.to.dtype, aten._to_copy.default, aten.pow.Tensor_Scalar, aten.mul.Tensor, aten.add.Tensor,
                       aten.square.default}
_FEATURE_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.rms_norm.default, aten.layer_norm.default)


def latent_projection(node: fx.Node, rin: RuleInput, out_features: int, in_features: int) -> bool:
    """A low-rank down-projection whose features are normalised whole: MLA's ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` (fewer outputs than inputs, the output — or a piece split off its last dim —
    reaching a reduction over its last dim: the RMSNorm of the latent).

    Megatron-Core computes these *duplicated* on every tp rank: cut on its outputs the latent would
    be gathered for its norm and the up-projection after it would be row-parallel (an all-reduce of
    every head's features); whole, the up-projection is column-parallel (heads over tp) and the only
    communication is the backward sum of the latent's gradient.
    """
    if out_features >= in_features:
        return False
    frontier, seen = [node], 0
    while frontier and seen < 32:
        value = frontier.pop()
        seen += 1
        nd = rin.ndim(value) if rin.is_tensor(value) else 0
        for user in value.users:
            target, args = user.target, user.args
            if target in _FEATURE_REDUCTIONS and args[0] is value:
                dims = args[1] if len(args) > 1 else None
                dims = [dims] if isinstance(dims, int) else dims
                if target in (aten.rms_norm.default, aten.layer_norm.default) or (dims and [d % nd for d in dims] == [nd - 1]):
                    return True
            elif target in _SPLITS and args[0] is value and (args[2] if len(args) > 2 else 0) % max(nd, 1) == nd - 1:
                frontier += [u for u in user.users if u.target is operator.getitem]
            elif target in _FEATURE_PRESERVING and rin.is_tensor(user) and rin.shape(user)[-1:] == rin.shape(value)[-1:]:
                frontier.append(user)
    return False


def _weight_decision(
    node: fx.Node, rin: RuleInput, x: fx.Node, w: fx.Node, bias: Optional[fx.Node], transposed: bool
) -> Decision:
    """``transposed``: weight stored ``[out, in]`` (``linear``) rather than ``[in, out]``."""
    k_dim, n_dim = (1, 0) if transposed else (0, 1)
    x_nd, out_nd = rin.ndim(x), rin.ndim(node)
    xs, ws = rin.spec(x), rin.spec(w)
    req_x, req_w, req_b, out = [R, R], [R, R], [R, R], [R, R]
    row_parallel = duplicated = False
    for m in (CP, TP):
        if rin.degree(m) == 1:
            continue
        px = xs[m]
        if isinstance(px, Partial) or (isinstance(px, Shard) and m == CP and px.dim % x_nd == x_nd - 1):
            px = R
        if m == CP:
            req_x[m] = px
            out[m] = px
            continue
        if isinstance(px, Shard) and px.dim % x_nd != x_nd - 1:
            px = R  # sequence-parallel tokens: gathered before the column-parallel product
        pw = None if rin.is_free(w) else ws[m]
        if isinstance(px, Shard) or (isinstance(pw, Shard) and pw.dim % 2 == k_dim):
            req_x[m], req_w[m], out[m] = Shard(x_nd - 1), Shard(k_dim), P
            row_parallel = True
        elif isinstance(pw, InterleavedShard) and pw.dim % 2 == n_dim:
            req_w[m], out[m], req_b[m] = pw, InterleavedShard(out_nd - 1, pw.blocks), InterleavedShard(0, pw.blocks)
        elif pw is None and rin.shape(w)[n_dim] % rin.degree(m):
            continue  # too few output features to cut (a 1-wide gate): computed whole on every rank
        elif pw is None and latent_projection(node, rin, rin.shape(w)[n_dim], rin.shape(w)[k_dim]):
            duplicated = True
            continue  # MLA's low-rank down-projection: computed whole on every rank (Megatron's "duplicated")
        elif pw is None or (isinstance(pw, Shard) and pw.dim % 2 == n_dim):
            blocks = fused_blocks(node, rin) if pw is None else None
            if blocks:
                req_w[m], out[m], req_b[m] = (
                    InterleavedShard(n_dim, blocks), InterleavedShard(out_nd - 1, blocks), InterleavedShard(0, blocks)
                )
            else:
                req_w[m], out[m], req_b[m] = Shard(n_dim), Shard(out_nd - 1), Shard(0)
    inputs: dict[fx.Node, Spec] = {x: (req_x[0], req_x[1]), w: (req_w[0], req_w[1])}
    note = "row-parallel" if row_parallel else "column-parallel" if isinstance(out[TP], Shard) and out[TP].dim == out_nd - 1 else ""
    note = "duplicated low-rank projection" if duplicated else note
    if bias is None:
        return Decision(output=(out[0], out[1]), inputs=inputs, note=note)
    inputs[bias] = (req_b[0], req_b[1])
    if not row_parallel:
        return Decision(output=(out[0], out[1]), inputs=inputs, note=note)
    partial_spec: Spec = (out[0], out[1])
    reduced = with_placement(partial_spec, TP, rin.partial_target(TP, out_nd, rin.shape(node)))

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        lx, lw = lc.local(x), lc.local(w)
        product = lc.call(aten.linear.default, (lx, lw)) if transposed else lc.call(aten.mm.default, (lx, lw))
        product.meta["hgraph_spec"] = partial_spec
        total = lc.redistribute(product, partial_spec, reduced, n.name, n)
        return lc.call(aten.add.Tensor, (total, lc.local(bias)))

    return Decision(
        output=reduced, inputs=inputs, lower=lower, note="row-parallel, bias after the reduction", exact_grad={bias: (TP,)}
    )


def linear_rule(node: fx.Node, rin: RuleInput) -> Decision:
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return _weight_decision(node, rin, x, w, bias, transposed=True)


def addmm_rule(node: fx.Node, rin: RuleInput) -> Decision:
    bias, x, w = node.args[:3]
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        raise rin.error("addmm with beta/alpha other than 1 is not supported")
    if not rin.options.is_param(w) or rin.ndim(bias) != 1:
        return matmul_rule(node, rin, pair=(x, w), extra=bias)
    return _weight_decision(node, rin, x, w, bias, transposed=False)


def _dot_decision(rin: RuleInput, x: fx.Node, y: fx.Node) -> Decision:
    """``matmul`` of two vectors, a 0-d dot product: both cut alike on a mesh dim give a Partial
    result there, anything else is made Replicate (a 0-d output has no dim to shard)."""
    req_x, req_y, out = [R, R], [R, R], [R, R]
    for m in (CP, TP):
        px, py = rin.placement(x, m), rin.placement(y, m)
        if rin.degree(m) > 1 and isinstance(px, Shard) and px == py:
            req_x[m], req_y[m], out[m] = Shard(0), Shard(0), P
    return Decision(output=(out[0], out[1]), inputs={x: (req_x[0], req_x[1]), y: (req_y[0], req_y[1])})


def matmul_rule(
    node: fx.Node, rin: RuleInput, pair: Optional[tuple[fx.Node, fx.Node]] = None, extra: Optional[fx.Node] = None
) -> Decision:
    """mm / bmm / matmul: a 2-d parameter operand makes it a linear layer, else a batched product."""
    x, y = pair or (node.args[0], node.args[1])
    if extra is None and rin.options.is_param(y) and rin.ndim(y) == 2:
        return _weight_decision(node, rin, x, y, None, transposed=False)
    nd = rin.ndim(x)
    if rin.ndim(y) != nd or extra is not None:
        req = {t: (R, R) for t in (x, y, extra) if t is not None}
        return Decision(output=(R, R), inputs=req)
    req_x, req_y, out = [R, R], [R, R], [R, R]
    if nd == 1:
        return _dot_decision(rin, x, y)
    for m in (CP, TP):
        if rin.degree(m) == 1:
            continue
        px, py = (R if isinstance(p, Partial) else p for p in (rin.placement(x, m), rin.placement(y, m)))
        dx = px.dim % nd if isinstance(px, Shard) else None
        dy = py.dim % nd if isinstance(py, Shard) else None
        batch = dx if dx is not None and dx < nd - 2 else dy if dy is not None and dy < nd - 2 else None
        if batch is not None:
            out[m] = Shard(batch)
            # an operand of size 1 there is broadcast: every rank keeps it whole
            req_x[m] = Shard(batch) if rin.shape(x)[batch] != 1 else R
            req_y[m] = Shard(batch) if rin.shape(y)[batch] != 1 else R
        elif dx == nd - 1 and dy == nd - 2:
            req_x[m], req_y[m], out[m] = Shard(nd - 1), Shard(nd - 2), P
        elif dx == nd - 2:
            req_x[m], out[m] = Shard(nd - 2), Shard(nd - 2)
        elif dy == nd - 1:
            req_y[m], out[m] = Shard(nd - 1), Shard(nd - 1)
    return Decision(output=(out[0], out[1]), inputs={x: (req_x[0], req_x[1]), y: (req_y[0], req_y[1])})


def baddbmm_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``beta·input + alpha·(b1 @ b2)`` (Bloom's ALiBi scores): the batched product's split, ``input``
    brought to the product's spec (a pending sum of the product would add ``input`` tp times, so a
    split contraction is refused in favour of replicated operands)."""
    bias, b1, b2 = node.args[:3]
    product = matmul_rule(node, rin, pair=(b1, b2))
    out = list(product.output)
    inputs = dict(product.inputs)
    if any(isinstance(p, Partial) for p in out):
        out = [R, R]
        inputs = {b1: (R, R), b2: (R, R)}
    req = [R, R]
    nd, bias_nd = rin.ndim(node), rin.ndim(bias)
    for m, p in enumerate(out):
        if isinstance(p, Shard):
            d = p.dim % nd - (nd - bias_nd)
            if d >= 0 and rin.shape(bias)[d] != 1:
                req[m] = Shard(d)
    inputs[bias] = (req[0], req[1])
    return Decision(output=(out[0], out[1]), inputs=inputs)


register(aten.linear, linear_rule)
register(aten.baddbmm, baddbmm_rule)
register(aten.addmm, addmm_rule)
for _op in (aten.mm, aten.bmm, aten.matmul):
    register(_op, matmul_rule)
