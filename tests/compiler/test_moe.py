"""Mixture of experts as HuggingFace builds it (Mixtral, Qwen2-MoE from their default configs, sizes
shrunk): routing replicated, experts tensor-parallel like dense FFNs, results equal to one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hgraph
from hgraph.errors import ShardingRuleError
from hgraph.core.placement import InterleavedShard, Replicate, Shard
from hgraph.rules.base import TP
from hgraph.core.batch import next_token_targets

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=64, use_cache=False, pad_token_id=None,
              bos_token_id=1, eos_token_id=2)


def tiny_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=4, **COMMON))


def tiny_qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                            num_experts=4, **COMMON)
    return Qwen2MoeForCausalLM(config)


MODELS = {"mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe}
STRATEGIES = ["tp2 + 2x tp1", "tp2,pp2"]
EXPERTS = {  # tp placement of layer 0's expert weights [E, 2I, h] and [E, h, I]
    "mixtral": ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj", 64),
    "qwen2_moe": ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj", 32),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request):
    model = MODELS[request.param]()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    logits = model(ids).logits
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=ids)
    return request.param, ids, compiled, loss.detach(), grads


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_moe_equals_the_unmodified_model(moe, strategy):
    name, ids, compiled, ref_loss, ref_grads = moe
    loss, grads = compiled.simulate(strategy, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for fqn, ref in ref_grads.items():
        torch.testing.assert_close(grads[fqn], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=fqn: f"{name} {n}: {m}")


def test_experts_are_tensor_parallel_and_routing_replicated(moe):
    name, _, compiled, _, _ = moe
    gate_up, down, inter = EXPERTS[name]
    pulls = {sg.tensor: sg.dst for sg in compiled.subgraphs("tp2 + 2x tp1", 0) if sg.kind == "pull_parameter"}
    tp = {fqn: layout.layouts[0].placements[-1] for fqn, layout in pulls.items()}
    assert tp[gate_up] == InterleavedShard(1, (inter, inter))  # each rank: its gate and up columns
    assert tp[down] == Shard(2)  # row-parallel
    program = compiled.local_program(1, 2)
    topk = [n for n in program.graph.nodes if n.target is torch.ops.aten.topk.default]
    assert len(topk) == 2 and all(values[TP] == Replicate() for n in topk for values in n.meta["hgraph_spec"])


def test_context_parallel_routing_is_refused_clearly():
    model = tiny_mixtral()
    ids = torch.randint(0, 128, (2, 16))
    with pytest.raises(ShardingRuleError, match="arange|sort|topk|context parallelism"):  # token counts differ per cp rank
        hgraph.compile(model, ["cp2"], example_inputs=ids)


@pytest.mark.parametrize("strategy", [pytest.param("tp2 + 2x tp1", marks=pytest.mark.slow), "tp2,pp2",
                                      pytest.param("2x tp1,pp2", marks=pytest.mark.slow)])
def test_auxiliary_loss_equals_the_models_own_loss(strategy):
    """With ``output_router_logits`` the model adds ``router_aux_loss_coef · aux_loss`` of each forward to
    its loss (``hgraph.frontend.router_loss``). Each row of the batch is one micro-batch, so the oracle is the
    model's own loss (HF's ``labels=`` path, aux term included) of each row, weighted by its tokens."""
    model = tiny_mixtral()
    model.config.output_router_logits = True
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    tokens = ids.shape[1] - 1
    model.zero_grad()
    total = sum(model(input_ids=row[None], labels=row[None]).loss * tokens for row in ids) / (tokens * len(ids))
    total.backward()
    plain = nn.functional.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert (total - plain).abs() > 1e-4 * total.abs(), "the auxiliary term must matter for this test to mean anything"
    compiled = hgraph.compile(model, [strategy], example_inputs=ids[:2])
    loss, grads = compiled.simulate(0, ids)
    torch.testing.assert_close(loss, total.detach(), rtol=1e-5, atol=1e-6)
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=fqn: f"{n}: {m}")
