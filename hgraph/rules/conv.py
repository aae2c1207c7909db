"""Rules for 1-d convolutions over the sequence (the short causal convolutions of Gated DeltaNet,
Mamba and LFM2 mixers: depthwise, ``groups == channels``).

``conv1d(x [b, c_in, l], w [c_out, c_in/groups, k], bias, stride, padding, dilation, groups)``.
Under tp the channels are split by groups, as Megatron splits them for Mamba: with ``groups``
divisible by tp, each rank convolves ``groups/tp`` whole groups (``x`` cut on channels, ``w`` and
``bias`` on output channels, ``groups`` rewritten to the local count); a dense convolution
(``groups == 1``) is column-parallel (output channels cut, ``x`` whole). The convolved length dim
reads neighbouring tokens, so it is never cut: a cp split of it is refused, naming the op — the
convolution would need the tokens of the neighbouring chunks.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from hgraph.core.placement import Shard
from hgraph.rules.base import CP, TP, R, Decision, RuleInput
from hgraph.rules.registry import register

aten = torch.ops.aten


def conv1d_rule(node: fx.Node, rin: RuleInput) -> Decision:
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    padding = "valid" if node.target is aten.conv1d.padding else [0]  # the overload's own default
    defaults = (None, [1], padding, [1], 1)[len(node.args) - 2:]
    args = [*node.args, *(node.kwargs.get(n, d) for n, d in zip(names[len(node.args):], defaults))]
    x, w, bias, groups = args[0], args[1], args[2], args[6]
    nd = rin.ndim(x)
    channels, length = nd - 2, nd - 1
    req_x = [R, R]
    for m, p in enumerate(rin.spec(x)):
        if isinstance(p, Shard) and p.dim % nd == length and m == CP and rin.degree(CP) > 1:
            raise rin.error(
                "a convolution over the sequence reads the tokens before each one, and context parallelism "
                "splits the sequence into load-balanced chunks; use a strategy without cp for this model"
            )
        if isinstance(p, Shard) and p.dim % nd < channels:
            req_x[m] = p  # the batch dim of a batched input stays cut
    req_w, req_b, out = [R, R], [R, R], list(req_x)
    tp = rin.degree(TP)
    out_channels = rin.shape(w)[0]
    if tp > 1 and not isinstance(req_x[TP], Shard):
        if groups % tp == 0:
            req_x[TP], out[TP] = Shard(channels), Shard(channels)
            req_w[TP] = req_b[TP] = Shard(0)
            args[6] = groups // tp
        elif groups == 1 and out_channels % tp == 0:
            out[TP] = Shard(channels)
            req_w[TP] = req_b[TP] = Shard(0)
    inputs = {x: (req_x[0], req_x[1]), w: (req_w[0], req_w[1])}
    if isinstance(bias, fx.Node):
        inputs[bias] = (req_b[0], req_b[1])
    note = "channels over tp" if isinstance(out[TP], Shard) and out[TP].dim == channels else ""
    return Decision(output=(out[0], out[1]), inputs=inputs, args=tuple(args), kwargs={}, note=note)


register(aten.conv1d, conv1d_rule)
