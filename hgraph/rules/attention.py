"""Rules for attention: heads split over tp, the sequence split over cp with K/V gathered.

The frontend expresses causal attention as ``hgraph.runtime.kernels.packed_attention.packed_attention(q, k, v,
position_ids)`` (q ``[b, heads, s, d]``, k/v ``[b, kv_heads, s, d]``; ALiBi slopes ``alibi=[heads]``
are cut with the query heads). On tp every rank takes
``heads/tp`` query heads and ``kv_heads/tp`` key/value heads — contiguous head ranges keep the
grouped-query pairing — so both counts must be divisible by tp, except that fewer key/value heads
than tp ranks (multi-query attention) are replicated, each rank reading the one its query heads use. On cp the local program calls it
with ``cp=True``: queries stay on the rank's load-balanced token chunks and K/V/positions are gathered.
A learned tensor of the variant (gpt-oss's ``sinks``: one logit per query head) is cut with the
heads on tp and replicated on cp (its gradient summed there). A plain ``scaled_dot_product_attention``
the frontend left alone (masked, non-causal) is only supported on tp.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from hgraph.core.placement import Shard
from hgraph.rules.base import CP, TP, R, Decision, LowerContext, RuleInput
from hgraph.rules.registry import register
from hgraph.runtime.kernels.packed_attention import own_kv_heads, packed_attention

aten = torch.ops.aten


def _check_heads(rin: RuleInput, q: fx.Node, k: fx.Node) -> bool:
    """Whether key/value heads are replicated over tp (fewer of them than ranks, tp a multiple)."""
    tp = rin.degree(TP)
    heads, kv_heads = rin.shape(q)[1], rin.shape(k)[1]
    if heads % tp:
        raise rin.error(f"{heads} attention heads cannot be split over tp={tp}; use a tp that divides {heads}")
    if kv_heads % tp == 0:
        return False
    if tp % kv_heads == 0 and heads % kv_heads == 0:
        return True
    raise rin.error(
        f"{kv_heads} key/value heads cannot be split over tp={tp}; use a tp that divides {kv_heads} "
        f"or a multiple of it"
    )


def packed_attention_rule(node: fx.Node, rin: RuleInput) -> Decision:
    q, k, v, positions = node.args[:4]
    replicated_kv = _check_heads(rin, q, k)
    cp, tp = rin.degree(CP) > 1, rin.degree(TP) > 1
    qkv = (Shard(2) if cp else R, Shard(1) if tp else R)
    kv = (qkv[0], R) if replicated_kv else qkv
    pos = (Shard(1) if cp else R, R)
    inputs = {q: qkv, k: kv, v: kv, positions: pos}
    for name in ("sinks", "alibi"):  # one learned logit / one ALiBi slope per query head: cut with the heads
        per_head = node.kwargs.get(name)
        if isinstance(per_head, fx.Node):
            inputs[per_head] = (R, Shard(0) if tp else R)
    if not cp and not replicated_kv:
        return Decision(output=qkv, inputs=inputs, note="heads over tp" if tp else "")

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        kwargs = {key: lc.local(value) if isinstance(value, fx.Node) else value for key, value in n.kwargs.items()}
        kwargs["cp"] = cp
        local_k, local_v = lc.local(k), lc.local(v)
        if replicated_kv:  # this rank's query heads all read one key/value head (Megatron's MQA/GQA)
            local_k = lc.call(own_kv_heads, (local_k, "tp"))
            local_v = lc.call(own_kv_heads, (local_v, "tp"))
            kwargs["enable_gqa"] = True
        return lc.call(packed_attention, (lc.local(q), local_k, local_v, lc.local(positions)), kwargs)

    notes = ["sequence over cp, K/V gathered"] if cp else []
    notes += ["heads over tp, K/V heads replicated"] if replicated_kv else []
    return Decision(output=qkv, inputs=inputs, lower=lower, note="; ".join(notes))


def sdpa_rule(node: fx.Node, rin: RuleInput) -> Decision:
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if rin.degree(CP) > 1:
        raise rin.error(
            "context parallelism needs causal attention the frontend turns into packed_attention; this "
            "scaled_dot_product_attention has a custom mask or dropout"
        )
    if _check_heads(rin, q, k):
        raise rin.error(
            f"{rin.shape(k)[1]} key/value heads replicated over tp={rin.degree(TP)} are supported in causal "
            "attention only; this scaled_dot_product_attention has a custom mask or dropout"
        )
    heads = (R, Shard(1) if rin.degree(TP) > 1 else R)
    inputs = {q: heads, k: heads, v: heads}
    if isinstance(mask, fx.Node):
        inputs[mask] = heads if rin.ndim(mask) == 4 and rin.shape(mask)[1] != 1 else (R, R)
    return Decision(output=heads, inputs=inputs, note="heads over tp")


register(packed_attention, packed_attention_rule)
register(aten.scaled_dot_product_attention, sdpa_rule)
