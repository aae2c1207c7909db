"""Inline the regions ``torch.export`` wraps in higher-order ops: ``with torch.no_grad()`` and
``with torch.autocast(..., enabled=False)`` blocks.

In its training IR, export keeps such a block as one call of a higher-order op on a sub-graph
(``wrap_with_set_grad_enabled(False, submod, *args)``, ``wrap_with_autocast(device, dtype, enabled,
cache, submod, *args)``) whose results are read with ``getitem``. HF models use them in MoE routers
and experts (the expert mask under ``no_grad``) and around rotary tables (autocast off). A sharding
rule cannot place an opaque sub-graph, so ``inline_grad_regions`` copies each body into the graph:

* ``set_grad_enabled(False)``: the body's floating results are ``detach``-ed, so no gradient flows
  through them, exactly as in the block;
* ``autocast(enabled=False)``: hgraph programs never run under autocast (``compute_dtype`` casts the
  parameters instead), so the block computes what the body says; an autocast block that is
  *enabled* would change the dtypes of its matmuls and is refused (``TraceError`` naming the module).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from hgraph.errors import TraceError

aten = torch.ops.aten
_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


def _module(node: fx.Node) -> str:
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    return f" in module '{stack[-1][0].removeprefix('model.')}' ({stack[-1][1].rsplit('.', 1)[-1]})" if stack else ""


def inline_grad_regions(gm: fx.GraphModule) -> int:
    """Inline every no-grad / autocast-off region of ``gm`` (recursively); returns how many."""
    count = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (_SET_GRAD, _AUTOCAST):
            continue
        if node.target is _SET_GRAD:
            grad_enabled, body_node, args = node.args[0], node.args[1], node.args[2:]
        else:
            enabled, body_node, args = node.args[2], node.args[4], node.args[5:]
            if enabled:
                raise TraceError(
                    f"an enabled torch.autocast region{_module(node)} runs its ops in {node.args[1]}; hgraph "
                    "programs do not run under autocast: remove the autocast block and pass "
                    "compute_dtype=... to hgraph.compile instead"
                )
            grad_enabled = True
        body = getattr(gm, body_node.target)
        inline_grad_regions(body)  # nested regions first
        outputs = _copy_body(graph, node, body, args, detach=not grad_enabled)
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
        if node.users:
            raise TraceError(f"a region{_module(node)} has results read other than by index; cannot inline it")
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def _copy_body(graph: fx.Graph, call: fx.Node, body: fx.GraphModule, args: tuple, detach: bool) -> list[Any]:
    """Copy ``body``'s nodes before ``call`` with its placeholders bound to ``args``; its results."""
    env: dict[fx.Node, Any] = {}
    placeholders = iter(args)
    results: list[Any] = []
    with graph.inserting_before(call):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                results = list(fx.node.map_arg(inner.args[0], lambda n: env[n]))
            elif inner.op == "get_attr":
                raise TraceError(f"a region{_module(call)} reads a constant of its own; cannot inline it")
            else:
                copied = graph.node_copy(inner, lambda n: env[n])
                copied.meta = {**call.meta, **inner.meta}
                env[inner] = copied
        if detach:
            results = [_detached(graph, r) for r in results]
    return results


def _detached(graph: fx.Graph, value: Any) -> Any:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)):
        return value
    out = graph.call_function(aten.detach.default, (value,))
    out.meta = dict(value.meta)
    return out


__all__ = ["inline_grad_regions"]
