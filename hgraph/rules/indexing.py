"""Rules for ops that read along a dim: ``diff``, ``cumsum``, ``cumprod``, ``repeat``, ``repeat_interleave``,
``index.Tensor``, ``numpy_T``.

HuggingFace models use them on small replicated tensors (position ids when detecting packed
sequences, ALiBi slopes, rotary tables, interleaved rotary frequencies), but a rule must be right for
every spec. A dim the op reads across (``diff`` along its dim, tiling by ``repeat``, the dims an
advanced index selects from) must be whole: on tp the input is gathered first; on cp the op is
refused, naming it (every cp rank would hold and compute the whole sequence). Every other dim keeps its shard. ``repeat_interleave`` keeps a shard of its
own dim (each element's copies stay next to it), and ``index.Tensor`` with a sharded index (a table
looked up by cp-split position ids) is sharded like the index; a bool mask index is made whole.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from hgraph.core.placement import Partial, Placement, Shard
from hgraph.rules.base import CP, Decision, P, R, RuleInput, Spec
from hgraph.rules.mesh import MESH_DIMS
from hgraph.rules.registry import register

aten = torch.ops.aten


def _spec(placements: list[Placement]) -> Spec:
    return (placements[0], placements[1])


def _whole(rin: RuleInput, m: int, dim: int, what: str) -> Placement:
    """What an input sharded on ``dim`` (which the op reads across) must become on mesh dim ``m``."""
    if m == CP:
        raise rin.error(
            f"{what} reads across dim {dim}, which context parallelism splits into load-balanced token "
            "chunks; use a strategy without cp for this model"
        )
    return R


def _moving(
    node: fx.Node, rin: RuleInput, x: fx.Node, new_dim, what: str, keep_partial: bool = True
) -> tuple[list[Placement], list[Placement]]:
    """Per mesh dim (output placement, required input placement); ``new_dim(d)``: output dim of input
    dim ``d``, or ``None`` when the op reads across ``d``."""
    out, req = [R, R], list(rin.spec(x))
    for m in range(len(MESH_DIMS)):
        p = req[m]
        if isinstance(p, Partial):
            if keep_partial:
                out[m] = P
            else:
                req[m] = R
        elif isinstance(p, Shard):
            d = p.dim % rin.ndim(x)
            e = new_dim(d)
            if e is None:
                req[m] = _whole(rin, m, d, what)
            else:
                out[m] = dataclasses.replace(p, dim=e)
    return out, req


def diff_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``diff(x, n, dim, prepend, append)``: differences along ``dim``; prepend/append share x's spec."""
    x = node.args[0]
    ndim = rin.ndim(x)
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) % ndim
    out, req = _moving(node, rin, x, lambda d: None if d == dim else d, "diff")
    inputs = {x: _spec(req)}
    for extra in [*node.args[3:5], node.kwargs.get("prepend"), node.kwargs.get("append")]:
        if isinstance(extra, fx.Node):
            inputs[extra] = _spec(req)
    return Decision(output=_spec(out), inputs=inputs)


def cumsum_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``cumsum(x, dim)`` / ``cumprod(x, dim)``: a running sum (product) along ``dim``, which must be
    whole (along the sequence that means no cp: each rank would need every earlier chunk's total)."""
    x = node.args[0]
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs["dim"]) % rin.ndim(x)
    what = node.target.overloadpacket.__name__
    out, req = _moving(node, rin, x, lambda d: None if d == dim else d, what, keep_partial=what == "cumsum")
    return Decision(output=_spec(out), inputs={x: _spec(req)})


def repeat_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``repeat(x, repeats)``: a dim repeated more than once is tiled, so it must be whole."""
    x, repeats = node.args[0], list(node.args[1])
    lead = len(repeats) - rin.ndim(x)

    def new_dim(d: int) -> Optional[int]:
        return d + lead if repeats[d + lead] == 1 else None

    out, req = _moving(node, rin, x, new_dim, "repeat")
    return Decision(output=_spec(out), inputs={x: _spec(req)})


def repeat_interleave_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``repeat_interleave(x, r, dim)``: each element's copies stay together, so a tp shard of ``dim``
    stays a shard (its size scales by r); without ``dim`` the input is flattened and must be whole."""
    x = node.args[0]
    ndim = rin.ndim(x)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        out, req = _moving(node, rin, x, lambda d: None, "repeat_interleave without dim")
        return Decision(output=_spec(out), inputs={x: _spec(req)})
    dim %= ndim
    spec = rin.spec(x)
    if isinstance(spec[CP], Shard) and spec[CP].dim % ndim == dim:
        _whole(rin, CP, dim, "repeat_interleave")
    out, req = _moving(node, rin, x, lambda d: d, "repeat_interleave")
    kwargs = {k: v for k, v in node.kwargs.items() if k != "output_size"}  # a global size; local differs
    args = node.args[:3]
    return Decision(output=_spec(out), inputs={x: _spec(req)}, args=args, kwargs=kwargs)


def numpy_t_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``x.T``: all dims reversed."""
    x = node.args[0]
    ndim = rin.ndim(x)
    out, req = _moving(node, rin, x, lambda d: ndim - 1 - d, "numpy_T")
    return Decision(output=_spec(out), inputs={x: _spec(req)})


def _is_mask(index: fx.Node) -> bool:
    """A bool (or legacy uint8) index: a mask over as many dims of x as it has, not positions."""
    val = index.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in (torch.bool, torch.uint8)


def index_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``x[i0, i1, ...]`` (advanced indexing, ``None`` entries keep their dim).

    The result has the broadcast dims of the indices in place of the indexed dims when those are
    adjacent, else in front of the kept dims. Per mesh dim: a sharded index (a table looked up by
    cp-split position ids) shards the result like the index and needs x replicated; else a shard of
    a kept dim of x moves with it, a shard of an indexed dim needs x whole, a Partial x stays Partial
    (indexing is linear). A mask (bool index) covers as many dims of x as it has and selects a
    data-dependent count of elements: it is made whole, and so are the other indices beside it.
    """
    x, indices = node.args[0], list(node.args[1])
    ndim = rin.ndim(x)
    tensors = [i for i in indices if isinstance(i, fx.Node)]
    masked = any(_is_mask(t) for t in tensors)
    indexed, d = [], 0
    for i in indices:
        covers = rin.ndim(i) if isinstance(i, fx.Node) and _is_mask(i) else 1
        if i is not None:
            indexed += range(d, d + covers)
        d += covers
    index_ndim = rin.ndim(node) - (ndim - len(indexed))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    start = indexed[0] if adjacent else 0
    kept = [d for d in range(ndim) if d not in indexed]

    def new_dim(d: int) -> Optional[int]:
        if d in indexed:
            return None
        if not adjacent:
            return index_ndim + kept.index(d)
        return d if d < start else d - len(indexed) + index_ndim

    out, req = _moving(node, rin, x, new_dim, "advanced indexing")
    req_index: list[list[Placement]] = [[R, R] for _ in tensors]
    for m in range(len(MESH_DIMS)):
        shards = [rin.spec(t)[m] for t in tensors if isinstance(rin.spec(t)[m], Shard)]
        if not shards or masked:
            continue
        owner = next(t for t in tensors if isinstance(rin.spec(t)[m], Shard))
        aligned = shards[0].dim % rin.ndim(owner) + index_ndim - rin.ndim(owner)
        out[m] = dataclasses.replace(shards[0], dim=start + aligned)
        placement = rin.spec(x)[m]
        if isinstance(placement, Shard):
            _whole(rin, m, placement.dim % ndim, "advanced indexing by a sharded index")
        req[m] = R
        for j, t in enumerate(tensors):
            d = aligned - (index_ndim - rin.ndim(t))
            if d >= 0 and rin.shape(t)[d] != 1:
                req_index[j][m] = dataclasses.replace(shards[0], dim=d)
    inputs = {x: _spec(req)}
    for t, r in zip(tensors, req_index):
        inputs[t] = _spec(r)
    return Decision(output=_spec(out), inputs=inputs)


register(aten.diff, diff_rule)
register(aten.cumsum, cumsum_rule)
register(aten.cumprod, cumsum_rule)
register(aten.repeat, repeat_rule)
register(aten.repeat_interleave.self_int, repeat_interleave_rule)
register(aten.numpy_T, numpy_t_rule)
register(aten.index.Tensor, index_rule)
