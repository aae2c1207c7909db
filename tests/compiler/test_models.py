"""The shipped models: hgraph.models.Llama agrees with HuggingFace Llama; factories are deterministic."""

from __future__ import annotations

import pytest
import torch

from hgraph.errors import InputError
from hgraph.models import Llama, LlamaConfig, tiny_hf_gpt2, tiny_hf_llama


def hf_name(name: str) -> str:
    """Our parameter name -> the HuggingFace LlamaForCausalLM one."""
    if name == "lm_head.weight":
        return name
    name = name.replace("embed.", "embed_tokens.").replace(".attn.", ".self_attn.")
    name = name.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")
    return "model." + name


def test_parameter_names_show_layer_index():
    names = [n for n, _ in Llama().named_parameters()]
    assert names[0] == "embed.weight"
    assert "layers.0.attn.q_proj.weight" in names and "layers.1.mlp.down_proj.weight" in names
    assert names[-2:] == ["norm.weight", "lm_head.weight"]


def test_llama_equals_huggingface_llama_with_the_same_weights():
    ours, hf = Llama(seed=3), tiny_hf_llama()
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            hf_params[hf_name(name)].copy_(param)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, 12) + torch.tensor([[0], [5]])
    torch.testing.assert_close(ours(ids, positions), hf(input_ids=ids, position_ids=positions).logits)


def test_position_ids_default_to_arange_and_drive_rotary():
    model = Llama()
    ids = torch.randint(0, 256, (1, 10))
    torch.testing.assert_close(model(ids), model(ids, torch.arange(10)[None]))
    assert not torch.allclose(model(ids), model(ids, torch.arange(3, 13)[None]))
    assert model(ids).shape == (1, 10, 256)


def test_init_is_deterministic_and_independent_of_global_rng():
    a = dict(Llama(seed=7).named_parameters())
    torch.rand(100)
    b = dict(Llama(seed=7).named_parameters())
    c = dict(Llama(seed=8).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], c["layers.0.attn.q_proj.weight"])


def test_tied_embeddings_share_one_parameter():
    model = Llama(LlamaConfig(tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden": 66}, "not divisible by heads"),
        ({"hidden": 60}, "even head dim"),
        ({"kv_heads": 3}, "kv_heads=3"),
        ({"layers": 0}, "layers"),
    ],
)
def test_bad_config_names_the_field(overrides, message):
    with pytest.raises(InputError, match=message):
        LlamaConfig(**overrides)


@pytest.mark.parametrize(
    "factory, cls", [(tiny_hf_llama, "LlamaForCausalLM"), (tiny_hf_gpt2, "GPT2LMHeadModel")]
)
def test_hf_factories_are_seeded_and_leave_global_rng_alone(factory, cls):
    state = torch.random.get_rng_state()
    a, b = factory(seed=1), factory(seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert type(a).__name__ == cls and not a.training
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    logits = a(input_ids=torch.randint(0, 256, (1, 8))).logits
    assert logits.shape == (1, 8, 256)
