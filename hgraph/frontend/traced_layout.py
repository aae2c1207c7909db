"""Substitutions keep the layout the traced graph assumed.

torch.export drops a ``.contiguous()`` that is a no-op on the traced value, so a model's
``y.transpose(1, 2).contiguous().view(B, T, C)`` after SDPA (whose output is laid out ``[b, s, h, d]``
in memory) is recorded as ``transpose`` then ``view``: the graph relies on SDPA's strides. A pass that
replaces an op by another (packed attention for SDPA, a fused loss, an expert dispatch) must return
those strides, or the recorded ``view`` fails at run time. ``with_traced_layout`` re-lays the
replacement out as the original was: ``permute -> clone(contiguous) -> permute back``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

aten = torch.ops.aten


def physical_order(value: Any) -> list[int]:
    """The dims of ``value`` from outermost to innermost in memory (``[0, 1, ..]`` when contiguous)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return list(range(getattr(value, "ndim", 0)))
    return list(compute_elementwise_output_logical_to_physical_perm(value)[0])


def with_traced_layout(graph: fx.Graph, new: fx.Node, traced: Any) -> fx.Node:
    """``new`` (a contiguous replacement) laid out in memory as ``traced`` (the replaced node's value)
    was; ``new`` itself where that layout is contiguous. Call inside ``graph.inserting_after(new)``'s
    scope is not needed: nodes are inserted right after ``new``."""
    order = physical_order(traced)
    if order == sorted(order):
        return new
    inverse = [order.index(d) for d in range(len(order))]
    value = new.meta.get("val")
    with graph.inserting_after(new):
        permuted = graph.call_function(aten.permute.default, (new, order))
    with graph.inserting_after(permuted):
        packed = graph.call_function(aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
    with graph.inserting_after(packed):
        back = graph.call_function(aten.permute.default, (packed, inverse))
    if isinstance(value, torch.Tensor):
        permuted.meta = {**new.meta, "val": value.permute(order)}
        packed.meta = {**new.meta, "val": permuted.meta["val"].clone(memory_format=torch.contiguous_format)}
        back.meta = {**new.meta, "val": packed.meta["val"].permute(inverse)}
    return back


__all__ = ["physical_order", "with_traced_layout"]
