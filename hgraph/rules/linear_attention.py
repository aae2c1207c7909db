"""Rules for linear-attention layers over packed sequences (``hgraph.runtime.kernels.linear_attention``).

``packed_gated_delta_rule(q, k, v, g, beta, position_ids)`` (q, k ``[b, s, hk, dk]``; v ``[b, s, hv,
dv]``; g, beta ``[b, s, hv]``): every head has its own memory, so tp splits the heads — contiguous
ranges keep each k head with the ``hv/hk`` v heads it serves, so both counts must divide by tp (else
the rule computes every head on every rank). ``packed_causal_conv1d(x [b, c, s], w [c, 1, k], bias,
position_ids)``: every channel is convolved alone, so tp splits the channels in whatever order they
arrive — a plain shard, or the blocks of a fused projection (``InterleavedShard``: q, k and v
channels of each rank's heads) — with the weight and bias cut alike.

Both carry state along the sequence. Context parallelism would need each rank to start from the
state the previous chunks leave (a scan across ranks), which is not implemented: a cp split of the
sequence is refused, naming the layer.
"""

from __future__ import annotations

import torch.fx as fx

from hgraph.core.placement import InterleavedShard, Partial, Shard
from hgraph.rules.base import CP, TP, R, Decision, RuleInput, interleave_aware
from hgraph.rules.registry import register
from hgraph.runtime.kernels.linear_attention import packed_causal_conv1d, packed_gated_delta_rule



def _refuse_cp(rin: RuleInput, tensors: list[fx.Node], seq_dim: int, what: str) -> None:
    for t in tensors:
        p = rin.spec(t)[CP]
        if rin.degree(CP) > 1 and isinstance(p, Shard) and p.dim % rin.ndim(t) == seq_dim:
            raise rin.error(
                f"{what} carries a state along the sequence, and context parallelism of a recurrence (each "
                "cp rank starting from the state the earlier chunks leave) is not implemented; use a strategy "
                "without cp for this model"
            )


def gated_delta_rule_rule(node: fx.Node, rin: RuleInput) -> Decision:
    q, k, v, g, beta, positions = node.args[:6]
    _refuse_cp(rin, [q, k, v, g, beta], 1, "the gated delta rule (Gated DeltaNet)")
    tp = rin.degree(TP)
    split = tp > 1 and rin.shape(q)[2] % tp == 0 and rin.shape(v)[2] % tp == 0
    heads = (R, Shard(2) if split else R)
    inputs = {t: heads for t in (q, k, v, g, beta)}
    inputs[positions] = (R, R)
    return Decision(output=heads, inputs=inputs, note="heads over tp" if split else "")


@interleave_aware
def causal_conv1d_rule(node: fx.Node, rin: RuleInput) -> Decision:
    x, weight, bias, positions = node.args[:4]
    _refuse_cp(rin, [x], 2, "a causal convolution over the sequence")
    p = rin.spec(x)[TP]
    channels = rin.shape(x)[1]
    if rin.degree(TP) == 1:
        out, param = R, R
    elif isinstance(p, InterleavedShard) and p.dim % 3 == 1:
        out, param = p, InterleavedShard(0, p.blocks)
    elif channels % rin.degree(TP) == 0 and not isinstance(p, Partial):
        out, param = Shard(1), Shard(0)
    else:
        out, param = R, R
    inputs = {x: (R, out), weight: (R, param), positions: (R, R)}
    if isinstance(bias, fx.Node):
        inputs[bias] = (R, param)
    return Decision(output=(R, out), inputs=inputs, note="channels over tp" if out != R else "")


register(packed_gated_delta_rule, gated_delta_rule_rule)
register(packed_causal_conv1d, causal_conv1d_rule)
