"""Rules for expert parallelism's token movement (``hgraph.runtime.kernels.expert_dispatch``).

``hgraph.passes.experts`` rewrites each MoE layer into ``permute_tokens -> dispatch -> expert body ->
combine -> unpermute_tokens``. The layer as a whole is token-wise, so it takes its tokens in whatever
split they come (token dim 0 cut on cp, on tp under sequence parallelism) and returns its result in
that same split. Every rank must route distinct tokens: on a mesh dim where the tokens are replicated
(tp without sequence parallelism) the local program takes this rank's share first (``token_chunk``)
and gathers the results back (``token_gather``), so the layer's input and output keep their specs.

Between ``dispatch`` and ``combine`` the rows live on the expert mesh ``(ep, etp)``: rows ``(S(0), R)``
(this rank's experts' rows, whole on etp), offsets ``(S(0), R)``; the grouped matmul rule
(``hgraph.rules.moe``) then cuts the weights ``S(0)`` on ep. Intermediate values outside the expert
mesh are labelled honestly: pair rows and their order ``S(0)`` where tokens are split, the per-expert
counts ``P`` there (the global count is their sum).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.rules.base import CP, Decision, example_size, local_shape, LowerContext, R, RuleInput, Spec, spec_str, TP
from hgraph.rules.mesh import ShardingOptions
from hgraph.rules.registry import register
from hgraph.runtime.kernels.expert_dispatch import (
    combine,
    dispatch,
    expert_combine,
    expert_dispatch,
    permute_tokens,
    token_chunk,
    token_gather,
    unpermute_tokens,
)

EXPERT_ROWS: Spec = (Shard(0), R)


def _token_spec(spec: Spec) -> Spec:
    """The spec a token-wise layer takes its ``[N, ...]`` input in: token shards kept, else whole."""
    kept = [p if isinstance(p, Shard) and p.dim == 0 else R for p in spec]
    return (kept[0], kept[1])


def _replicated_dims(tokens: Spec, rin: RuleInput) -> list[int]:
    """Mesh dims on which every rank holds the same tokens (each must take its own share)."""
    return [m for m in (CP, TP) if rin.degree(m) > 1 and isinstance(tokens[m], Replicate)]


def _split(rin: RuleInput, placement_if_split: object) -> Spec:
    out = [placement_if_split if rin.degree(m) > 1 else R for m in (CP, TP)]
    return (out[0], out[1])  # type: ignore[return-value]


def _mark(node: fx.Node, op: str, mesh_dim: str, src: str, dst: str, tensor: str, nbytes: int, direction: str = "forward") -> fx.Node:
    """Describe an inserted communication node as ``localize`` does (``meta["hgraph_comm"]``)."""
    node.meta["hgraph_comm"] = {"kind": "communicate_activation", "op": op, "mesh_dim": mesh_dim, "src": src,
                                "dst": dst, "tensor": tensor, "bytes": int(nbytes), "direction": direction}
    return node


def _local_bytes(node: fx.Node, spec: Spec, rin: RuleInput | ShardingOptions) -> int:
    """Bytes of ``node``'s local value at the example shapes (balanced routing for expert rows)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    options = rin if isinstance(rin, ShardingOptions) else rin.options
    shape = tuple(example_size(s) for s in val.shape)
    return val.dtype.itemsize * math.prod(local_shape(shape, spec, options.degrees))


def permute_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``permute_tokens(x, top_k_index, E)``: this rank's tokens' pairs sorted by expert."""
    x, index, num_experts = node.args[:3]
    tokens = _token_spec(rin.spec(x))
    shared = _replicated_dims(tokens, rin)
    names = rin.options.mesh_names
    rows = _split(rin, Shard(0))

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        local_x, local_index = lc.local(x), lc.local(index)
        for m in shared:
            local_x = _mark(lc.call(token_chunk, (local_x, names[m])), "token_chunk", names[m], "R", "S(0)", x.name, 0)
            local_index = lc.call(token_chunk, (local_index, names[m]))
        return lc.call(permute_tokens, (local_x, local_index, num_experts))

    return Decision(
        output=(rows, _split(rin, Partial()), rows),
        inputs={x: tokens, index: tokens},
        lower=lower,
        note="tokens sorted by expert",
        exact_grad={x: (CP, TP)},
    )


def dispatch_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``dispatch(rows, counts)``: rows to the ranks of their experts (all-to-all over ep)."""
    rows, counts = node.args[:2]
    spec = rin.spec(rows)
    nbytes = _local_bytes(rows, spec, rin)

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        out = lc.call(expert_dispatch, (lc.local(rows), lc.local(counts)))
        return _mark(out, "expert_dispatch", "ep", spec_str(spec), "ep:" + spec_str(EXPERT_ROWS), rows.name, nbytes)

    return Decision(
        output=(EXPERT_ROWS, EXPERT_ROWS, (R, R)),
        inputs={rows: spec},
        lower=lower,
        note="dispatch: all-to-all over ep",
        exact_grad={rows: (CP, TP)},
    )


def combine_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``combine(rows_e, order, counts, layout)``: each rank's own rows of the experts' results
    (reduce-scattered over etp when the experts' output is a pending sum there), back to where they
    came from (all-to-all over ep), in the split ``permute_tokens`` made."""
    rows_e, order, counts, layout = node.args[:4]
    out = rin.specs_of(order)
    spec = rin.specs_of(rows_e)
    if spec is None or isinstance(spec[0], tuple) or spec[0] != Shard(0) or isinstance(spec[1], Shard):
        raise rin.error(f"the experts' result {rows_e.name} is {spec_str(spec)} on the expert mesh; combine "
                        "takes this rank's experts' rows, whole or a pending sum over etp: (S(0),R) or (S(0),P)")
    partial = isinstance(spec[1], Partial)
    nbytes = _local_bytes(rows_e, EXPERT_ROWS, rin.options.experts())

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        call = lc.call(expert_combine, (lc.local(rows_e), lc.local(order), lc.local(counts), lc.local(layout), partial))
        return _mark(call, "expert_combine", "ep", "ep:" + spec_str(spec), spec_str(out), rows_e.name, nbytes)

    return Decision(output=out, lower=lower, note="combine: all-to-all over ep" + (", reduce-scatter over etp" if partial else ""))


def unpermute_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``unpermute_tokens(rows, order, top_k_weights)``: each token's weighted sum, in its input split."""
    rows, order, weights = node.args[:3]
    tokens = _token_spec(rin.spec(weights))
    shared = _replicated_dims(tokens, rin)
    names = rin.options.mesh_names
    val = node.meta.get("val")
    nbytes = _local_bytes(node, _split(rin, Shard(0)), rin) if isinstance(val, torch.Tensor) else 0

    def lower(lc: LowerContext, n: fx.Node) -> fx.Node:
        shares = [lc.local(weights)]  # the weights before each token_chunk: the row count to gather back to
        for m in shared:
            shares.append(lc.call(token_chunk, (shares[-1], names[m])))
        out = lc.call(unpermute_tokens, (lc.local(rows), lc.local(order), shares[-1]))
        for m, like in zip(reversed(shared), reversed(shares[:-1])):
            out = _mark(lc.call(token_gather, (out, like, names[m])), "token_gather", names[m], "S(0)", "R", n.name, nbytes)
        return out

    return Decision(
        output=tokens,
        inputs={rows: rin.spec(rows), weights: tokens},
        lower=lower,
        note="tokens back from experts",
        exact_grad={rows: (CP, TP), weights: (CP, TP)},
    )


register(permute_tokens, permute_rule)
register(dispatch, dispatch_rule)
register(combine, combine_rule)
register(unpermute_tokens, unpermute_rule)
