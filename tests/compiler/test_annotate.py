"""The annotate pass: Megatron placements chosen by propagation, gradient placements, and errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hgraph import models
from hgraph.errors import ShardingRuleError
from hgraph.frontend import trace
from hgraph.core.placement import InterleavedShard, Partial, Replicate, Shard
from hgraph.passes.annotate import annotate
from hgraph.passes.localize import localize
from hgraph.rules import Decision, register, unregister
from hgraph.rules.mesh import ShardingOptions
from hgraph.rules.elementwise import pointwise_rule

R, P = Replicate(), Partial()
_CACHE: dict[str, object] = {}


def _traced(name: str):
    if name not in _CACHE:
        model = models.Llama() if name == "llama" else models.tiny_hf_gpt2()
        _CACHE[name] = trace(model, (torch.zeros(2, 8, dtype=torch.long),))
    return _CACHE[name]


def _annotated(name: str, **options):
    traced = _traced(name)
    opts = ShardingOptions(params=frozenset(traced.param_names), **options)
    gm = annotate(copy.deepcopy(traced.graph_module), opts)
    return {traced.param_names.get(n.name, n.name): n for n in gm.graph.nodes}


def _param(nodes, fqn):
    n = nodes[fqn]
    return n.meta["hgraph_param_spec"], n.meta["hgraph_grad_spec"]


def test_llama_tp_megatron_pairing():
    nodes = _annotated("llama", tp=2)
    for fqn in ("layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight", "layers.0.mlp.up_proj.weight",
                "embed.weight", "lm_head.weight"):
        assert _param(nodes, fqn) == ((R, Shard(0)), (R, Shard(0))), fqn
    for fqn in ("layers.0.attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert _param(nodes, fqn) == ((R, Shard(1)), (R, Shard(1))), fqn
    assert _param(nodes, "layers.0.attn_norm.weight") == ((R, R), (R, R))
    assert nodes["embedding"].meta["hgraph_spec"] == (R, P)
    assert nodes["linear_3"].meta["hgraph_spec"] == (R, P)  # o_proj output before its all-reduce
    assert nodes["packed_attention"].meta["hgraph_spec"] == (R, Shard(1))
    assert nodes["linear"].meta["hgraph_decision"].note == "column-parallel"
    assert nodes["linear_3"].meta["hgraph_decision"].note == "row-parallel"


def test_gradient_specs_under_sequence_parallelism_and_cp():
    sp = _annotated("llama", tp=2, sequence_parallel=True)
    assert _param(sp, "layers.0.attn_norm.weight") == ((R, R), (R, P))
    assert _param(sp, "layers.0.attn.q_proj.weight") == ((R, Shard(0)), (R, Shard(0)))
    cp = _annotated("llama", cp=2, tp=2)
    for fqn in ("layers.0.attn_norm.weight", "layers.0.attn.q_proj.weight", "embed.weight"):
        spec, grad = _param(cp, fqn)
        assert spec[0] == R and grad[0] == P, fqn
    assert cp["input_ids"].meta["hgraph_spec"] == (Shard(1), R)


def test_gpt2_conv1d_weights_and_bias_after_reduction():
    nodes = _annotated("gpt2", tp=2)
    qkv = InterleavedShard(1, (64, 64, 64))  # fused q, k, v: each block cut, so the split stays local
    assert _param(nodes, "transformer.h.0.attn.c_attn.weight") == ((R, qkv), (R, qkv))
    assert _param(nodes, "transformer.h.0.attn.c_attn.bias") == ((R, InterleavedShard(0, qkv.blocks)),) * 2
    assert _param(nodes, "transformer.h.0.mlp.c_proj.weight") == ((R, Shard(0)), (R, Shard(0)))
    # the row-parallel bias is added once, after the all-reduce: its gradient is complete on every rank
    assert _param(nodes, "transformer.h.0.mlp.c_proj.bias") == ((R, R), (R, R))
    assert _param(nodes, "transformer.wpe.weight") == ((R, R), (R, R))  # indexed by positions
    assert _param(nodes, "transformer.wte.weight") == ((R, Shard(0)), (R, Shard(0)))  # tied with lm_head


def test_vocab_parallel_off_keeps_embedding_replicated():
    nodes = _annotated("llama", tp=2, vocab_parallel=False)
    assert _param(nodes, "embed.weight") == ((R, R), (R, R))
    assert nodes["embedding"].meta["hgraph_spec"] == (R, R)


def test_bad_degrees_raise():
    with pytest.raises(ShardingRuleError, match="tp=0"):
        ShardingOptions(tp=0)
    with pytest.raises(ShardingRuleError, match="cp='2'"):
        ShardingOptions(cp="2")
    with pytest.raises(ShardingRuleError, match="heads"):
        _annotated("llama", tp=8)  # 4 heads: 2 key/value heads may be replicated over tp, heads may not


class _Flipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flip(1).sum()


def test_op_without_rule_is_named():
    gm = torch.export.export(_Flipped(), (torch.randn(2, 4, 8),)).graph_module
    with pytest.raises(ShardingRuleError, match=r"aten\.flip\.default at node 'flip'.*no sharding rule"):
        annotate(gm, ShardingOptions(tp=2))


@torch.library.custom_op("hgraph_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_twice.register_autograd(lambda ctx, grad: grad * 2)


class _UsesCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.ops.hgraph_test.twice(self.up(x))).sum()


def test_user_registered_rule_is_used():
    module = _UsesCustomOp()
    x = torch.randn(2, 3, 8)
    gm = torch.export.export(module, (x,)).graph_module
    op = torch.ops.hgraph_test.twice.default
    with pytest.raises(ShardingRuleError, match="hgraph_test.twice.default"):
        annotate(copy.deepcopy(gm), ShardingOptions(tp=2))
    calls = []

    def rule(node, rin) -> Decision:
        calls.append(node.name)
        return pointwise_rule(node, rin)

    register(op, rule)
    try:
        with pytest.raises(ShardingRuleError, match="already has a sharding rule"):
            register(op, rule)
        annotated = annotate(copy.deepcopy(gm), ShardingOptions(tp=2))
    finally:
        unregister(op)
    assert calls == ["twice"]
    node = next(n for n in annotated.graph.nodes if n.target is op)
    assert node.meta["hgraph_spec"] == (R, Shard(2))  # follows the column-parallel input
    local = localize(annotated, ShardingOptions(tp=2))
    assert any(n.target is op for n in local.graph.nodes)


class _BufferTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0, 1, 64).reshape(16, 4))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.table).sum()


def test_buffers_stay_replicated_and_data_inputs_split_on_cp():
    gm = torch.export.export(_BufferTable(), (torch.zeros(2, 8, dtype=torch.long),)).graph_module
    annotated = annotate(gm, ShardingOptions(cp=2))
    specs = {n.name: n.meta["hgraph_spec"] for n in annotated.graph.nodes}
    assert specs["b_table"] == (R, R)
    assert specs["input_ids"] == (Shard(1), R)
    assert specs["sum_1"] == (P, R)  # a sum over cp-split tokens is pending
