"""Fused projections (Phi-3 ``qkv_proj``/``gate_up_proj``, GPT-2 ``c_attn``, GPT-NeoX
``query_key_value``) under tensor parallelism: every gradient equals the unmodified model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hgraph
from hgraph.core.batch import next_token_targets


def reference(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(ids).logits
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, use_cache=False, pad_token_id=None,
             bos_token_id=1, eos_token_id=2)


def tiny_phi3() -> nn.Module:
    """Phi-3 from its default config with only the sizes shrunk (grouped-query: q, k, v blocks of
    64, 32, 32 rows; KV cache and pad token off until the frontend handles them)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(**SIZES))


def tiny_llama_like_phi3() -> nn.Module:
    """The same sizes with separate q/k/v and gate/up projections: the unfused reference for bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES))


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(config)


def tiny_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=64, use_cache=False,
                           bos_token_id=1, eos_token_id=2)
    return GPTNeoXForCausalLM(config)


MODELS = {"phi3": tiny_phi3, "gpt2": tiny_gpt2, "gpt_neox": tiny_neox}
STRATEGIES = ["tp2", "tp2 + 2x tp1"]
FUSED = {  # parameter -> placement on tp of its fused projection
    "phi3": {"model.layers.0.self_attn.qkv_proj.weight": "S(0:64+32+32)", "model.layers.1.mlp.gate_up_proj.weight": "S(0:128+128)"},
    "gpt2": {"transformer.h.0.attn.c_attn.weight": "S(1:64+64+64)", "transformer.h.1.attn.c_attn.bias": "S(0:64+64+64)"},
    "gpt_neox": {"gpt_neox.layers.0.attention.query_key_value.weight": "S(0)"},  # heads already interleaved
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def fused(request):
    model = MODELS[request.param]()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    compiled = {s: hgraph.compile(model, [s], example_inputs=ids) for s in STRATEGIES}
    return request.param, model, ids, compiled, reference(model, ids)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fused_model_equals_the_unmodified_model(fused, strategy):
    """Phi-3 regression too: values after ``chunk`` (gate_up_proj) were taken as not needing a
    gradient, so partial gradients were never summed over tp (loss right, gradients 66 % off)."""
    name, model, ids, compiled, (ref_loss, ref_grads) = fused
    loss, grads = compiled[strategy].simulate(0, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for fqn, ref in ref_grads.items():
        torch.testing.assert_close(grads[fqn], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=fqn: f"{name} {n}: {m}")


def test_fused_projection_is_split_locally(fused):
    """Each rank holds its heads' q, k, v: the fused weight is cut block by block and tp moves only
    Megatron's all-reduces (no gather before the split)."""
    name, _, _, compiled, _ = fused
    cm = compiled["tp2"]
    for fqn, placement in FUSED[name].items():
        assert str(_tp_placement(cm, fqn)) == placement, fqn
    ops = {sg.tensor.split(" ")[-1] for sg in cm.subgraphs(0, 0) if sg.kind == "communicate_activation"}
    assert ops == {"(all_reduce/tp)", "(grad_all_reduce/tp)"}, ops


def _tp_placement(cm, fqn: str):
    pull = next(sg for sg in cm.subgraphs(0, 0) if sg.kind == "pull_parameter" and sg.tensor == fqn)
    return pull.dst.placements[-1]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fused_projections_move_the_bytes_of_separate_ones(strategy):
    """Phi-3 (fused qkv and gate-up) and the same sizes with separate projections: the same bytes
    on every rank for every kind of subgraph (activations; Pull and Push from the ZeRO layout, which
    cuts the fused weights by blocks too)."""
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    totals = []
    for factory in (tiny_phi3, tiny_llama_like_phi3):
        cm = hgraph.compile(factory(), [strategy], example_inputs=ids)
        per_rank = []
        for rank in range(cm.world_size):
            kinds: dict[tuple[str, str], int] = {}
            for sg in cm.subgraphs(0, rank):
                kinds[(sg.kind, sg.direction)] = kinds.get((sg.kind, sg.direction), 0) + sg.bytes
            per_rank.append(kinds)
        totals.append(per_rank)
    assert totals[0] == totals[1]
    assert all(b > 0 for b in totals[0][0].values()) and len(totals[0][0]) == 3


class ChunkedHidden(nn.Module):
    """The smallest graph of the bug: halves of a ``chunk`` feed a column-parallel (vocab) head."""

    def __init__(self, vocab: int = 32, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.head = nn.Linear(hidden // 2, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        a, b = (self.embed(input_ids) * self.scale).chunk(2, dim=-1)
        return self.head(a * torch.tanh(b))


def test_gradient_flows_through_chunk_outputs():
    torch.manual_seed(0)
    model = ChunkedHidden()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    ref_loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    ref_loss.backward()
    loss, grads = hgraph.compile(model, ["tp2"], example_inputs=ids).simulate(0, ids)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
