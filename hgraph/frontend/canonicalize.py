"""Canonical form of a traced graph, so sharding rules see one spelling of each construct.

Models spell the same computation in different ways; the frontend rewrites a freshly exported graph
(in place) so that:

* ``no_grad`` and autocast-off blocks, which export wraps in higher-order ops, are inlined
  (``hgraph.frontend.capture.grad_regions``);
* metadata assertions (``aten._assert_tensor_metadata``, ``aten._assert_scalar``) are gone;
* no-op nodes are gone: same-dtype ``aten.to``, eval-mode or p=0 ``aten.dropout``, full slices
  ``x[:, :]``, ``x * 1.0`` and ``x + 0``, and the 1-d empty tensors ``cat`` skips;
* an in-place write into a tensor the model created (``out += attn``, MLA's keys filled slice by
  slice with ``copy_``, a router's ``mask.scatter_``) is its functional form
  (``hgraph.frontend.capture.functionalize``), and
  ``x @ W.T`` of a 2-d parameter is ``linear(x, W)``; batch and sequence sizes are read from
  ``input_ids`` (so every pipeline stage can compute them);
* every causal self-attention is ``hgraph.runtime.kernels.packed_attention.packed_attention(q, k, v, position_ids)``:
  causal inside each packed sequence (a sequence starts where ``position_ids == 0``). This replaces
  ``scaled_dot_product_attention(is_causal=True)``, and attention whose mask and biases are computed
  from ``position_ids`` and sizes alone once ``hgraph.frontend.mask_probe`` has proved, on probes longer than
  every length constant of their computation, what they are: the causal mask of one document (a
  mask from sizes alone: OPT's, Bloom's, gpt-oss's, GraniteMoE's — packed attention then runs each
  packed document as the model runs it alone), the block-causal mask HuggingFace builds from
  ``position_ids`` to detect packed sequences, a sliding window (``window=w``; a probe no longer than
  the window would see plain causality), Llama 4's chunks (``chunk=c``), ALiBi (``alibi=`` per-head
  slopes: Bloom, MPT). The dense mask and bias computations then disappear. Terms whose constants
  would need a probe longer than 8192 tokens keep their computation.
  Key/value heads repeated for grouped-query attention (``expand`` + ``reshape``) are folded into
  ``enable_gqa=True``. Attention written out by hand (``hgraph.frontend.eager_attention``: HuggingFace's eager
  attention, Gemma 2's logit soft-capping, Bloom's ``baddbmm`` over ``[b·h, s, d]``, gpt-oss's
  attention sinks) is treated the same way, its soft-cap or sinks kept.

Linear-attention layers get the packed positions too (``hgraph.frontend.capture.linear_attention``): Gated DeltaNet's
delta rule becomes ``packed_gated_delta_rule`` and each causal depthwise convolution over the sequence
``packed_causal_conv1d``, both restarting at every document.

Attention with dropout, a mask of another kind (padding) or no causality stays as it is (and the
packing proof, ``hgraph.compiler.packing_proof``, then finds that it mixes documents).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hgraph.frontend.eager_attention import match_eager_attention, match_sink_attention
from hgraph.frontend.functionalize import functionalize_fresh_writes
from hgraph.frontend.grad_regions import inline_grad_regions
from hgraph.frontend.linear_attention import packed_sequence_mixers
from hgraph.frontend.mask_probe import NOT_CAUSAL, AttentionPattern, ScoreTerms, prove_attention
from hgraph.frontend.traced_layout import with_traced_layout
from hgraph.runtime.kernels.packed_attention import packed_attention

log = logging.getLogger(__name__)

aten = torch.ops.aten
_ASSERTIONS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
_CONVERSIONS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default}
_SDPA = aten.scaled_dot_product_attention.default


def canonicalize(gm: fx.GraphModule, example_args: Sequence[Any]) -> None:
    """Rewrite ``gm`` in place (see the module docstring); ``example_args`` are its inputs."""
    graph = gm.graph
    inline_grad_regions(gm)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTIONS:
            graph.erase_node(node)
    for node in list(graph.nodes):
        _drop_empty_cat_inputs(node)
    for node in list(graph.nodes):
        source = _identity_source(node)
        if source is not None:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
    _sizes_from_inputs(graph)
    functionalize_fresh_writes(graph)
    for node in list(graph.nodes):
        _weight_matmul_as_linear(graph, node)
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


def _drop_empty_cat_inputs(node: fx.Node) -> None:
    """``cat([torch.tensor([]), k], dim)`` (GraniteMoE's empty key cache): ``cat`` skips a 1-d empty
    tensor, so it is dropped from the list (rules then see tensors of one rank)."""
    if node.op != "call_function" or node.target != aten.cat.default:
        return
    tensors = list(node.args[0])
    out = _val(node)
    kept = [t for t in tensors if not (isinstance(_val(t), torch.Tensor) and _val(t).dim() == 1
                                       and _val(t).shape[0] == 0 and out is not None and out.dim() > 1)]
    if len(kept) == len(tensors) or not kept:
        return
    node.args = (kept, *node.args[1:])


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


def _sizes_from_inputs(graph: fx.Graph) -> None:
    """Read the batch and sequence sizes from the first data input wherever a model reads them from
    an activation (Bloom's ``batch_size, seq_length, _ = hidden_states.shape`` inside each block): the
    same symbol, but a size read from an input is available to every pipeline stage."""
    inputs = [n for n in graph.nodes if n.op == "placeholder" and n.name == "input_ids"]
    if not inputs or not isinstance(_val(inputs[0]), torch.Tensor):
        return
    source = inputs[0]
    symbols = {}
    for d, size in enumerate(_val(source).shape):
        if isinstance(size, torch.SymInt):
            symbols.setdefault(size.node.expr, d)
    if not symbols:
        return
    replacements: dict[int, fx.Node] = {}
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.sym_size.int or node.args[0] is source:
            continue
        size = _val(node)
        d = symbols.get(size.node.expr) if isinstance(size, torch.SymInt) else None
        if d is None:
            continue
        if d not in replacements:
            with graph.inserting_after(last_placeholder):
                replacements[d] = graph.call_function(aten.sym_size.int, (source, d))
            replacements[d].meta = dict(node.meta)
        node.replace_all_uses_with(replacements[d])
        graph.erase_node(node)


def _weight_matmul_as_linear(graph: fx.Graph, node: fx.Node) -> None:
    """``x @ W.T`` with ``W`` a 2-d parameter (Falcon's ``FalconLinear``) -> ``linear(x, W)``, so the
    rules see a linear layer (column/row parallel) rather than a product with a transposed tensor."""
    if node.op != "call_function" or node.target != aten.matmul.default:
        return
    x, transposed = node.args[:2]
    if not (isinstance(transposed, fx.Node) and transposed.op == "call_function"):
        return
    weight = transposed.args[0] if transposed.args else None
    if not (isinstance(weight, fx.Node) and weight.op == "placeholder" and weight.name.startswith("p_")):
        return
    value = _val(weight)
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or _val(x) is None or _val(x).dim() < 2:
        return
    target, args = transposed.target, transposed.args
    is_transpose = target in (aten.numpy_T.default, aten.t.default) or (
        target == aten.transpose.int and sorted(a % 2 for a in args[1:3]) == [0, 1]
    ) or (target == aten.permute.default and [a % 2 for a in args[1]] == [1, 0])
    if not is_transpose:
        return
    node.target, node.args, node.kwargs = aten.linear.default, (x, weight), {}


# ----------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class _Attention:
    """One attention call found in the graph: sdpa, or hand-written (``EagerAttention``)."""

    node: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    scale: float | None
    enable_gqa: bool
    softcap: float | None = None
    terms: ScoreTerms | None = None  # None: sdpa's is_causal, no mask
    heads_view: list | None = None
    merged_view: list | None = None
    sinks: fx.Node | None = None


def _sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    arguments = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    arguments.update(zip(names, node.args))
    arguments.update(node.kwargs)
    return arguments


def _attention(node: fx.Node) -> _Attention | None:
    """The attention ``node`` computes, if it is causal sdpa, masked sdpa or hand-written attention."""
    if node.target == _SDPA:
        a = _sdpa_arguments(node)
        if a["dropout_p"] != 0 or (a["is_causal"] and a["attn_mask"] is not None):
            return None
        mask = a["attn_mask"]
        if mask is None and not a["is_causal"]:
            return None
        terms = ScoreTerms(mask, (mask,)) if mask is not None else None
        return _Attention(node, a["query"], a["key"], a["value"], a["scale"], bool(a["enable_gqa"]), terms=terms)
    eager = match_eager_attention(node) or match_sink_attention(node)
    if eager is None:
        return None
    return _Attention(node, eager.query, eager.key, eager.value, eager.scale, False, eager.softcap,
                      ScoreTerms(eager.scores, eager.terms, eager.operands), eager.heads_view, eager.merged_view,
                      eager.sinks)


def _position_input(gm: fx.GraphModule) -> fx.Node | None:
    return next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)


def _packed_attention(gm: fx.GraphModule, example_args: Sequence[Any]) -> None:
    positions = _position_input(gm)
    if positions is None:
        return
    # Score terms may read positions, sizes and the model's buffers (constants such as ALiBi slopes).
    buffers = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("b_")}
    causal, probed = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        att = _attention(node)
        if att is None:
            continue
        q_len, k_len = _val(att.query).shape[-2], _val(att.key).shape[-2]
        if not _same_shape([q_len, k_len], [_val(positions).shape[1]] * 2):
            log.info("attention %s kept as traced, not packed: query and key lengths (%s, %s) are not the "
                     "sequence's", node, q_len, k_len)
            continue
        if att.terms is None:
            causal.append(att)
        elif all(_data_inputs(t) <= {positions} | buffers for t in att.terms.terms):
            probed.append(att)
        else:
            log.info("attention %s kept as traced, not packed: its score terms read inputs other than the "
                     "positions and buffers", node)
    reads = [any(positions in _data_inputs(t) for t in att.terms.terms) for att in probed]  # type: ignore[union-attr]
    terms = [att.terms for att in probed]
    patterns = prove_attention(gm, terms, positions, example_args, reads) if probed else []  # type: ignore[arg-type]
    for att in causal:
        _replace(gm, att, positions, AttentionPattern())
    for att, pattern in zip(probed, patterns):
        if pattern is not NOT_CAUSAL:
            _replace(gm, att, positions, pattern)
        else:
            log.info("attention %s kept as traced, not packed: its score terms are no block-causal pattern "
                     "(window, chunks or ALiBi) on every probe", att.node)
    packed_sequence_mixers(gm, positions)


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


def _fake(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> Any:
    """``op`` applied to the fake values of its node arguments (the meta value of a new node)."""

    def value(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return [value(x) for x in a]
        return _val(a) if isinstance(a, fx.Node) else a

    return op(*[value(a) for a in args], **{k: value(v) for k, v in (kwargs or {}).items()})


def _call(graph: fx.Graph, op: Any, args: tuple, kwargs: dict[str, Any] | None = None) -> fx.Node:
    node = graph.call_function(op, args, kwargs or {})
    node.meta["val"] = _fake(op, args, kwargs)
    return node


def _alibi_slopes(gm: fx.GraphModule, slopes: tuple[float, ...], heads: int, like: fx.Node) -> fx.Node:
    """A constant of the per-head ALiBi slopes (one per query head), as a ``get_attr`` node."""
    values = torch.tensor(slopes * heads if len(slopes) == 1 else slopes, dtype=torch.float32)
    name = f"_alibi_slopes_{sum(1 for n in gm.graph.nodes if n.op == 'get_attr' and n.target.startswith('_alibi'))}"
    gm.register_buffer(name, values)
    node = gm.graph.get_attr(name)
    fake_mode = getattr(_val(like), "fake_mode", None)
    node.meta["val"] = fake_mode.from_tensor(values) if fake_mode is not None else values
    return node


def _replace(gm: fx.GraphModule, att: _Attention, positions: fx.Node, pattern: AttentionPattern) -> None:
    graph, node = gm.graph, att.node
    with graph.inserting_before(node):
        query, key, value = att.query, att.key, att.value
        if att.heads_view is not None:  # [b·h, s, d] -> [b, h, s, d]
            query, key, value = (_call(graph, aten.view.default, (t, att.heads_view)) for t in (query, key, value))
        enable_gqa = att.enable_gqa
        folded_k, folded_v = _repeated_heads(key), _repeated_heads(value)
        if folded_k and folded_v and folded_k[1] == folded_v[1] and not enable_gqa:
            key, value, enable_gqa = folded_k[0], folded_v[0], True
        kwargs: dict[str, Any] = {}
        if att.scale is not None:
            kwargs["scale"] = att.scale
        if enable_gqa:
            kwargs["enable_gqa"] = True
        if pattern.window is not None:
            kwargs["window"] = pattern.window
        if pattern.chunk is not None:
            kwargs["chunk"] = pattern.chunk
        if att.softcap is not None:
            kwargs["softcap"] = att.softcap
        if att.sinks is not None:
            kwargs["sinks"] = att.sinks
        if pattern.alibi is not None:
            kwargs["alibi"] = _alibi_slopes(gm, pattern.alibi, _val(query).shape[1], query)
        new = graph.call_function(packed_attention, (query, key, value, positions), kwargs)
        new.meta = dict(node.meta)
        new.meta["val"] = _fake(packed_attention, (query, key, value, positions), kwargs)
        if att.merged_view is not None:  # back to the [b·h, s, d] the model continues with
            new = _call(graph, aten.view.default, (new, att.merged_view))
            new.meta = {**node.meta, "val": new.meta["val"]}
    new = with_traced_layout(graph, new, node.meta.get("val"))  # the strides later views were traced with
    node.replace_all_uses_with(new)
    graph.erase_node(node)


__all__ = ["canonicalize"]
