"""Rules for mixture-of-experts layers (Mixtral, Qwen2-MoE as HuggingFace traces them).

Routing stays replicated on tp: ``topk``, ``sort``, ``cumsum`` need their whole dim, ``histc`` and
``nonzero`` (``torch.where(mask)``) the whole tensor, and ``index``/``index_put_`` permute tokens. The
experts are sharded like dense FFNs: ``transformers::grouped_mm_fallback(tokens, weight [E, in, out],
offsets)`` is column-parallel when its tokens are replicated (the gate/up projection, each block cut
when its output is chunked into gate and up) and row-parallel when they are cut on features (the down
projection, output Partial). On cp the routed tokens would be split, and sorting them needs them all:
those specs are refused by ``localize`` with a clear error.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from hgraph.core.placement import InterleavedShard, Partial, Shard
from hgraph.rules.base import CP, REPLICATED, TP, P, R, Decision, RuleInput, Spec
from hgraph.rules.elementwise import pointwise_decision
from hgraph.rules.linear import fused_blocks
from hgraph.rules.registry import register, register_by_name

aten = torch.ops.aten


def _whole_dim(spec: Spec, dim: int, ndim: int) -> Spec:
    """``spec`` with Partial and any shard of ``dim`` replaced by R."""
    out = [R if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim % ndim == dim) else p for p in spec]
    return (out[0], out[1])


def topk_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """topk / sort (values, indices), argsort and cumsum: the op's dim whole on every rank, other dims kept."""
    x = node.args[0]
    nd = rin.ndim(x)
    if node.target is aten.topk.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    elif node.target is aten.cumsum.default:
        dim = node.args[1]
    else:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    spec = _whole_dim(rin.spec(x), dim % nd, nd)
    out = (spec, spec) if isinstance(node.meta.get("val"), (list, tuple)) else spec
    return Decision(output=out, inputs={x: spec})


def whole_tensor_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """histc and other reductions of every element: the whole tensor on every rank."""
    return Decision(output=REPLICATED, inputs={t: REPLICATED for t in rin.tensor_inputs(node)})


def nonzero_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``nonzero(x)`` and one-argument ``where(x)`` (a tuple of index tensors, as routing by
    ``torch.where(expert_mask)`` calls it): the positions of every element, on whole tensors."""
    val = node.meta.get("val")
    out = tuple(REPLICATED for _ in val) if isinstance(val, (list, tuple)) else REPLICATED
    return Decision(output=out, inputs={t: REPLICATED for t in rin.tensor_inputs(node)})


def index_put_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """In-place ``x[idx] = values``: only on replicated tensors (a conversion would write a copy)."""
    x = node.args[0]
    if rin.spec(x) != REPLICATED:
        raise rin.error(f"in-place index_put_ on {x.name}, which is not replicated ({rin.spec(x)}); not supported")
    return Decision(output=REPLICATED, inputs={t: REPLICATED for t in rin.tensor_inputs(node)})


def index_put_rule_functional(node: fx.Node, rin: RuleInput) -> Decision:
    """``index_put(x, idx, values)`` (the functional form): scattered rows, computed on whole tensors."""
    return Decision(output=REPLICATED, inputs={t: REPLICATED for t in rin.tensor_inputs(node)})


def inplace_pointwise_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """``div_``/``mul_``/...: the pointwise rule, as long as the mutated tensor keeps its spec."""
    x = node.args[0]
    decision = pointwise_decision(node, rin, rin.tensor_inputs(node))
    if decision.inputs.get(x) != rin.spec(x):
        raise rin.error(
            f"in-place {node.target} would have to convert {x.name} first ({rin.spec(x)} -> "
            f"{decision.inputs.get(x)}), which would write a copy; not supported"
        )
    return decision


def grouped_mm_rule(node: fx.Node, rin: RuleInput) -> Decision:
    """Per-expert matmul of expert-sorted tokens ``[S, in]`` with ``[E, in, out]`` (see module doc).
    On the expert mesh of expert parallelism (``hgraph.rules.experts``) the rows, offsets and weights
    are those of this rank's experts: ``S(0)`` on ep, and the tp logic below runs on etp."""
    x, w, offs = node.args[:3]
    xs = rin.spec(x)
    pw = None if rin.is_free(w) else rin.spec(w)[TP]
    px = xs[TP]
    req_x, req_w, out = [R, R], [R, R], [R, R]
    req_offs = REPLICATED
    if rin.options.expert_parallel and xs[CP] == Shard(0):
        req_x[CP] = req_w[CP] = out[CP] = Shard(0)
        req_offs = (Shard(0), R)
    if rin.degree(TP) > 1:
        if isinstance(px, Shard) and not isinstance(px, InterleavedShard) and px.dim % 2 == 1 and (pw is None or pw == Shard(1)):
            req_x[TP], req_w[TP], out[TP] = Shard(1), Shard(1), P  # row-parallel: the down projection
        elif pw is None or (isinstance(pw, Shard) and pw.dim % 3 == 2):
            blocks = pw.blocks if isinstance(pw, InterleavedShard) else fused_blocks(node, rin) if pw is None else None
            if blocks:
                req_w[TP], out[TP] = InterleavedShard(2, blocks), InterleavedShard(1, blocks)
            else:
                req_w[TP], out[TP] = Shard(2), Shard(1)
    return Decision(
        output=(out[0], out[1]),
        inputs={x: (req_x[0], req_x[1]), w: (req_w[0], req_w[1]), offs: req_offs},
        note="experts row-parallel" if out[TP] == P else "experts column-parallel" if isinstance(out[TP], Shard) else "",
    )


for _op in (aten.topk, aten.sort, aten.argsort):  # cumsum: hgraph.rules.indexing
    register(_op, topk_rule)
register(aten.histc, whole_tensor_rule)
register(aten.bincount, whole_tensor_rule)  # its length is the largest value: counted over every element
register(aten.nonzero, nonzero_rule)
register(aten.where.default, nonzero_rule)  # where(cond, x, y) is pointwise: hgraph.rules.elementwise
register(aten.index_put_, index_put_rule)
register(aten.index_put, index_put_rule_functional)
for _name in ("div_", "mul_", "add_", "sub_"):
    register(getattr(aten, _name), inplace_pointwise_rule)


register_by_name("transformers::grouped_mm_fallback", grouped_mm_rule)
