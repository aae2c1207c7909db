"""Rules for indexed reads and writes along one dim: ``gather``, ``scatter``, ``scatter_add``,
``index_add``, ``slice_scatter``, ``select_scatter``.

MoE routers use them on ``[tokens, experts]`` tables (``scores.gather(1, topk_idx)``,
``group_mask.scatter_(1, group_idx, 1)``, Llama 4's ``full_like(-inf).scatter_(1, idx, top)``), HF's
eager experts add each expert's output back with ``index_add_``, and functionalised writes into
fresh buffers (``hgraph.frontend.functionalize``) become ``slice_scatter`` / ``select_scatter``.

One rule shape covers them all. The *indexed dim* (``dim``) is read or written at data-dependent (or
sliced) positions, so the tensor indexed along it must be whole there: on tp it is gathered first, on
cp (load-balanced token chunks) the op is refused. Every other dim is positional — element ``i`` of
the index, the source and the output sit at element ``i`` of the indexed tensor — so a shard there is
kept when all the operands that share the dim have its full size (they are cut alike). An op linear
in its floating operands (``gather`` in ``x``; ``scatter_add``, ``index_add``, ``slice_scatter``,
``select_scatter`` jointly in ``self`` and ``src``) keeps a Partial value Partial when every such
operand is Partial; anything else is reduced first.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx as fx

from hgraph.core.placement import Partial, Placement, Shard
from hgraph.rules.base import CP, Decision, P, R, RuleInput
from hgraph.rules.mesh import MESH_DIMS
from hgraph.rules.registry import register

aten = torch.ops.aten


def _reads_across(rin: RuleInput, m: int, dim: int, what: str) -> Placement:
    """The placement an operand sharded along the indexed dim must take on mesh dim ``m``."""
    if m == CP:
        raise rin.error(
            f"{what} reads and writes dim {dim} at indexed positions, and context parallelism splits that "
            "dim into load-balanced token chunks; use a strategy without cp for this model"
        )
    return R


def indexed_decision(
    node: fx.Node, rin: RuleInput, dim: int, operands: Sequence[fx.Node], linear: Sequence[fx.Node], what: str
) -> Decision:
    """Decide an op indexed along ``dim`` of its output (see the module docstring).

    ``operands``: tensor inputs with the output's rank, dim ``d`` of each lining up with output dim
    ``d``; ``linear``: the floating operands the op is jointly linear in (empty: never Partial).
    """
    out_shape = rin.shape(node)
    req = {t: [R, R] for t in operands}
    out: list[Placement] = [R, R]
    for m in range(len(MESH_DIMS)):
        if rin.degree(m) == 1:
            continue
        places = {t: rin.placement(t, m) for t in operands}
        if linear and all(isinstance(places[t], Partial) for t in linear) and not any(
            isinstance(p, Shard) for p in places.values()
        ):
            out[m] = P
            for t in linear:
                req[t][m] = P
            continue
        chosen: Optional[int] = None
        for t in operands:
            p = places[t]
            if not isinstance(p, Shard):
                continue
            d = p.dim % rin.ndim(t)
            if d != dim and all(rin.shape(o)[d] == out_shape[d] for o in operands):
                chosen = d
                break
            if m == CP:
                _reads_across(rin, m, dim, what)
        if chosen is None:
            continue
        out[m] = Shard(chosen)
        for t in operands:
            req[t][m] = Shard(chosen)
    return Decision(output=(out[0], out[1]), inputs={t: (r[0], r[1]) for t, r in req.items()})


def _dim(node: fx.Node, rin: RuleInput, position: int, default: int = 0) -> int:
    value = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
    return value % rin.ndim(node.args[0])


def gather_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``gather(x, dim, index)``: ``out[.., i, ..] = x[.., index[.., i, ..], ..]`` along ``dim``.

    The output has the index's shape; x is read whole along ``dim`` (its other dims positional, so
    they are cut only where x and the index have equal sizes), the index may be cut anywhere.
    """
    x, _, index = node.args[:3]
    dim = _dim(node, rin, 1)
    out_shape = rin.shape(node)
    req_x, req_i, out = [R, R], [R, R], [R, R]
    for m in range(len(MESH_DIMS)):
        if rin.degree(m) == 1:
            continue
        px, pi = rin.placement(x, m), rin.placement(index, m)
        if isinstance(pi, Shard) and pi.dim % len(out_shape) == dim:
            if m == CP:
                _reads_across(rin, m, dim, "gather")
            req_i[m], out[m] = Shard(dim), Shard(dim)  # x stays whole: every rank reads any position
            continue
        shard = pi if isinstance(pi, Shard) else px if isinstance(px, Shard) else None
        if shard is not None:
            d = shard.dim % len(out_shape)
            if d == dim:  # x cut along the indexed dim: whole first
                _reads_across(rin, m, dim, "gather")
            elif len(rin.shape(x)) == len(out_shape) and rin.shape(x)[d] == out_shape[d]:  # (a 0-d x: whole)
                req_x[m] = req_i[m] = out[m] = Shard(d)
                continue
        if isinstance(px, Partial):
            req_x[m], out[m] = P, P  # gather is linear in x
    return Decision(output=(out[0], out[1]), inputs={x: (req_x[0], req_x[1]), index: (req_i[0], req_i[1])})


def scatter_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``scatter(self, dim, index, src|value[, reduce])`` and ``scatter_add(self, dim, index, src)``.

    Writes land at indexed positions of ``dim`` of ``self``, so ``self`` is whole there; the other
    dims are positional. ``scatter_add`` is linear in (self, src); overwriting ``scatter`` is not
    kept Partial (duplicate indices may pick either rank's term).
    """
    this, _, index = node.args[:3]
    src = node.args[3] if len(node.args) > 3 and isinstance(node.args[3], fx.Node) else None
    dim = _dim(node, rin, 1)
    operands = [this, index] + ([src] if src is not None else [])
    adds = node.target.overloadpacket is aten.scatter_add
    linear = [this, src] if adds and src is not None else []
    return indexed_decision(node, rin, dim, operands, linear, node.target.overloadpacket.__name__)


def index_add_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``index_add(self, dim, index, source, alpha)``: ``self[.., index[i], ..] += alpha · source[.., i, ..]``.

    ``self`` is whole along ``dim``; the index (1-d, over ``source``'s ``dim``) and the source are then
    whole there too; the other dims of ``self`` and ``source`` are positional. Linear in (self, source).
    """
    this, _, index, source = node.args[:4]
    dim = _dim(node, rin, 1)
    decision = indexed_decision(node, rin, dim, [this, source], [this, source], "index_add")
    inputs = dict(decision.inputs)
    inputs[index] = (R, R)
    return Decision(output=decision.output, inputs=inputs)


def slice_scatter_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``slice_scatter(base, src, dim, start, end, step)`` / ``select_scatter(base, src, dim, index)``:
    ``base`` with a slice (an index) of ``dim`` replaced by ``src``. ``dim`` is whole; the other dims
    are positional (``select_scatter``'s ``src`` lacks ``dim``). Linear in (base, src)."""
    base, src = node.args[:2]
    nd = rin.ndim(base)
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    selects = node.target.overloadpacket is aten.select_scatter
    out_shape = rin.shape(node)
    req_b, req_s, out = [R, R], [R, R], [R, R]

    def src_dim(d: int) -> Optional[int]:
        return None if d == dim and selects else d - (selects and d > dim)

    for m in range(len(MESH_DIMS)):
        if rin.degree(m) == 1:
            continue
        pb, ps = rin.placement(base, m), rin.placement(src, m)
        if isinstance(pb, Partial) and isinstance(ps, Partial):
            req_b[m], req_s[m], out[m] = P, P, P
            continue
        chosen = None
        if isinstance(pb, Shard):
            chosen = pb.dim % nd
        elif isinstance(ps, Shard):
            chosen = next((d for d in range(nd) if src_dim(d) == ps.dim % rin.ndim(src)), None)
        if chosen is None:
            continue
        sd = src_dim(chosen)
        if chosen == dim or sd is None or rin.shape(src)[sd] != out_shape[chosen]:
            if m == CP:
                _reads_across(rin, m, dim, node.target.overloadpacket.__name__)
            continue
        req_b[m], req_s[m], out[m] = Shard(chosen), Shard(sd), Shard(chosen)
    return Decision(output=(out[0], out[1]), inputs={base: (req_b[0], req_b[1]), src: (req_s[0], req_s[1])})


register(aten.gather, gather_rule)
register(aten.scatter, scatter_rule)
register(aten.scatter_add, scatter_rule)
register(aten.index_add, index_add_rule)
register(aten.slice_scatter, slice_scatter_rule)
register(aten.select_scatter, slice_scatter_rule)
