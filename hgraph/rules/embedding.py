"""Rule for ``aten.embedding``: vocab-parallel on tp (Megatron), token-split on cp.

With ``vocab_parallel`` (the default) the table is cut on its rows over tp and every rank looks up
the ids that fall in its rows (``hgraph.runtime.kernels.vocab_parallel.vocab_parallel_embedding``): the output is
Partial and is reduced by its first consumer (all-reduce, or reduce-scatter to the sequence dim
under sequence parallelism). Tables indexed by the position ids (GPT-2's ``wpe``) stay replicated:
their output would need the same reduction for no saving in compute. A ``padding_idx`` row gets no
gradient, as in ``nn.Embedding``: the rank holding that row masks it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from hgraph.core.placement import Shard
from hgraph.rules.base import CP, TP, P, R, Decision, LowerContext, RuleInput
from hgraph.rules.registry import register
from hgraph.runtime.kernels.vocab_parallel import vocab_parallel_embedding

aten = torch.ops.aten


def _reads_position_ids(node: fx.Node, name: str) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name == name:
                return True
            continue
        stack.extend(n.all_input_nodes)
    return False


def embedding_rule(node: fx.Node, rin: RuleInput) -> Decision:
    weight, ids = node.args[0], node.args[1]
    padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    if node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse", False):
        raise rin.error("sparse=True makes the table's gradient a sparse tensor, which the gradient push and "
                        "the ZeRO optimizer do not take; build the embedding with sparse=False "
                        "(nn.Embedding's default)")
    if _scales_by_frequency(node):
        # each word's gradient is divided by its count over all ids: with ids cut, each rank would
        # count only its own, so the lookup runs whole on every rank
        return Decision(output=(R, R), inputs={weight: (R, R), ids: (R, R)}, note="scale_grad_by_freq")
    ids_spec = rin.spec(ids)
    req_ids, req_w, out = [R, R], [R, R], [R, R]
    cp_place = ids_spec[CP]
    if rin.degree(CP) > 1 and isinstance(cp_place, Shard):
        req_ids[CP] = out[CP] = cp_place
    vocab = (
        rin.degree(TP) > 1
        and rin.options.vocab_parallel
        and not _reads_position_ids(ids, rin.options.position_ids)
        and (rin.is_free(weight) or rin.spec(weight)[TP] == Shard(0))
    )
    if vocab:
        rows = rin.shape(weight)[0]
        if rows % rin.degree(TP):
            raise rin.error(f"vocabulary of {rows} rows cannot be split over tp={rin.degree(TP)}")
        req_w[TP], out[TP] = Shard(0), P
    elif rin.degree(TP) > 1 and isinstance(ids_spec[TP], Shard):
        req_ids[TP] = out[TP] = ids_spec[TP]
    inputs = {weight: (req_w[0], req_w[1]), ids: (req_ids[0], req_ids[1])}
    if not vocab:
        return Decision(output=(out[0], out[1]), inputs=inputs)

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        padding = (padding_idx,) if padding_idx is not None and padding_idx >= 0 else ()
        return lc.call(vocab_parallel_embedding, (lc.local(ids), lc.local(weight), "tp", *padding))

    return Decision(output=(out[0], out[1]), inputs=inputs, lower=lower, note="vocab-parallel")


def _scales_by_frequency(node: fx.Node) -> bool:
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq", False))


register(aten.embedding, embedding_rule)
