"""Recognise attention written out by hand ("eager" attention) as the arguments of one attention call.

HuggingFace's ``eager_attention_forward`` (the default of Gemma 2, whose logit soft-capping sdpa cannot
express) computes::

    scores = q @ k.transpose(2, 3) * scale          # or / sqrt(d)
    scores = tanh(scores / softcap) * softcap       # optional (Gemma 2)
    probs  = softmax(scores + mask, dim=-1)         # the mask: additive, from position ids
    out    = probs @ v

``match_eager_attention(out)`` returns the ``scaled_dot_product_attention`` arguments of that pattern
(plus ``softcap``) when every intermediate value is used only inside it, so that replacing ``out``
removes the whole computation; ``canonicalize`` then treats it like a masked sdpa call (the mask is
proved block-causal, with its window, before anything is replaced). ``match_sink_attention`` does the
same for gpt-oss's attention with sinks.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
from torch import fx

aten = torch.ops.aten
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_TRANSPOSES = (aten.transpose.int,)


def _only_use(node: Any) -> bool:
    """A computed value with exactly one user (the next step of the chain)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1


def _constant(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _scaled(node: Any) -> Optional[tuple[fx.Node, float]]:
    """``(x, c)`` when ``node`` (used once) is ``x * c`` or ``x / (1/c)``."""
    if not _only_use(node) or len(node.args) != 2:
        return None
    factor = _constant(node.args[1])
    if factor is None or not isinstance(node.args[0], fx.Node):
        return None
    if node.target == aten.mul.Tensor:
        return node.args[0], factor
    if node.target == aten.div.Tensor and factor != 0:
        return node.args[0], 1.0 / factor
    return None


def _softcapped(node: fx.Node) -> tuple[fx.Node, Optional[float]]:
    """``(x, cap)`` for ``tanh(x / cap) * cap``, else ``(node, None)``."""
    outer = _scaled(node)
    if outer is None:
        return node, None
    tanh, cap = outer
    if not (_only_use(tanh) and tanh.target == aten.tanh.default):
        return node, None
    inner = _scaled(tanh.args[0])
    if inner is None or not math.isclose(inner[1] * cap, 1.0, rel_tol=1e-6):
        return node, None
    return inner[0], cap


def match_eager_attention(out: fx.Node) -> Optional[dict[str, Any]]:
    """The sdpa arguments (``query``, ``key``, ``value``, ``attn_mask``, ``scale``) and ``softcap`` of
    the eager attention ending at ``out = probs @ v``, or None."""
    if out.op != "call_function" or out.target != aten.matmul.default:
        return None
    probs, value = out.args[:2]
    if not (_only_use(probs) and probs.target in _SOFTMAX):
        return None
    if probs.args[1] not in (-1, 3):
        return None
    biased = probs.args[0]
    if not (_only_use(biased) and biased.target == aten.add.Tensor):
        return None
    for scores, mask in (biased.args, biased.args[::-1]):
        matched = _scores(scores) if isinstance(mask, fx.Node) else None
        if matched is not None:
            query, key, scale, softcap = matched
            return {
                "query": query, "key": key, "value": value, "attn_mask": mask, "dropout_p": 0.0,
                "is_causal": False, "scale": scale, "enable_gqa": False, "softcap": softcap,
            }
    return None


def match_sink_attention(out: fx.Node) -> Optional[dict[str, Any]]:
    """gpt-oss's eager attention with *attention sinks* — a learned logit per head that joins every
    softmax and takes no value::

        logits = cat([q @ kᵀ · scale + mask, sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)], -1)
        probs  = softmax(logits - logits.max(-1, keepdim=True).values, -1)[..., :-1]
        out    = probs @ v

    (the subtracted maximum only steadies the exponentials). The sdpa arguments of ``match_eager_attention``
    plus ``sinks`` (the ``[heads]`` tensor), or None."""
    if out.op != "call_function" or out.target != aten.matmul.default:
        return None
    dropped, value = out.args[:2]
    if not (_only_use(dropped) and dropped.target == aten.slice.Tensor and dropped.args[1] in (-1, 3)):
        return None
    if dropped.args[2:4] not in ((0, -1), (None, -1)):
        return None
    probs = dropped.args[0]
    if not (_only_use(probs) and probs.target in _SOFTMAX and probs.args[1] in (-1, 3)):
        return None
    logits = _without_row_max(probs.args[0])
    if not (isinstance(logits, fx.Node) and logits.target == aten.cat.default and logits.args[1] in (-1, 3)):
        return None
    parts = list(logits.args[0])
    if len(parts) != 2:
        return None
    biased, column = parts
    sinks = _sink_column(column)
    if sinks is None or not (isinstance(biased, fx.Node) and biased.target == aten.add.Tensor):
        return None
    for scores, mask in (biased.args, biased.args[::-1]):
        matched = _scores(scores) if isinstance(mask, fx.Node) else None
        if matched is not None and matched[3] is None:
            query, key, scale, _ = matched
            return {
                "query": query, "key": key, "value": value, "attn_mask": mask, "dropout_p": 0.0,
                "is_causal": False, "scale": scale, "enable_gqa": False, "softcap": None, "sinks": sinks,
            }
    return None


def _without_row_max(node: Any) -> Any:
    """``x`` for ``x - x.max(-1, keepdim=True).values`` (else ``node``)."""
    if not (isinstance(node, fx.Node) and node.target == aten.sub.Tensor and _only_use(node)):
        return node
    x, peak = node.args
    if not (isinstance(peak, fx.Node) and peak.target is operator.getitem and peak.args[1] == 0):
        return node
    reduced = peak.args[0]
    if reduced.target == aten.max.dim and reduced.args[0] is x and reduced.args[1] in (-1, 3):
        return x
    return node


def _sink_column(node: Any) -> Optional[fx.Node]:
    """The ``[heads]`` tensor of ``sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)``."""
    if not (_only_use(node) and node.target == aten.expand.default):
        return None
    shaped = node.args[0]
    if not (_only_use(shaped) and shaped.target in (aten.reshape.default, aten.view.default)):
        return None
    sinks = shaped.args[0]
    value = sinks.meta.get("val") if isinstance(sinks, fx.Node) else None
    return sinks if isinstance(value, torch.Tensor) and value.dim() == 1 else None


def _scores(scores: Any) -> Optional[tuple[fx.Node, fx.Node, float, Optional[float]]]:
    """``(q, k, scale, softcap)`` when ``scores`` is ``[softcap∘](q @ kᵀ · scale)``, each step used once."""
    if not _only_use(scores):
        return None
    logits, softcap = _softcapped(scores)
    scaled = _scaled(logits)
    product, scale = scaled if scaled is not None else (logits, 1.0)
    if not (_only_use(product) and product.target == aten.matmul.default):
        return None
    query, transposed = product.args[:2]
    if not (_only_use(transposed) and transposed.target in _TRANSPOSES):
        return None
    if sorted(d % 4 for d in transposed.args[1:3]) != [2, 3]:
        return None
    return query, transposed.args[0], scale, softcap


__all__ = ["match_eager_attention", "match_sink_attention"]
