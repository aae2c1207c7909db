"""Rule for ``aten.cross_entropy_loss``: vocab-parallel over tp, token-split over cp.

Logits cut on the vocab dim over tp become ``hgraph.runtime.kernels.vocab_parallel.vocab_parallel_cross_entropy``
(global max and sum-exp by all-reduce; the result is replicated); logits cut on tokens over cp give
a Partial loss that the output all-reduces. Only the summed loss (``reduction="sum"``) is
token-split exactly; a mean over split tokens would need the global token count.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from hgraph.core.placement import Partial, Shard
from hgraph.rules.base import TP, P, R, Decision, LowerContext, RuleInput
from hgraph.rules.registry import register
from hgraph.runtime.kernels.vocab_parallel import vocab_parallel_cross_entropy

aten = torch.ops.aten
_NONE, _MEAN, _SUM = 0, 1, 2


def cross_entropy_rule(node: fx.Node, rin: RuleInput) -> Decision:
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    a = {"weight": None, "reduction": _MEAN, "ignore_index": -100, "label_smoothing": 0.0}
    a.update(zip(names, node.args))
    a.update(node.kwargs)
    logits, target = a["input"], a["target"]
    if a["weight"] is not None or a["label_smoothing"] != 0.0:
        raise rin.error("cross entropy with class weights or label smoothing is not supported")
    nd = rin.ndim(logits)
    class_dim = 1 if nd > 1 else 0
    spec = rin.spec(logits)
    req_l, req_t, out = [R, R], [R, R], [R, R]
    vocab = False
    for m, p in enumerate(spec):
        if rin.degree(m) == 1 or not isinstance(p, Shard):
            continue  # Partial logits are reduced first, replicated ones stay
        d = p.dim % nd
        if d == class_dim and m == TP and nd == 2:
            req_l[m], vocab = p, True
        elif d != class_dim and nd == 2 and d == 0:
            req_l[m], req_t[m], out[m] = p, p, P
    if any(isinstance(o, Partial) for o in out) or vocab:
        if a["reduction"] != _SUM:
            raise rin.error(
                f"reduction={a['reduction']} over sharded logits; only the summed loss (reduction='sum', "
                "as hgraph's default loss) can be split over tp/cp"
            )
    inputs = {logits: (req_l[0], req_l[1]), target: (req_t[0], req_t[1])}
    if not vocab:
        return Decision(output=(out[0], out[1]), inputs=inputs)
    ignore_index = a["ignore_index"]

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        return lc.call(vocab_parallel_cross_entropy, (lc.local(logits), lc.local(target), "tp"),
                       {"ignore_index": ignore_index})

    return Decision(output=(out[0], out[1]), inputs=inputs, lower=lower, note="vocab-parallel")


register(aten.cross_entropy_loss, cross_entropy_rule)
