"""Canonical form of a traced graph, so sharding rules see one spelling of each construct.

Models spell the same computation in different ways; the frontend rewrites a freshly exported graph
(in place) so that:

* metadata assertions (``aten._assert_tensor_metadata``, ``aten._assert_scalar``) are gone;
* no-op nodes are gone: same-dtype ``aten.to``, eval-mode or p=0 ``aten.dropout``, full slices
  ``x[:, :]``, ``x * 1.0`` and ``x + 0``;
* every causal self-attention is ``hgraph.runtime.ops.packed_attention(q, k, v, position_ids)``:
  causal inside each packed sequence (a sequence starts where ``position_ids == 0``). This replaces
  ``scaled_dot_product_attention(is_causal=True)`` and also an explicit mask computed from
  ``position_ids`` alone (HuggingFace builds one to detect packed sequences) once the mask is checked
  to be exactly that block-causal mask on probe inputs; the dense mask computation then disappears.
  Key/value heads repeated for grouped-query attention (``expand`` + ``reshape``) are folded into
  ``enable_gqa=True``.

Attention with dropout, a mask of another kind (padding, ALiBi) or no causality stays as it is.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hgraph.runtime.ops import packed_attention

aten = torch.ops.aten
_ASSERTIONS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
_CONVERSIONS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default}
_SDPA = aten.scaled_dot_product_attention.default


def canonicalize(gm: fx.GraphModule, example_args: Sequence[Any]) -> None:
    """Rewrite ``gm`` in place (see the module docstring); ``example_args`` are its inputs."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTIONS:
            graph.erase_node(node)
    for node in list(graph.nodes):
        source = _identity_source(node)
        if source is not None:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
    _packed_attention(gm, example_args)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


# ----------------------------------------------------------------------------- no-op nodes
def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _same_tensor_type(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        and a.dtype == b.dtype and a.device == b.device and _same_shape(a.shape, b.shape)
    )


def _same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _identity_source(node: fx.Node) -> fx.Node | None:
    """The input a no-op node merely passes on, or None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source, out = node.args[0], _val(node)
    if not _same_tensor_type(_val(source), out):
        return None
    target, args = node.target, node.args
    if target in _CONVERSIONS:
        memory_format = node.kwargs.get("memory_format")
        return source if memory_format in (None, torch.preserve_format) else None
    if target == aten.dropout.default:
        return source if args[1] == 0 or not args[2] else None
    if target == aten.slice.Tensor:
        start = args[2] if len(args) > 2 else None
        end = args[3] if len(args) > 3 else None
        step = args[4] if len(args) > 4 else 1
        to_end = end is None or (isinstance(end, int) and end >= sys.maxsize)
        return source if start in (None, 0) and to_end and step == 1 else None
    if target == aten.mul.Tensor and isinstance(args[1], (int, float)) and args[1] == 1:
        return source
    if target == aten.add.Tensor and isinstance(args[1], (int, float)) and args[1] == 0:
        return source
    return None


# ----------------------------------------------------------------------------- attention
def _sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    arguments = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    arguments.update(zip(names, node.args))
    arguments.update(node.kwargs)
    return arguments


def _position_input(gm: fx.GraphModule) -> fx.Node | None:
    return next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)


def _packed_attention(gm: fx.GraphModule, example_args: Sequence[Any]) -> None:
    positions = _position_input(gm)
    if positions is None:
        return
    causal, masked = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != _SDPA:
            continue
        a = _sdpa_arguments(node)
        q_len, k_len = _val(a["query"]).shape[-2], _val(a["key"]).shape[-2]
        self_attention = _same_shape([q_len, k_len], [_val(positions).shape[1]] * 2)
        if a["dropout_p"] != 0 or not self_attention:
            continue
        if a["is_causal"] and a["attn_mask"] is None:
            causal.append(node)
        elif a["attn_mask"] is not None and not a["is_causal"]:
            if _data_inputs(a["attn_mask"]) <= {positions}:
                masked.append(node)
    if masked:
        masked = _block_causal(gm, masked, positions, example_args)
    for node in causal + masked:
        _replace(gm.graph, node, positions)


def _data_inputs(node: fx.Node) -> set[fx.Node]:
    """Placeholders whose *values* (not just sizes) ``node`` depends on."""
    seen, found, stack = set(), set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            found.add(current)
        elif not (current.op == "call_function" and current.target == aten.sym_size.int):
            stack.extend(current.all_input_nodes)
    return found


def _block_causal(
    gm: fx.GraphModule, nodes: list[fx.Node], positions: fx.Node, example_args: Sequence[Any]
) -> list[fx.Node]:
    """Those attention nodes whose mask equals the packed block-causal mask on probe inputs."""
    masks = [_sdpa_arguments(n)["attn_mask"] for n in nodes]
    needed: set[fx.Node] = set()
    stack = list(masks)
    while stack:
        current = stack.pop()
        if current not in needed:
            needed.add(current)
            stack.extend(current.all_input_nodes)
    probe_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = probe_graph.node_copy(node, lambda n: env[n])
    probe_graph.output(tuple(env[m] for m in masks))
    probe = fx.GraphModule(gm, probe_graph)
    slot = [n for n in gm.graph.nodes if n.op == "placeholder"].index(positions)
    shape = tuple(example_args[slot].shape)
    ok = [True] * len(nodes)
    for position_ids in _probe_positions(shape):
        args = list(example_args)
        args[slot] = position_ids
        with torch.no_grad():
            values = probe(*args)
        expected = _expected_mask(position_ids)
        for i, value in enumerate(values):
            ok[i] = ok[i] and _allows_exactly(value, expected)
    return [n for n, good in zip(nodes, ok) if good]


def _probe_positions(shape: tuple[int, int]) -> list[torch.Tensor]:
    """One unpacked and one packed (sequences of 1-4 tokens, different per row) position tensor."""
    batch, seq = shape
    unpacked = torch.arange(seq).expand(batch, seq).contiguous()
    rows = []
    for row in range(batch):
        lengths, total, k = [], 0, row
        while total < seq:
            lengths.append(min((1, 3, 2, 4)[k % 4], seq - total))
            total += lengths[-1]
            k += 1
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return [unpacked, torch.stack(rows)]


def _expected_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s, s] bool: query i may see key j iff same sequence and j <= i."""
    index = torch.arange(position_ids.shape[1])
    starts = torch.where(position_ids == 0, index, torch.zeros_like(index)).cummax(dim=1).values
    return (starts[:, :, None] == starts[:, None, :]) & (index[None, :] <= index[:, None])


def _allows_exactly(mask: Any, expected: torch.Tensor) -> bool:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return False
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        if not bool((mask[~allowed] <= -1e4).all()):
            return False
    else:
        return False
    try:
        full = torch.broadcast_shapes(allowed.shape, (expected.shape[0], 1, *expected.shape[1:]))
    except RuntimeError:
        return False
    return torch.equal(allowed.expand(full), expected[:, None].expand(full))


def _repeated_heads(node: Any) -> tuple[fx.Node, int] | None:
    """``(kv, r)`` when ``node`` is ``reshape(expand(kv[:, :, None], [b, h, r, s, d]), [b, h·r, s, d])``."""
    if not (isinstance(node, fx.Node) and node.target in (aten.reshape.default, aten.view.default)):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.target == aten.expand.default):
        return None
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target == aten.unsqueeze.default):
        return None
    if unsqueeze.args[1] != 2:
        return None
    kv = unsqueeze.args[0]
    shape, expanded, out = _val(kv).shape, _val(expand).shape, _val(node).shape
    if len(shape) != 4 or len(expanded) != 5 or not isinstance(expanded[2], int):
        return None
    repeat = expanded[2]
    if not _same_shape(out, (shape[0], shape[1] * repeat, shape[2], shape[3])):
        return None
    return kv, repeat


def _replace(graph: fx.Graph, node: fx.Node, positions: fx.Node) -> None:
    a = _sdpa_arguments(node)
    key, value, enable_gqa = a["key"], a["value"], bool(a["enable_gqa"])
    folded_k, folded_v = _repeated_heads(key), _repeated_heads(value)
    if folded_k and folded_v and folded_k[1] == folded_v[1] and not enable_gqa:
        key, value, enable_gqa = folded_k[0], folded_v[0], True
    kwargs: dict[str, Any] = {}
    if a["scale"] is not None:
        kwargs["scale"] = a["scale"]
    if enable_gqa:
        kwargs["enable_gqa"] = True
    with graph.inserting_before(node):
        new = graph.call_function(packed_attention, (a["query"], key, value, positions), kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


__all__ = ["canonicalize"]
