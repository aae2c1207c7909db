"""Rules for views, reshapes, transposes, slicing, split and cat.

A reshape keeps a shard when the sharded input dim leads its group of merged/split dims: the shard
then lands on the leading output dim of the group (an attention projection ``[b, s, h*d]`` cut on
``h*d`` becomes ``[b, s, h, d]`` cut on ``h``). Constant sizes in the shape argument at a sharded output
dim are divided by the degree (``view(x, [b, s, 4, 16])`` -> ``[b, s, 2, 16]`` at tp=2); symbolic sizes
come from ``sym_size`` of local tensors and are local already. Anything a local op cannot compute —
slicing or splitting across a sharded dim, merging a tp-sharded inner dim — asks for the input
replicated on that mesh dim, so ``localize`` gathers it first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from hgraph.core.placement import InterleavedShard, Partial, Placement, Shard, StridedShard
from hgraph.rules.base import CP, Decision, interleave_aware, P, R, RuleInput, shard_degrees, TP, wrap_dim
from hgraph.rules.mesh import MESH_DIMS
from hgraph.rules.registry import register

aten = torch.ops.aten
Group = tuple[tuple[int, ...], tuple[int, ...]]


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[Group]:
    """Pair up runs of input and output dims with equal products (the finest such grouping).

    Size-1 dims that appear on one side only form groups of their own.
    """
    groups: list[Group] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(((), (j,)))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            raise ValueError(f"shapes {tuple(src)} and {tuple(dst)} have different numbers of elements")
        gi, gj, a, b = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(src):
                gi.append(i)
                a *= src[i]
                i += 1
            elif b < a and j < len(dst):
                gj.append(j)
                b *= dst[j]
                j += 1
            else:
                raise ValueError(f"shapes {tuple(src)} and {tuple(dst)} have different numbers of elements")
        groups.append((tuple(gi), tuple(gj)))
    return groups


def _view_placement(
    p: Shard, src: Sequence[int], dst: Sequence[int], groups: list[Group], m: int, rin: RuleInput
) -> Optional[Placement]:
    """Where shard ``p`` of ``src`` lands in ``dst``; ``None`` when the input must be gathered."""
    degree = rin.degree(m)
    d = p.dim % len(src)
    gi, gj = next(g for g in groups if d in g[0])
    targets = [j for j in gj if dst[j] != 1]
    if not targets:
        return None
    if isinstance(p, InterleavedShard):  # blocks survive a view where the dim stays whole ...
        if len(gi) == 1 and targets == list(gj) == [targets[0]]:
            return dataclasses.replace(p, dim=targets[0])
        return _blocks_unflattened(p, dst, gi, targets, degree)
    if isinstance(p, StridedShard):
        if len(gi) != 1:
            return None
        if len(targets) == 1:
            return dataclasses.replace(p, dim=targets[0])
        prod = 1
        for j in targets:
            if prod == p.split_factor:
                return Shard(j) if dst[j] % degree == 0 else None
            prod *= dst[j]
        return None
    leading = [i for i in gi if i < d and src[i] != 1]
    if not leading:
        e = targets[0]
        if m == CP and len(targets) > 1 and dst[e] % (2 * degree):
            return None  # cp tokens are in 2·cp load-balanced chunks: the leading dim must hold them
        if dst[e] % degree:
            if len(targets) > 1 and degree % dst[e]:
                raise rin.error(
                    f"view {tuple(src)} -> {tuple(dst)} would cut dim {e} of size {dst[e]} {degree} ways "
                    f"over '{MESH_DIMS[m]}', but {dst[e]} is not divisible by {degree}; when this is the "
                    f"number of attention (or key/value) heads, use a {MESH_DIMS[m]} degree dividing {dst[e]}"
                )
            return None
        return Shard(e)
    if len(targets) != 1 or src[d] % degree:
        return None
    return StridedShard(targets[0], math.prod(src[i] for i in leading))


def _blocks_unflattened(p: InterleavedShard, dst: Sequence[int], gi: Sequence[int], targets: Sequence[int],
                        degree: int) -> Optional[Placement]:
    """... and where it is unflattened into (blocks, block): ``nn.MultiheadAttention``'s packed q/k/v,
    ``(..., 3 * E) -> (..., 3, E)``. Each rank holds its chunk of every block, so the view keeps the
    blocks dim whole and cuts the dim after it (the block's first non-1 dim)."""
    if len(gi) != 1 or len(targets) < 2 or dst[targets[0]] != len(p.blocks) or len(set(p.blocks)) != 1:
        return None
    inner = targets[1]
    return Shard(inner) if dst[inner] % degree == 0 and math.prod(dst[j] for j in targets[1:]) == p.blocks[0] else None


def _rewrite_sizes(sizes: Sequence, first_dim: int, cuts: Sequence[int], rin: RuleInput) -> list:
    """Size arguments for output dims ``first_dim + k``, each cut ``cuts[first_dim + k]`` ways."""
    return [rin.local_size_arg(size, cuts[first_dim + k]) for k, size in enumerate(sizes)]


def reshape_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """view / reshape / _unsafe_view / flatten / unflatten / expand-free reshapes."""
    x = node.args[0]
    src, dst = rin.shape(x), rin.shape(node)
    try:
        groups = view_groups(src, dst)
    except ValueError as exc:
        raise rin.error(str(exc)) from None
    spec = rin.spec(x)
    req, out = list(spec), [R, R]
    for m, p in enumerate(spec):
        if isinstance(p, Partial):
            out[m] = P
        elif isinstance(p, Shard):
            q = _view_placement(p, src, dst, groups, m, rin)
            if q is None:
                req[m] = R
            else:
                out[m] = q
    tp_strided = isinstance(out[TP], StridedShard)
    if tp_strided and isinstance(out[CP], Shard) and out[CP].dim == out[TP].dim:
        req[TP], out[TP] = R, R  # both cuts in one merged dim: the tp stride would depend on the cp cut
    cuts = shard_degrees((out[0], out[1]), rin.options.degrees, len(dst))
    args = list(node.args)
    target = node.target
    if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        args[1] = _rewrite_sizes(args[1], 0, cuts, rin)
    elif target is aten.unflatten.int:
        dim = args[1] % len(src)
        args[2] = _rewrite_sizes(args[2], dim, cuts, rin)
    inputs = {x: (req[0], req[1])}
    if target is aten.view_as.default:
        inputs[args[1]] = (out[0], out[1])  # the local shape reference must be cut like the output
    return Decision(output=(out[0], out[1]), inputs=inputs, args=tuple(args))


def expand_rule(node: fx.Node, rin: RuleInput) -> Decision:
    x = node.args[0]
    in_ndim, out_ndim = rin.ndim(x), rin.ndim(node)
    spec = rin.spec(x)
    out = [dataclasses.replace(p, dim=p.dim % in_ndim + out_ndim - in_ndim) if isinstance(p, Shard) else p for p in spec]
    cuts = shard_degrees((out[0], out[1]), rin.options.degrees, out_ndim)
    args = list(node.args)
    args[1] = _rewrite_sizes(args[1], 0, cuts, rin)
    return Decision(output=(out[0], out[1]), inputs={x: spec}, args=tuple(args))


def _dim_map_rule(node: fx.Node, rin: RuleInput, new_dim: Callable[[int], Optional[int]]) -> Decision:
    """Ops that move dims around: ``new_dim(d)`` is where input dim ``d`` goes (``None``: removed)."""
    x = node.args[0]
    spec = rin.spec(x)
    req, out = list(spec), [R, R]
    for m, p in enumerate(spec):
        if isinstance(p, Partial):
            out[m] = P
        elif isinstance(p, Shard):
            e = new_dim(p.dim % rin.ndim(x))
            if e is None:
                req[m] = R
            else:
                out[m] = dataclasses.replace(p, dim=e)
    return Decision(output=(out[0], out[1]), inputs={x: (req[0], req[1])})


def transpose_rule(node: fx.Node, rin: RuleInput) -> Decision:
    ndim = rin.ndim(node.args[0])
    if node.target is aten.t.default:
        a, b = 0, min(1, ndim - 1)
    else:
        a, b = node.args[1] % ndim, node.args[2] % ndim
    return _dim_map_rule(node, rin, lambda d: b if d == a else a if d == b else d)


def permute_rule(node: fx.Node, rin: RuleInput) -> Decision:
    ndim = rin.ndim(node.args[0])
    perm = [d % ndim for d in node.args[1]]
    return _dim_map_rule(node, rin, perm.index)


def unsqueeze_rule(node: fx.Node, rin: RuleInput) -> Decision:
    dim = node.args[1] % (rin.ndim(node.args[0]) + 1)
    return _dim_map_rule(node, rin, lambda d: d + 1 if d >= dim else d)


def squeeze_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """The dims to drop are read from the global shape and named explicitly in the local op
    (``squeeze.dims``): a cut dim whose local piece has size 1 must stay."""
    x = node.args[0]
    shape = rin.shape(x)
    if len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        gone = {wrap_dim(d, len(shape)) for d in dims if shape and shape[wrap_dim(d, len(shape))] == 1}
    else:
        gone = {d for d, s in enumerate(shape) if s == 1}
    decision = _dim_map_rule(node, rin, lambda d: None if d in gone else d - sum(g < d for g in gone))
    if shape:
        decision.target, decision.args, decision.kwargs = aten.squeeze.dims, (x, sorted(gone)), {}
    return decision


def slice_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """A slice along a sharded dim needs the whole dim, unless it keeps every element."""
    x = node.args[0]
    ndim = rin.ndim(x)
    dim = (node.args[1] if len(node.args) > 1 else 0) % ndim
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    size = rin.shape(x)[dim]
    full = start in (None, 0) and step == 1 and (end is None or (isinstance(end, int) and end >= size))
    p = rin.spec(x)[TP]
    if isinstance(p, InterleavedShard) and p.dim % ndim == dim and not full and step == 1:
        ints = [b for b in (start or 0, size if end is None else end) if isinstance(b, int)]
        lo, hi = (min(max(b + size if b < 0 else b, 0), size) for b in ints) if len(ints) == 2 else (0, 0)
        pieces = interleaved_pieces(p, [(lo, hi)]) if len(ints) == 2 else None
        if pieces is not None:
            out = _dim_map_rule(node, rin, lambda d: d).output
            degree = rin.degree(TP)
            return Decision(
                output=(out[0], pieces[0]), inputs={x: rin.spec(x)},
                args=(x, dim, lo // degree, hi // degree), note="fused projection sliced locally",
            )
    return _dim_map_rule(node, rin, lambda d: d if (d != dim or full) else None)


def select_rule(node: fx.Node, rin: RuleInput) -> Decision:
    dim = node.args[1] % rin.ndim(node.args[0])
    return _dim_map_rule(node, rin, lambda d: None if d == dim else d - (d > dim))


def split_sizes(target: object, arg: object, n: int) -> Optional[list[int]]:
    """Piece sizes of ``split``/``chunk``/``split_with_sizes`` of ``n`` elements (``None``: symbolic)."""
    if target is aten.split_with_sizes.default:
        return list(arg) if all(isinstance(a, int) for a in arg) else None  # type: ignore[union-attr]
    if not isinstance(arg, int):
        return None
    size = -(-n // arg) if target is aten.chunk.default else arg
    return [min(size, n - o) for o in range(0, n, size)]


def interleaved_pieces(p: InterleavedShard, bounds: Sequence[tuple[int, int]]) -> Optional[list[Placement]]:
    """Placements of the ``[start, stop)`` pieces of an interleaved dim; ``None`` unless each piece
    is whole blocks (then a single block is a plain ``Shard``, several an ``InterleavedShard``)."""
    edges = [0]
    for b in p.blocks:
        edges.append(edges[-1] + b)
    out: list[Placement] = []
    for start, stop in bounds:
        if start not in edges or stop not in edges or stop <= start:
            return None
        inner = p.blocks[edges.index(start) : edges.index(stop)]
        out.append(Shard(p.dim) if len(inner) == 1 else InterleavedShard(p.dim, inner))
    return out


def split_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """split / split_with_sizes / chunk / unbind: local when the split dim is not sharded, or when it
    is an interleaved dim split at block boundaries (a fused projection: q, k, v stay on the rank)."""
    x = node.args[0]
    ndim = rin.ndim(x)
    removes = node.target is aten.unbind.int
    position = 1 if removes else 2
    dim = (node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)) % ndim
    count = len(node.meta["val"])
    p = rin.spec(x)[TP]
    if isinstance(p, InterleavedShard) and p.dim % ndim == dim and not removes:
        sizes = split_sizes(node.target, node.args[1], rin.shape(x)[dim])
        bounds = list(itertools.accumulate([0] + (sizes or [])))
        pieces = interleaved_pieces(p, list(zip(bounds, bounds[1:]))) if sizes else None
        if pieces is not None:
            others = _dim_map_rule(node, rin, lambda d: d).output
            degree = rin.degree(TP)
            return Decision(
                output=tuple((others[0], q) for q in pieces),
                inputs={x: rin.spec(x)},
                target=aten.split_with_sizes.default,
                args=(x, [size // degree for size in sizes], dim),  # type: ignore[union-attr]
                kwargs={},
                note="fused projection split locally",
            )
    single = _dim_map_rule(node, rin, lambda d: None if d == dim else d - (removes and d > dim))
    return Decision(output=tuple(single.output for _ in range(count)), inputs=single.inputs)


def getitem_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``operator.getitem`` on a list-returning op picks that output's spec."""
    source, index = node.args
    specs = rin.specs_of(source)
    if not isinstance(specs, tuple) or not specs or not isinstance(specs[0], tuple):
        raise rin.error(f"getitem of {source.name}, which has no list of specs ({specs})")
    return Decision(output=specs[index], inputs={})


def _joined_blocks(tensors: list[fx.Node], places: list[Placement], dim: int, rin: RuleInput) -> Optional[tuple[int, ...]]:
    """Blocks of ``cat`` along ``dim`` of tp-cut inputs (an input that is itself blocks adds its own)."""
    blocks: list[int] = []
    for t, p in zip(tensors, places):
        blocks += list(p.blocks) if isinstance(p, InterleavedShard) else [rin.shape(t)[dim]]
    if len(blocks) < 2 or any(b % rin.degree(TP) for b in blocks) or isinstance(places[0], StridedShard):
        return None
    return tuple(blocks)


def cat_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """cat / stack: inputs share one spec; a shard along the joined dim needs the whole dim — except
    that ``cat`` of tp-cut pieces along their cut dim is the blocks of a fused value
    (``InterleavedShard``: Gated DeltaNet's ``cat(q, k, v)`` before its convolution), kept local."""
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
    out_ndim = rin.ndim(node)
    in_ndim = rin.ndim(tensors[0])
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out_ndim
    stacking = node.target.overloadpacket is aten.stack
    out, req = [R, R], {t: [R, R] for t in tensors}
    for m in range(len(MESH_DIMS)):
        if rin.degree(m) == 1:
            continue
        places = [rin.placement(t, m) for t in tensors]
        if all(isinstance(p, Partial) for p in places):
            out[m] = P
            for t in tensors:
                req[t][m] = P
            continue
        shards = [p for p in places if isinstance(p, Shard)]
        if not shards:
            continue
        if not stacking and m == TP and all(isinstance(p, Shard) and p.dim % in_ndim == dim for p in places):
            blocks = _joined_blocks(tensors, places, dim, rin)
            if blocks is not None:  # each rank's pieces side by side: the blocks of a fused value
                out[m] = InterleavedShard(dim, blocks)
                for t, p in zip(tensors, places):
                    req[t][m] = p
                continue
        if any((p.dim % in_ndim) == dim and not stacking for p in shards):
            continue
        chosen = shards[0]
        d_in = chosen.dim % in_ndim
        out[m] = dataclasses.replace(chosen, dim=d_in + (stacking and d_in >= dim))
        for t in tensors:
            req[t][m] = dataclasses.replace(chosen, dim=d_in)
    return Decision(output=(out[0], out[1]), inputs={t: (r[0], r[1]) for t, r in req.items()})


for _rule in (reshape_rule, expand_rule, transpose_rule, permute_rule, unsqueeze_rule, squeeze_rule, slice_rule,
              select_rule, split_rule, getitem_rule, cat_rule):
    interleave_aware(_rule)
for _op in (aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.view_as):
    register(_op, reshape_rule)
register(aten.expand, expand_rule)
for _op in (aten.transpose, aten.t):
    register(_op, transpose_rule)
register(aten.permute, permute_rule)
register(aten.unsqueeze, unsqueeze_rule)
register(aten.squeeze, squeeze_rule)
register(aten.slice, slice_rule)
register(aten.select, select_rule)
for _op in (aten.split, aten.split_with_sizes, aten.chunk, aten.unbind):
    register(_op, split_rule)
register(operator.getitem, getitem_rule)
for _op in (aten.cat, aten.concat, aten.stack):
    register(_op, cat_rule)
