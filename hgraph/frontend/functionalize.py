"""Functional form of in-place writes into tensors the model just created.

Models fill fresh buffers in place: DeepSeek's MLA builds its keys as
``k = q.new_empty(...); k[..., :n].copy_(k_nope); k[..., n:].copy_(k_rot)``, routers mark chosen
groups with ``mask = zeros_like(scores); mask.scatter_(1, idx, 1)``, Llama 4 writes top-k scores into
``full_like(logits, -inf).scatter_(...)``. A sharding rule cannot place an in-place write (the
converted copy of a buffer is not the buffer), so ``functionalize_fresh_writes`` rewrites each such
write as the value it produces, the way torch's functionalisation does::

    v = slice(base, d, a, b); v.copy_(src)    ->  base1 = slice_scatter(base, src, d, a, b)
    base.scatter_(d, idx, 1)                  ->  base1 = scatter(base, d, idx, 1)

and every later reader of ``base`` (or of a view of it) reads ``base1`` (the view rebuilt on it).
Readers before the write keep ``base``. Only bases that alias nothing else are rewritten: computed
tensors (``new_empty``, ``zeros_like``, the result of an op), never inputs, parameters or buffers;
a base that also reaches a reader through an op that may or may not alias (``reshape``,
``contiguous``) is left alone, and the in-place op then meets no sharding rule and is named.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Optional

import torch
from torch import fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten

# view op -> how a new value of the view is written back into the viewed tensor
_SCATTERS: dict[Any, Callable[[fx.Graph, fx.Node, fx.Node, fx.Node], fx.Node]] = {}
_MAY_ALIAS = {aten.reshape.default, aten.contiguous.default, aten.flatten.using_ints, aten.to.dtype,
              aten.to.dtype_layout, aten.to.device, aten.to.other}


def _scatter(*targets: Any) -> Callable:
    def register(fn: Callable) -> Callable:
        for t in targets:
            _SCATTERS[t] = fn
        return fn
    return register


@_scatter(aten.slice.Tensor)
def _slice_back(graph: fx.Graph, view: fx.Node, base: fx.Node, value: fx.Node) -> fx.Node:
    args = list(view.args[1:]) + [None, 0, None, 1][len(view.args) - 1:]
    dim, start, end, step = args[:4]
    return graph.call_function(aten.slice_scatter.default, (base, value, dim, start, end, step))


@_scatter(aten.select.int)
def _select_back(graph: fx.Graph, view: fx.Node, base: fx.Node, value: fx.Node) -> fx.Node:
    return graph.call_function(aten.select_scatter.default, (base, value, *view.args[1:3]))


@_scatter(aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.squeeze.default, aten.unflatten.int, aten.alias.default, aten.detach.default)
def _reshape_back(graph: fx.Graph, view: fx.Node, base: fx.Node, value: fx.Node) -> fx.Node:
    """Views that keep the row-major order of the elements: the new value viewed as the base."""
    return graph.call_function(aten.view_as.default, (value, base))


@_scatter(aten.transpose.int)
def _transpose_back(graph: fx.Graph, view: fx.Node, base: fx.Node, value: fx.Node) -> fx.Node:
    return graph.call_function(aten.transpose.int, (value, *view.args[1:3]))


@_scatter(aten.t.default)
def _t_back(graph: fx.Graph, view: fx.Node, base: fx.Node, value: fx.Node) -> fx.Node:
    return graph.call_function(aten.t.default, (value,))


@_scatter(aten.permute.default)
def _permute_back(graph: fx.Graph, view: fx.Node, base: fx.Node, value: fx.Node) -> fx.Node:
    order = [d % len(view.args[1]) for d in view.args[1]]
    return graph.call_function(aten.permute.default, (value, [order.index(d) for d in range(len(order))]))


def _item_as_slice(item: fx.Node) -> Optional[tuple[str, tuple]]:
    """``getitem(split(x, ...), i)`` as the slice (or select, for ``unbind``) of ``x`` it is."""
    parent, index = item.args
    if not isinstance(parent, fx.Node) or parent.op != "call_function":
        return None
    target, args = parent.target, parent.args
    if target is aten.unbind.int:
        return "select", (args[1] if len(args) > 1 else 0, index)
    if target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return None
    dim = args[2] if len(args) > 2 else 0
    sizes = [v.shape[dim] for v in parent.meta.get("val", ())]
    if not all(isinstance(s, int) for s in sizes):
        return None
    start = sum(sizes[:index])
    return "slice", (dim, start, start + sizes[index], 1)


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _item_as_slice(node) is not None
    return node.target in _SCATTERS


def _source(view: fx.Node) -> fx.Node:
    return view.args[0].args[0] if view.target is operator.getitem else view.args[0]


def _fresh(node: Any) -> bool:
    """A computed tensor that aliases nothing (not an input, not a view)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is not None and all(r.alias_info is None for r in schema.returns)


def _in_place(node: fx.Node) -> bool:
    """An ATen op that writes its first argument (``copy_``, ``scatter_``, ``add_``...)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.arguments or not isinstance(node.args[0], fx.Node):
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _fake(graph_node: fx.Node) -> None:
    """Fill ``meta['val']`` of a new node from its inputs' fake values."""
    values = [n.meta.get("val") for n in graph_node.all_input_nodes]
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    args, kwargs = fx.node.map_arg((graph_node.args, graph_node.kwargs), lambda n: n.meta["val"])
    with mode or contextlib.nullcontext():
        graph_node.meta["val"] = graph_node.target(*args, **kwargs)


def _new(graph: fx.Graph, like: fx.Node, target: Any, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    _stamp(node, like)
    return node


def _stamp(node: fx.Node, like: fx.Node) -> None:
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    _fake(node)


def _sizes(graph: fx.Graph, view: fx.Node, value: fx.Node) -> list:
    """``expand`` sizes that broadcast ``value`` to ``view``: -1 where they agree, else the view's size
    (a ``sym_size`` node when symbolic)."""
    want, have = view.meta["val"].shape, value.meta["val"].shape
    lead = len(want) - len(have)
    sizes: list = []
    for d, size in enumerate(want):
        if d >= lead and have[d - lead] is size or (isinstance(size, int) and d >= lead and have[d - lead] == size):
            sizes.append(-1)
        elif isinstance(size, int):
            sizes.append(size)
        else:
            sizes.append(_new(graph, view, aten.sym_size.int, (view, d)))
    return sizes


def _written_value(graph: fx.Graph, write: fx.Node, view: fx.Node) -> Optional[fx.Node]:
    """The new value of ``view`` after the in-place ``write`` (same shape and dtype as ``view``)."""
    name = write.target.overloadpacket.__name__
    want = view.meta["val"]
    if name == "copy_":
        value = write.args[1]
        if tuple(value.meta["val"].shape) != tuple(want.shape):
            value = _new(graph, write, aten.expand.default, (value, _sizes(graph, view, value)))
    else:
        packet = getattr(aten, name[:-1], None)
        functional = getattr(packet, write.target._overloadname, None) if packet is not None else None
        if functional is None:
            return None
        value = _new(graph, write, functional, (view, *write.args[1:]), dict(write.kwargs))
    if value.meta["val"].dtype != want.dtype:
        value = _new(graph, write, aten._to_copy.default, (value,), {"dtype": want.dtype})
    return value


def _aliases(base: fx.Node) -> Optional[list[fx.Node]]:
    """Every view of ``base`` (transitively), or None when a user may alias it undetectably."""
    out, frontier = [], [base]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user.op != "call_function":
                continue
            if user.target in _MAY_ALIAS:
                return None
            if user.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int):
                items = [u for u in user.users if u.target is operator.getitem]
                if len(items) != len(user.users) or any(_item_as_slice(u) is None for u in items):
                    return None
                out += items
                frontier += items
            elif _is_view(user) and _source(user) is current:
                out.append(user)
                frontier.append(user)
    return out


def _rebuild(graph: fx.Graph, view: fx.Node, base: fx.Node, new_base: fx.Node, cache: dict) -> fx.Node:
    """``view`` (a view of ``base``) taken from ``new_base`` instead."""
    if view is base:
        return new_base
    if view in cache:
        return cache[view]
    source = _rebuild(graph, _source(view), base, new_base, cache)
    if view.target is operator.getitem:
        kind, args = _item_as_slice(view)  # type: ignore[misc]
        target = aten.select.int if kind == "select" else aten.slice.Tensor
        rebuilt = _new(graph, view, target, (source, *args))
    else:
        rebuilt = _new(graph, view, view.target, (source, *view.args[1:]), dict(view.kwargs))
    cache[view] = rebuilt
    return rebuilt


def _write_back(graph: fx.Graph, view: fx.Node, value: fx.Node, base: fx.Node) -> fx.Node:
    """The new ``base`` once ``view`` (a chain of views of it) holds ``value``."""
    while view is not base:
        source = _source(view)
        if view.target is operator.getitem:
            kind, args = _item_as_slice(view)  # type: ignore[misc]
            target = aten.select_scatter.default if kind == "select" else aten.slice_scatter.default
            value_node = graph.call_function(target, (source, value, *args))
        else:
            value_node = _SCATTERS[view.target](graph, view, source, value)
        _stamp(value_node, view)
        value, view = value_node, source
    return value


def _chain_base(node: fx.Node) -> fx.Node:
    while _is_view(node):
        node = _source(node)
    return node


def functionalize_fresh_writes(graph: fx.Graph) -> int:
    """Rewrite in-place writes into fresh tensors (see the module docstring); returns how many."""
    done = 0
    for write in list(graph.nodes):
        if not _in_place(write):
            continue
        view = write.args[0]
        base = _chain_base(view)
        if not _fresh(base):
            continue
        aliases = _aliases(base)
        if aliases is None:
            continue
        later, node = [], write.next
        while node.op != "root":
            later.append(node)
            node = node.next
        with graph.inserting_before(write):
            value = _written_value(graph, write, view)
            if value is None:
                continue
            new_base = _write_back(graph, view, value, base)
        earlier = set(aliases) - set(later)  # views taken before the write: rebuilt on the new base
        cache: dict[fx.Node, fx.Node] = {}
        for user in later:
            for arg in [a for a in user.all_input_nodes if a is base or a in earlier]:
                with graph.inserting_before(user):
                    user.replace_input_with(arg, _rebuild(graph, arg, base, new_base, cache))
        write.replace_all_uses_with(value)
        graph.erase_node(write)
        done += 1
    return done


__all__ = ["functionalize_fresh_writes"]
