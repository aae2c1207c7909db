"""Rules for attention: heads split over tp, the sequence split over cp with K/V gathered.

The frontend expresses causal attention as ``hgraph.runtime.ops.packed_attention(q, k, v,
position_ids)`` (q ``[b, heads, s, d]``, k/v ``[b, kv_heads, s, d]``). On tp every rank takes
``heads/tp`` query heads and ``kv_heads/tp`` key/value heads — contiguous head ranges keep the
grouped-query pairing — so both counts must be divisible by tp. On cp the local program calls it
with ``cp=True``: queries stay on the rank's load-balanced token chunks and K/V/positions are gathered.
A plain ``scaled_dot_product_attention`` the frontend left alone (masked, non-causal) is only
supported on tp.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from hgraph.layout import Shard
from hgraph.rules.base import CP, TP, R, Decision, LowerContext, RuleInput
from hgraph.rules.registry import register
from hgraph.runtime import ops

aten = torch.ops.aten


def _check_heads(rin: RuleInput, q: fx.Node, k: fx.Node) -> None:
    tp = rin.degree(TP)
    for label, node in (("attention heads", q), ("key/value heads", k)):
        heads = rin.shape(node)[1]
        if heads % tp:
            raise rin.error(
                f"{heads} {label} cannot be split over tp={tp}; use a tp that divides {heads}"
            )


def packed_attention_rule(node: fx.Node, rin: RuleInput) -> Decision:
    q, k, v, positions = node.args[:4]
    _check_heads(rin, q, k)
    cp, tp = rin.degree(CP) > 1, rin.degree(TP) > 1
    qkv = (Shard(2) if cp else R, Shard(1) if tp else R)
    pos = (Shard(1) if cp else R, R)
    inputs = {q: qkv, k: qkv, v: qkv, positions: pos}
    if not cp:
        return Decision(output=qkv, inputs=inputs, note="heads over tp" if tp else "")

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        kwargs = dict(n.kwargs)
        kwargs["cp"] = True
        return lc.call(ops.packed_attention, tuple(lc.local(a) for a in (q, k, v, positions)), kwargs)

    return Decision(output=qkv, inputs=inputs, lower=lower, note="sequence over cp, K/V gathered")


def sdpa_rule(node: fx.Node, rin: RuleInput) -> Decision:
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if rin.degree(CP) > 1:
        raise rin.error(
            "context parallelism needs causal attention the frontend turns into packed_attention; this "
            "scaled_dot_product_attention has a custom mask or dropout"
        )
    _check_heads(rin, q, k)
    heads = (R, Shard(1) if rin.degree(TP) > 1 else R)
    inputs = {q: heads, k: heads, v: heads}
    if isinstance(mask, fx.Node):
        inputs[mask] = heads if rin.ndim(mask) == 4 and rin.shape(mask)[1] != 1 else (R, R)
    return Decision(output=heads, inputs=inputs, note="heads over tp")


register(ops.packed_attention, packed_attention_rule)
register(aten.scaled_dot_product_attention, sdpa_rule)
