"""Linear-attention layers in traced graphs: Gated DeltaNet's chunked delta rule and the short causal
convolutions before it, made to restart at every packed document.

Two steps, like attention's (``canonicalize``):

* while tracing, ``hf_kernels(model)`` swaps HF's reference ``torch_chunk_gated_delta_rule`` (in the
  modules the model is built from: Qwen3-Next, Qwen3.5, ...) for ``hgraph.runtime.kernels.linear_attention
  .gated_delta_rule`` — the same algorithm as one opaque op, instead of a per-shape unrolled loop of
  in-place chunk updates;
* ``packed_sequence_mixers(gm)`` then gives each such op, and each causal depthwise convolution over
  the sequence (``conv1d(x, w, groups=channels, padding=k-1)[..., :seq]``, HF's ``causal_conv1d_fn``
  and Mamba's ``conv1d(x)[..., :seq_len]``), the ``position_ids``: ``packed_gated_delta_rule`` and
  ``packed_causal_conv1d`` run every document alone.

Other layers that carry a state along the sequence — Mamba's selective scan (Bamba, Falcon-H1, Jamba,
Nemotron-H), MiniMax's lightning attention — are written out in ATen ops with Python loops over the
length; hgraph has no kernel that restarts them at a document and no trace that serves every length.
``refuse_unsupported_mixers`` names such a layer before tracing (``TraceError``): a layer with a
selective-scan decay parameter ``A_log`` or a lightning-attention ``slope_rate`` whose modeling module
has none of the reference kernels above.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Optional

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hgraph.errors import TraceError
from hgraph.frontend.traced_layout import with_traced_layout
from hgraph.runtime.kernels.linear_attention import gated_delta_rule, packed_causal_conv1d, packed_gated_delta_rule

aten = torch.ops.aten
_TRACED_RULE = torch.ops.hgraph.gated_delta_rule.default


def _traced_chunk_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's ``torch_chunk_gated_delta_rule`` signature, computed by hgraph's op (traced as one node)."""
    if initial_state is not None or output_final_state or kwargs.get("cu_seqlens") is not None:
        raise TraceError(
            "Gated DeltaNet called with a recurrent cache or cu_seqlens; hgraph traces training forwards "
            "(use_cache=False) and packs documents itself from position_ids"
        )
    return gated_delta_rule(query, key, value, g, beta, chunk_size=chunk_size, l2norm=use_qk_l2norm_in_kernel), None


_REPLACED = {"torch_chunk_gated_delta_rule": _traced_chunk_gated_delta_rule}
"""Reference kernels of HF modeling modules (module global name -> hgraph's traced form)."""


@contextlib.contextmanager
def hf_kernels(model: nn.Module) -> Iterator[None]:
    """While tracing ``model``: HF's reference linear-attention kernels replaced (``_REPLACED``) in the
    ``transformers`` modules its layers come from; restored afterwards."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if type(m).__module__.startswith("transformers.") and type(m).__module__ in sys.modules}
    saved = []
    for module in modules:
        for name, replacement in _REPLACED.items():
            if callable(getattr(module, name, None)):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


_RECURRENT_STATE = ("A_log", "slope_rate")  # a layer's own tensors that mark a recurrence over the sequence


def refuse_unsupported_mixers(model: nn.Module) -> None:
    """Raise ``TraceError`` naming the first recurrent sequence-mixing layer of ``model`` that hgraph
    cannot run over packed documents (module docstring); do nothing when there is none."""
    for path, module in model.named_modules():
        own = {name for name, _ in module.named_parameters(recurse=False)} | {
            name for name, _ in module.named_buffers(recurse=False)}
        if not own & set(_RECURRENT_STATE):
            continue
        namespace = sys.modules.get(type(module).__module__)
        if namespace is not None and any(callable(getattr(namespace, name, None)) for name in _REPLACED):
            continue  # a Gated DeltaNet: its kernel is replaced while tracing
        kind = "lightning-attention" if "slope_rate" in own else "state-space (selective scan)"
        raise TraceError(
            f"cannot trace {type(model).__name__}: module '{path}' ({type(module).__name__}) is a {kind} layer, "
            "which carries a state along the sequence; hgraph has no kernel that restarts it at every packed "
            "document (its reference code loops over the length in Python, so no trace serves every length). "
            "Supported recurrent layers: Gated DeltaNet (Qwen3-Next, Qwen3.5) and causal depthwise convolutions; "
            "train this family without hgraph until a packed kernel for this layer is added "
            "(hgraph.frontend.linear_attention)"
        )


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _causal_conv(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node, Any, fx.Node]]:
    """``(x, weight, bias, conv)`` when ``node`` is ``conv1d(x, w, b, [1], [k-1], [1], channels)[..., :len]``
    with ``len`` the length of ``x``: a depthwise causal convolution over the last dim."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return None
    conv = node.args[0]
    if not (isinstance(conv, fx.Node) and conv.target is aten.conv1d.default and len(conv.users) == 1):
        return None
    x, weight, bias, stride, padding, dilation, groups = [*conv.args, *(None, [1], [0], [1], 1)[len(conv.args) - 2:]]
    xv, wv = _val(x), _val(weight)
    if xv is None or wv is None or xv.dim() != 3 or wv.dim() != 3:
        return None
    k = wv.shape[-1]
    depthwise = groups == xv.shape[1] and wv.shape[0] == xv.shape[1] and wv.shape[1] == 1
    if not (depthwise and list(stride) == [1] and list(dilation) == [1] and list(padding) == [k - 1]):
        return None
    dim, start = node.args[1] % 3, node.args[2] if len(node.args) > 2 else 0
    end = _val(node.args[3]) if isinstance(node.args[3], fx.Node) else node.args[3] if len(node.args) > 3 else None
    if dim != 2 or start not in (None, 0) or end is None or not statically_known_true(end == xv.shape[-1]):
        return None
    return x, weight, bias, conv


def packed_sequence_mixers(gm: fx.GraphModule, positions: fx.Node) -> int:
    """Give every traced delta rule and causal convolution the packed ``positions`` (module
    docstring); returns how many were rewritten."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _TRACED_RULE:
            q, k, v, g, beta, _, chunk_size, l2norm = node.args
            new = _swap(graph, node, packed_gated_delta_rule, (q, k, v, g, beta, positions),
                        {"chunk_size": chunk_size, "l2norm": l2norm})
        else:
            found = _causal_conv(node)
            if found is None:
                continue
            x, weight, bias, conv = found
            new = _swap(graph, node, packed_causal_conv1d, (x, weight, bias, positions), {})
            graph.erase_node(conv)
        count += new is not None
    return count


def _swap(graph: fx.Graph, node: fx.Node, target: Any, args: tuple, kwargs: dict) -> fx.Node:
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(with_traced_layout(graph, new, node.meta.get("val")))
    graph.erase_node(node)
    return new


__all__ = ["hf_kernels", "packed_sequence_mixers", "refuse_unsupported_mixers"]
