"""Recognise attention written out by hand ("eager" attention) as one attention call plus its score terms.

HuggingFace's ``eager_attention_forward`` (the default of Gemma 2, whose logit soft-capping sdpa cannot
express) and the ALiBi models (Bloom, MPT) compute::

    scores = q @ k.transpose(-1, -2) * scale        # or / sqrt(d); or baddbmm(bias, q, kᵀ, alpha=scale)
    scores = tanh(scores / softcap) * softcap       # optional (Gemma 2)
    scores = scores + bias                          # optional, any number: ALiBi, additive masks
    scores = scores.masked_fill(mask, min)          # optional: boolean masks
    probs  = softmax(scores, dim=-1)                # possibly in fp32, possibly on a [b·h, s, s] view
    out    = probs @ v                              # matmul or bmm

``match_eager_attention(out)`` returns an ``EagerAttention`` when every step of the chain is used only
inside it, so that replacing ``out`` removes the whole computation. The score *terms* (biases and
masks) are not interpreted here: ``hgraph.frontend.mask_probe`` evaluates the softmax input with q and k set to
zero, which leaves exactly the sum of the terms, and proves what it is (block-causal, a sliding window,
ALiBi) before ``canonicalize`` replaces anything. ``match_sink_attention``
does the same for gpt-oss's attention with sinks (a learned logit per head joining every softmax).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx

aten = torch.ops.aten
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_VIEWS = (aten.view.default, aten.reshape.default)
_CONVERSIONS = (aten.to.dtype, aten._to_copy.default, aten.type_as.default)
_PRODUCTS = (aten.matmul.default, aten.bmm.default)


@dataclass(frozen=True)
class EagerAttention:
    """One hand-written attention: ``query``/``key``/``value`` as the graph holds them (``[b, h, s, d]``,
    or ``[b·h, s, d]`` with ``heads_view`` the ``[b, h, s, -1]`` shape the scores are viewed to and
    ``merged_view`` the ``[b·h, s, -1]`` shape the probabilities are viewed back to), its ``scale`` and
    ``softcap``; ``scores``: the softmax input; ``operands``: the two nodes of the ``q @ kᵀ`` product
    (zeroed to read the terms); ``terms``: the bias and mask nodes added to the scores; ``sinks``:
    gpt-oss's ``[heads]`` sink logits (``match_sink_attention``)."""

    query: fx.Node
    key: fx.Node
    value: fx.Node
    scale: float
    softcap: Optional[float]
    scores: fx.Node
    operands: tuple[fx.Node, fx.Node]
    terms: tuple[fx.Node, ...]
    heads_view: Optional[list] = None
    merged_view: Optional[list] = None
    sinks: Optional[fx.Node] = None


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


def _unconverted(node: Any) -> Any:
    """``node`` without dtype conversions used only here (``scores.float()`` before a softmax)."""
    while _only_use(node) and node.target in _CONVERSIONS:
        node = node.args[0]
    return node


def _last_two_transposed(node: Any) -> Optional[fx.Node]:
    """``k`` when ``node`` (used once) is ``k.transpose(-1, -2)``."""
    if not (_only_use(node) and node.target == aten.transpose.int):
        return None
    ndim = node.meta["val"].dim() if isinstance(node.meta.get("val"), torch.Tensor) else 4
    if sorted(d % ndim for d in node.args[1:3]) != [ndim - 2, ndim - 1]:
        return None
    return node.args[0]


def match_eager_attention(out: fx.Node) -> Optional[EagerAttention]:
    """The ``EagerAttention`` ending at ``out = probs @ v``, or None (module docstring)."""
    if out.op != "call_function" or out.target not in _PRODUCTS:
        return None
    probs, value = out.args[:2]
    merged_view = None
    if _only_use(probs) and probs.target in _VIEWS:
        merged_view, probs = probs.args[1], probs.args[0]
    probs = _unconverted(probs)
    if not (_only_use(probs) and probs.target in _SOFTMAX and probs.args[1] in (-1, 3)):
        return None
    peeled = _peel(probs.args[0])
    if peeled is None:
        return None
    query, key, scale, softcap, operands, terms, heads_view = peeled
    if (heads_view is None) != (merged_view is None):
        return None
    return EagerAttention(query, key, value, scale, softcap, probs.args[0], operands, terms, heads_view, merged_view)


def _peel(scores: Any) -> Optional[tuple]:
    """``(q, k, scale, softcap, (q, kᵀ), terms, heads_view)`` of a softmax input ``scores``: its additive
    terms, masks, conversions and heads view peeled off down to the ``q·kᵀ`` product, or None."""
    chain, terms, heads_view = scores, [], None
    while _core(chain) is None:  # peel additive terms, masks, conversions and the heads view
        if not _leads_to_product(chain):
            return None
        if chain.target == aten.add.Tensor:
            left, right = chain.args[:2]
            chain, term = (left, right) if _leads_to_product(left) else (right, left)
            if not isinstance(term, fx.Node):
                return None
            terms.append(term)
        elif chain.target == aten.masked_fill.Scalar:
            terms.append(chain.args[1])
            chain = chain.args[0]
        elif chain.target in _VIEWS:
            if heads_view is not None:
                return None
            heads_view, chain = chain.args[1], chain.args[0]
        else:  # a dtype conversion
            chain = chain.args[0]
    query, key, scale, softcap, operands, bias = _core(chain)  # type: ignore[misc]
    if bias is not None:
        terms.append(bias)
    return query, key, scale, softcap, operands, tuple(terms), heads_view


def match_sink_attention(out: fx.Node) -> Optional[dict[str, Any]]:
    """gpt-oss's eager attention with *attention sinks* — a learned logit per head that joins every
    softmax and takes no value::

        logits = cat([q @ kᵀ · scale + mask, sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)], -1)
        probs  = softmax(logits - logits.max(-1, keepdim=True).values, -1)[..., :-1]
        out    = probs @ v

    (the subtracted maximum only steadies the exponentials); the masked scores are peeled as in
``match_eager_attention``, their terms probed like any other.
    The ``EagerAttention`` with ``sinks`` (the ``[heads]`` tensor), or None."""
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
    peeled = _peel(biased)
    if peeled is None:
        return None
    query, key, scale, softcap, operands, terms, heads_view = peeled
    if softcap is not None or heads_view is not None or not terms:
        return None
    return EagerAttention(query, key, value, scale, None, biased, operands, terms, sinks=sinks)


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


_STEPS = (aten.add.Tensor, aten.masked_fill.Scalar, *_VIEWS, *_CONVERSIONS)


def _leads_to_product(node: Any, depth: int = 0) -> bool:
    """Whether ``node`` is a single-use step of a score chain: a q·kᵀ product, or an add / masked_fill /
    view / conversion of one."""
    if not _only_use(node) or depth > 16:
        return False
    if _core(node) is not None:
        return True
    if node.target not in _STEPS:
        return False
    if node.target == aten.add.Tensor:
        return any(_leads_to_product(a, depth + 1) for a in node.args[:2])
    return _leads_to_product(node.args[0], depth + 1)


def _core(scores: Any) -> Optional[tuple[fx.Node, fx.Node, float, Optional[float], tuple[fx.Node, fx.Node], Optional[fx.Node]]]:
    """``(q, k, scale, softcap, (q, kᵀ), bias)`` when ``scores`` is ``[softcap∘](q @ kᵀ · scale)`` or
    ``baddbmm(bias, q, kᵀ, beta=1, alpha=scale)``, each step used once."""
    if not _only_use(scores):
        return None
    if scores.target == aten.baddbmm.default:
        bias, query, transposed = scores.args[:3]
        beta = scores.kwargs.get("beta", scores.args[3] if len(scores.args) > 3 else 1)
        alpha = scores.kwargs.get("alpha", scores.args[4] if len(scores.args) > 4 else 1)
        key = _last_two_transposed(transposed)
        if key is None or beta != 1 or _constant(alpha) is None or not isinstance(bias, fx.Node):
            return None
        return query, key, float(alpha), None, (query, transposed), bias
    logits, softcap = _softcapped(scores)
    scaled = _scaled(logits)
    product, scale = scaled if scaled is not None else (logits, 1.0)
    if not (_only_use(product) and product.target in _PRODUCTS):
        return None
    query, transposed = product.args[:2]
    key = _last_two_transposed(transposed)
    if key is None:
        return None
    return query, key, scale, softcap, (query, transposed), None


__all__ = ["EagerAttention", "match_eager_attention", "match_sink_attention"]
