"""Single sharding rules on small exported graphs, the view grouping and the registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hgraph.errors import ShardingRuleError
from hgraph.core.placement import InterleavedShard, Partial, Replicate, Shard, StridedShard
from hgraph.rules import lookup, register, registered_ops
from hgraph.rules.base import RuleInput
from hgraph.rules.mesh import ShardingOptions
from hgraph.rules.shape import view_groups

R, P = Replicate(), Partial()
aten = torch.ops.aten


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def decide(fn, inputs, specs, target, nth=0, dynamic=False, **options):
    """Export ``fn(*inputs)`` (dim 1 of the first input symbolic when ``dynamic``), give its
    placeholders ``specs``, propagate, and return the decision of the ``nth`` ``target`` node."""
    shapes = None
    if dynamic:
        shapes = ({1: torch.export.Dim("seq")},) + tuple(None for _ in inputs[1:])
    gm = torch.export.export(_Fn(fn), tuple(inputs), dynamic_shapes=(shapes,) if shapes else None).graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rin = RuleInput(ShardingOptions(**options), dict(zip(placeholders, specs)), set())
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        rin.node = node
        decision = lookup(node.target)(node, rin)
        rin._specs[node] = decision.output
        if node.target == target:
            if nth == 0:
                return node, decision, placeholders
            nth -= 1
    raise AssertionError(f"no {target} in the graph")


def test_view_groups():
    assert view_groups((2, 8, 32), (2, 8, 4, 8)) == [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]
    assert view_groups((2, 8, 4, 8), (16, 32)) == [((0, 1), (0,)), ((2, 3), (1,))]
    assert view_groups((6,), (2, 3, 1)) == [((0,), (0, 1)), ((), (2,))]
    with pytest.raises(ValueError, match="numbers of elements"):
        view_groups((6,), (4,))


def test_view_splitting_heads_divides_the_constant():
    x = torch.randn(2, 8, 32)
    node, d, _ = decide(lambda t: t.view(2, 8, 4, 8), [x], [(R, Shard(2))], aten.view.default, tp=2)
    assert d.output == (R, Shard(2))
    assert d.args[1] == [2, 8, 2, 8]


def test_view_heads_not_divisible_raises():
    x = torch.randn(2, 8, 24)
    with pytest.raises(ShardingRuleError, match="dim 2 of size 3.*not divisible by 4"):
        decide(lambda t: t.view(2, 8, 3, 8), [x], [(R, Shard(2))], aten.view.default, tp=4)


def test_view_of_fewer_heads_than_tp_ranks_gathers():
    """tp a multiple of the heads (4 ranks, 2 key/value heads): each rank needs a whole head, so the
    projection is gathered rather than cut (tests/compiler/test_localize.py checks the values)."""
    x = torch.randn(2, 8, 16)
    _, d, _ = decide(lambda t: t.view(2, 8, 2, 8), [x], [(R, Shard(2))], aten.view.default, tp=4)
    assert d.output == (R, R)


def test_flatten_of_cp_tokens_is_strided_and_unflattens_back():
    x = torch.randn(2, 8, 4)
    _, d, _ = decide(lambda t: t.flatten(0, 1), [x], [(Shard(1), R)], aten.flatten.using_ints, cp=2)
    assert d.output == (StridedShard(0, split_factor=2), R)
    _, d, _ = decide(lambda t: t.flatten(0, 1).view(2, 8, 4), [x], [(Shard(1), R)], aten.view.default, cp=2)
    assert d.output == (Shard(1), R)


def test_merging_tp_sharded_inner_dim_keeps_it_strided():
    """Rows merged from [b, s/tp] stay cut (a tp StridedShard), no gather; an op that needs the rows
    whole gets them gathered in order (tests/compiler/test_strided_shard.py runs it end to end)."""
    x = torch.randn(2, 8, 4)
    node, d, (ph,) = decide(lambda t: t.flatten(0, 1), [x], [(R, Shard(1))], aten.flatten.using_ints, tp=2)
    assert d.inputs[ph] == (R, Shard(1)) and d.output == (R, StridedShard(0, split_factor=2))
    _, d, _ = decide(lambda t: t.flatten(0, 1).sum(0), [x], [(R, Shard(1))], aten.sum.dim_IntList, tp=2)
    assert d.output == (R, R)


def test_broadcast_weight_stays_replicated():
    x, w = torch.randn(2, 8, 16), torch.randn(16)
    _, d, (px, pw) = decide(lambda a, b: a * b, [x, w], [(Shard(1), Shard(1)), (R, R)], aten.mul.Tensor, cp=2, tp=2)
    assert d.output == (Shard(1), Shard(1))
    assert d.inputs[pw] == (R, R) and d.inputs[px] == (Shard(1), Shard(1))


def test_partial_is_reduced_before_a_nonlinear_op():
    x, y = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    _, d, (px, py) = decide(lambda a, b: a + b, [x, y], [(R, P), (R, R)], aten.add.Tensor, tp=2)
    assert d.inputs[px] == (R, R) and d.output == (R, R)
    _, d, (px, py) = decide(lambda a, b: a + b, [x, y], [(R, P), (R, R)], aten.add.Tensor, tp=2, sequence_parallel=True)
    assert d.inputs[px] == (R, Shard(1)) and d.inputs[py] == (R, Shard(1)) and d.output == (R, Shard(1))
    _, d, (px,) = decide(lambda a: a.clone(), [x], [(R, P)], aten.clone.default, tp=2)
    assert d.output == (R, P)  # copies keep pending sums


def test_reductions_over_a_sharded_dim():
    x = torch.randn(2, 8, 16)
    _, d, (px,) = decide(lambda a: a.sum(-1), [x], [(Shard(1), Shard(2))], aten.sum.dim_IntList, cp=2, tp=2)
    assert d.output == (Shard(1), P)
    _, d, (px,) = decide(lambda a: a.mean(-1, keepdim=True), [x], [(R, Shard(2))], aten.mean.dim, tp=2)
    assert d.inputs[px] == (R, R)
    _, d, (px,) = decide(lambda a: a.softmax(-1), [x], [(Shard(1), Shard(2))], aten.softmax.int, cp=2, tp=2)
    assert d.inputs[px] == (Shard(1), R) and d.output == (Shard(1), R)


def test_linear_column_then_row_parallel():
    x, w1, w2 = torch.randn(2, 8, 16), torch.randn(32, 16), torch.randn(16, 32)
    fn = lambda a, b, c: torch.nn.functional.linear(torch.nn.functional.linear(a, b), c)  # noqa: E731
    specs = [(R, R), (R, Shard(0)), (R, Shard(1))]
    _, d, _ = decide(fn, [x, w1, w2], specs, aten.linear.default, tp=2)
    assert d.output == (R, Shard(2)) and d.note == "column-parallel"
    _, d, (px, pw1, pw2) = decide(fn, [x, w1, w2], specs, aten.linear.default, nth=1, tp=2)
    assert d.output == (R, P) and d.note == "row-parallel" and d.inputs[pw2] == (R, Shard(1))


def test_cat_along_sharded_dim_is_interleaved_or_gathers():
    """Pieces all cut along the cat dim stay cut: the result is an InterleavedShard (each rank holds its
    part of every piece); a piece that is whole makes the cut ones gather."""
    a, b = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    _, d, (pa, pb) = decide(lambda x, y: torch.cat([x, y], -1), [a, b], [(R, Shard(2)), (R, Shard(2))], aten.cat.default, tp=2)
    assert d.inputs[pa] == (R, Shard(2)) and d.output == (R, InterleavedShard(2, (8, 8)))
    _, d, (pa, pb) = decide(lambda x, y: torch.cat([x, y], -1), [a, b], [(R, Shard(2)), (R, R)], aten.cat.default, tp=2)
    assert d.inputs[pa] == (R, R) and d.output == (R, R)
    _, d, (pa, pb) = decide(lambda x, y: torch.cat([x, y], -1), [a, b], [(R, Shard(1)), (R, R)], aten.cat.default, tp=2)
    assert d.inputs[pb] == (R, Shard(1)) and d.output == (R, Shard(1))


def test_registry():
    assert lookup(aten.add.Tensor) is lookup(aten.add.Scalar)  # registered by overload packet
    assert "aten.linear" in registered_ops() and "hgraph.runtime.kernels.packed_attention.packed_attention" in registered_ops()
    with pytest.raises(ShardingRuleError, match="already has a sharding rule"):
        register(aten.add, lambda node, rin: None)
    with pytest.raises(ShardingRuleError, match="must be callable"):
        register(aten.cumsum, "not a rule")


def test_factory_sized_by_a_sharded_dim_is_refused():
    x = torch.randn(2, 8, 4)
    fn = lambda t: t + torch.arange(t.shape[1]).unsqueeze(-1)  # noqa: E731
    _, d, (px,) = decide(fn, [x], [(Shard(1), R)], aten.add.Tensor, cp=2)  # static: arange(8) is global
    assert d.output == (Shard(1), R)
    with pytest.raises(ShardingRuleError, match="local size of a sharded dim"):
        decide(fn, [x], [(Shard(1), R)], aten.add.Tensor, dynamic=True, cp=2)
