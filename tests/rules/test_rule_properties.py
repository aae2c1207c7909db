"""Linearity of kept Partials and shards that survive small local pieces, for every case of the
rule suite (``rule_properties``), and planted unsound rules that the properties catch."""

from __future__ import annotations

import pytest
import torch
from rule_cases import CASES
from rule_properties import partial_kept, small_shards
from rule_harness import Sample

from hgraph.rules import registry
from hgraph.rules.base import Decision
from hgraph.rules.elementwise import pointwise_decision
from hgraph.rules.shape import _dim_map_rule

aten = torch.ops.aten
ALL = [c for cases in CASES.values() for c in cases]
# the fused attention kernels take seconds per call in fp64: their linearity runs in the slow tier
HEAVY = [c for c in ALL if c.name.startswith(("packed_attention", "aten.scaled_dot_product_attention"))]
FAST = [c for c in ALL if c not in HEAVY]
SHAPE_OPS = {  # ops that drop, merge or move dims, on inputs with size-2 dims (tp pieces of size 1)
    "squeeze.default": (aten.squeeze.default, ()),
    "squeeze.dim": (aten.squeeze.dim, (0,)),
    "squeeze.dims": (aten.squeeze.dims, ([0, 2],)),
    "view": (aten.view.default, ([4, 1],)),
    "reshape": (aten.reshape.default, ([2, 2],)),
    "flatten": (aten.flatten.using_ints, (0, 1)),
    "unsqueeze": (aten.unsqueeze.default, (0,)),
    "transpose": (aten.transpose.int, (0, 1)),
    "select": (aten.select.int, (2, 0)),
    "sum": (aten.sum.dim_IntList, ([2],)),
    "amax": (aten.amax.default, ([1],)),
}


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("c", FAST, ids=[c.name for c in FAST])
def test_partial_is_kept_only_through_linear_ops(c):
    partial_kept(c.target, c.make(torch.Generator().manual_seed(0)), limit=12)


@pytest.mark.slow
@pytest.mark.parametrize("c", ALL, ids=[c.name for c in ALL])
def test_partial_is_kept_only_through_linear_ops_every_spec(c):
    partial_kept(c.target, c.make(torch.Generator().manual_seed(0)), limit=48)


@pytest.mark.parametrize("name", sorted(SHAPE_OPS))
def test_shards_survive_size_1_pieces(name):
    target, args = SHAPE_OPS[name]
    assert small_shards(target, Sample((rand(2, 2, 1), *args))) > 0


@pytest.fixture
def planted():
    """Replace one op's rule for a test, restoring it afterwards."""
    saved = {}

    def plant(op, rule):
        saved.setdefault(op, registry.lookup(op))
        registry.register(op, rule, replace=True)

    yield plant
    for op, rule in saved.items():
        registry.register(op, rule, replace=True)


def test_a_nonlinear_op_keeping_partial_fails(planted):
    planted(aten.abs, lambda node, rin: pointwise_decision(node, rin, rin.tensor_inputs(node), keep_partial=True))
    with pytest.raises(AssertionError, match="not linear"):
        partial_kept(aten.abs.default, Sample((rand(4, 4, 8),)))


def test_an_integer_cast_keeping_partial_fails(planted):
    planted(aten._to_copy, lambda node, rin: pointwise_decision(node, rin, rin.tensor_inputs(node)[:1], keep_partial=True))
    with pytest.raises(AssertionError, match="Partial torch.int64 output"):
        partial_kept(aten._to_copy.default, Sample((rand(4, 4, 8),), {"dtype": torch.int64}))


def test_a_local_shape_losing_a_cut_dim_fails(planted):
    def old_squeeze(node, rin) -> Decision:  # the rule of 4af1a81: the local op squeezes local size-1 dims too
        gone = {d for d, s in enumerate(rin.shape(node.args[0])) if s == 1}
        return _dim_map_rule(node, rin, lambda d: None if d in gone else d - sum(g < d for g in gone))

    planted(aten.squeeze, old_squeeze)
    with pytest.raises((AssertionError, RuntimeError)):
        small_shards(aten.squeeze.default, Sample((rand(2, 2, 1),)))  # (R, S(0)): tp pieces [1, 2, 1]
