"""Fused projections (Phi-3 ``qkv_proj``/``gate_up_proj``, GPT-2 ``c_attn``, GPT-NeoX
``query_key_value``) under tensor parallelism: every gradient equals the unmodified model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hgraph
from hgraph.simulate import next_token_targets


def reference(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(ids).logits
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def tiny_phi3() -> nn.Module:
    """Phi-3 from its default config with only the sizes shrunk (KV cache and pad token off until
    the frontend handles them)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, use_cache=False, pad_token_id=None,
        bos_token_id=1, eos_token_id=2,
    )
    return Phi3ForCausalLM(config)


@pytest.fixture(scope="module")
def phi3():
    model = tiny_phi3()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, ids, reference(model, ids)


@pytest.mark.parametrize("strategy", ["tp2", "tp2 + 2x tp1"])
def test_phi3_tp_gradients_equal_the_model(phi3, strategy):
    """Regression: values after ``chunk`` (gate_up_proj) were taken as not needing a gradient, so the
    partial gradient of the column-parallel down_proj input was never summed over tp."""
    model, ids, (ref_loss, ref_grads) = phi3
    loss, grads = hgraph.compile(model, [strategy], example_inputs=ids).simulate(0, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


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
