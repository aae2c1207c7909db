"""The rules of hgraph.rules.indexing (and baddbmm): each op run on tp shards as its decision says, then
assembled, equals the op on the whole tensors; reading across a cp-split token dim is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hgraph.errors import ShardingRuleError
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.rules import lookup
from hgraph.rules.base import RuleInput
from hgraph.rules.mesh import ShardingOptions

R = Replicate()
aten = torch.ops.aten
TP = 2


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _local(value: torch.Tensor, placement, rank: int) -> torch.Tensor:
    if isinstance(placement, Partial):  # pending sum: rank 0 holds the value, the others nothing
        return value if rank == 0 else torch.zeros_like(value)
    return value.chunk(TP, placement.dim)[rank] if isinstance(placement, Shard) else value


def check_on_tp(fn, inputs, placements, target, expect=None):
    """Decide ``target`` with the inputs on tp as ``placements``; run it per rank; compare with ``fn``."""
    gm = torch.export.export(_Fn(fn), tuple(inputs)).graph_module
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rin = RuleInput(ShardingOptions(tp=TP), {h: (R, p) for h, p in zip(holders, placements)}, set())
    values = dict(zip(holders, inputs))
    node = decision = None
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        rin.node = n
        d = lookup(n.target)(n, rin)
        rin._specs[n] = d.output
        if n.target == target:
            node, decision = n, d
            break
        values[n] = n.target(*torch.fx.map_arg(n.args, values.get), **n.kwargs)
    assert node is not None, f"no {target} in the graph"
    if expect is not None:
        assert decision.output[1] == expect
    full = node.target(*torch.fx.map_arg(node.args, values.get), **node.kwargs)
    args = decision.args if decision.args is not None else node.args
    kwargs = decision.kwargs if decision.kwargs is not None else node.kwargs
    outs = []
    for rank in range(TP):
        local = {n: _local(values[n], decision.inputs.get(n, rin.spec(n))[1], rank) for n in values}
        outs.append(node.target(*torch.fx.map_arg(args, local.get), **torch.fx.map_arg(kwargs, local.get)))
    placement = decision.output[1]
    if isinstance(placement, Shard):
        got = torch.cat(outs, dim=placement.dim)
    elif isinstance(placement, Partial):
        got = sum(outs)
    else:
        got = outs[0]
        torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(got, full)
    return decision


x46 = torch.arange(24.0).reshape(4, 6) ** 2


@pytest.mark.parametrize("placement, expect", [(Shard(0), Shard(0)), (Shard(1), R)])
def test_diff(placement, expect):
    check_on_tp(lambda t: torch.diff(t, dim=-1), [x46], [placement], aten.diff.default, expect)


def test_diff_with_prepend():
    fn = lambda t: torch.diff(t, dim=1, prepend=t[:, :1] - 1)  # noqa: E731
    check_on_tp(fn, [x46], [Shard(0)], aten.diff.default, Shard(0))


@pytest.mark.parametrize("placement, expect", [(Shard(0), Shard(0)), (Shard(1), R)])
def test_cumsum(placement, expect):
    check_on_tp(lambda t: torch.cumsum(t, dim=1), [x46], [placement], aten.cumsum.default, expect)


@pytest.mark.parametrize("placement, expect", [(Shard(2), Shard(3)), (Shard(1), R), (Partial(), Partial())])
def test_repeat(placement, expect):
    x = torch.randn(2, 4, 6)
    check_on_tp(lambda t: t.repeat(3, 1, 2, 1), [x], [placement], aten.repeat.default, expect)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)])
def test_repeat_interleave_keeps_a_shard_of_its_dim(placement):
    x = torch.randn(4, 8)
    fn = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731
    check_on_tp(fn, [x], [placement], aten.repeat_interleave.self_int, placement)


def test_repeat_interleave_without_dim_needs_the_whole_tensor():
    check_on_tp(lambda t: t.repeat_interleave(2), [x46], [Shard(0)], aten.repeat_interleave.self_int, R)


@pytest.mark.parametrize("placement, expect", [(Shard(0), Shard(1)), (Shard(1), Shard(0))])
def test_numpy_t(placement, expect):
    check_on_tp(lambda t: t.T, [x46], [placement], aten.numpy_T.default, expect)


def test_index_by_a_sharded_index_is_sharded_like_it():
    table, index = torch.randn(16, 8), torch.randint(0, 16, (2, 6))
    check_on_tp(lambda t, i: t[i], [table, index], [R, Shard(1)], aten.index.Tensor, Shard(1))


@pytest.mark.parametrize("placement, expect", [(Shard(0), Shard(0)), (Shard(1), R), (Shard(2), Shard(3))])
def test_index_keeps_shards_of_dims_it_does_not_select(placement, expect):
    x, rows, cols = torch.randn(4, 16, 6), torch.randint(0, 16, (2, 3)), torch.randint(0, 6, (2, 3))
    check_on_tp(lambda t, i: t[:, i], [x, rows], [placement, R], aten.index.Tensor,
                expect if placement != Shard(2) else Shard(3))
    if placement == Shard(0):  # non-adjacent indexed dims: index dims go first
        check_on_tp(lambda t, i, j: t[i, :, j], [x, rows % 4, cols], [Shard(1), R, R], aten.index.Tensor, Shard(2))


def test_baddbmm_follows_the_batched_product():
    bias, b1, b2 = torch.randn(4, 1, 6), torch.randn(4, 6, 8), torch.randn(4, 8, 6)
    fn = lambda a, b, c: torch.baddbmm(a, b, c, beta=0.5, alpha=2.0)  # noqa: E731
    check_on_tp(fn, [bias, b1, b2], [R, Shard(0), Shard(0)], aten.baddbmm.default, Shard(0))


def test_reading_across_cp_split_tokens_is_refused():
    gm = torch.export.export(_Fn(lambda t: torch.diff(t, dim=1)), (x46,)).graph_module
    holder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    node = next(n for n in gm.graph.nodes if n.target == aten.diff.default)
    rin = RuleInput(ShardingOptions(cp=2), {holder: (Shard(1), R)}, set())
    rin.node = node
    with pytest.raises(ShardingRuleError, match="context parallelism"):
        lookup(node.target)(node, rin)
