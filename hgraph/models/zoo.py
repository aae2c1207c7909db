"""The HuggingFace model zoo: each causal-LM family in its default config, only the sizes made tiny.

``zoo_model("mistral")`` is ``AutoModelForCausalLM.from_config(MistralConfig(**sizes))`` — the
family's own defaults (KV cache on, its default ``attn_implementation``, its pad token, its dropout)
with hidden size, layers, heads, vocabulary, FFN width (and expert count, sliding window) shrunk.
Nothing else is changed, so the zoo exercises hgraph on models exactly as users load them. The zoo
test (``tests/models/test_zoo.py``) and ``benchmarks/model_zoo.py`` (the README's supported-models
table) both build their models here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hgraph.errors import InputError
from hgraph.core.seeding import seeded_model

_DECODER = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)
_MHA = {**_DECODER, "num_key_value_heads": 4}
_WINDOW = 8  # shorter than the zoo's sequences, so the window matters
_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
_GATED_DELTA = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)


@dataclass(frozen=True)
class Family:
    """One model family: its config class in ``transformers`` and the size fields shrunk."""

    name: str
    config: str
    sizes: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.name} ({self.config}: {', '.join(f'{k}={v}' for k, v in self.sizes.items())})"


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig", _DECODER),
        Family("mistral", "MistralConfig", {**_DECODER, "head_dim": 16, "sliding_window": _WINDOW}),
        Family("qwen2", "Qwen2Config", _DECODER),
        Family("qwen3", "Qwen3Config", {**_DECODER, "head_dim": 16}),
        Family("gemma", "GemmaConfig", {**_DECODER, "head_dim": 16}),
        Family("gemma2", "Gemma2Config", {**_DECODER, "head_dim": 16, "sliding_window": _WINDOW,
                                          "query_pre_attn_scalar": 16}),
        Family("gemma3", "Gemma3TextConfig", {**_DECODER, "head_dim": 16, "sliding_window": _WINDOW,
                                              "query_pre_attn_scalar": 16}),
        Family("phi3", "Phi3Config", {**_MHA, "pad_token_id": 255, "eos_token_id": 255}),
        Family("phi", "PhiConfig", _MHA),
        Family("gpt2", "GPT2Config", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                         bos_token_id=255, eos_token_id=255)),
        Family("gpt_neox", "GPTNeoXConfig", {**_MHA, "max_position_embeddings": 512}),
        Family("opt", "OPTConfig", dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=512,
                                        word_embed_proj_dim=64)),
        Family("falcon", "FalconConfig", dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, ffn_hidden_size=128)),
        Family("bloom", "BloomConfig", dict(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)),
        Family("stablelm", "StableLmConfig", _MHA),
        Family("mixtral", "MixtralConfig", {**_DECODER, "num_local_experts": 4}),
        Family("qwen2_moe", "Qwen2MoeConfig", {**_DECODER, "moe_intermediate_size": 32,
                                               "shared_expert_intermediate_size": 64, "num_experts": 4,
                                               "num_experts_per_tok": 2}),
        Family("starcoder2", "Starcoder2Config", {**_DECODER, "sliding_window": _WINDOW}),
        Family("gptj", "GPTJConfig", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                          rotary_dim=8, bos_token_id=255, eos_token_id=255)),
        Family("mpt", "MptConfig", dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=512)),
        Family("gpt_bigcode", "GPTBigCodeConfig", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                                       n_positions=512, bos_token_id=255, eos_token_id=255)),
        Family("cohere", "CohereConfig", {**_MHA, "bos_token_id": 1, "eos_token_id": 2}),
        Family("olmo2", "Olmo2Config", {**_MHA, "eos_token_id": 255}),
        # ------------------------------------------------------------ 2025-2026 families
        Family("deepseek_v3", "DeepseekV3Config", {**_MHA, **_MLA, "num_hidden_layers": 4, "moe_intermediate_size": 16,
                                                   "n_routed_experts": 32}),
        Family("deepseek_v2", "DeepseekV2Config", {**_MHA, **_MLA, "moe_intermediate_size": 16, "n_routed_experts": 8,
                                                   "num_experts_per_tok": 6}),
        Family("glm4_moe_lite", "Glm4MoeLiteConfig", {**_MHA, **_MLA, "moe_intermediate_size": 16, "n_routed_experts": 8}),
        Family("glm4_moe", "Glm4MoeConfig", {**_DECODER, "head_dim": 16, "moe_intermediate_size": 16,
                                             "n_routed_experts": 16}),
        Family("dots1", "Dots1Config", {**_MHA, "moe_intermediate_size": 16, "n_routed_experts": 8,
                                        "num_experts_per_tok": 2, "n_shared_experts": 1}),
        Family("qwen3_moe", "Qwen3MoeConfig", {**_DECODER, "head_dim": 16, "moe_intermediate_size": 16, "num_experts": 16}),
        Family("qwen3_next", "Qwen3NextConfig", {**_DECODER, **_GATED_DELTA, "head_dim": 16, "num_hidden_layers": 4,
                                                 "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                                                 "num_experts": 16}),
        Family("qwen3_5", "Qwen3_5TextConfig", {**_DECODER, **_GATED_DELTA, "head_dim": 16, "num_hidden_layers": 4}),
        Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", {**_DECODER, **_GATED_DELTA, "head_dim": 16, "num_hidden_layers": 4,
                                                       "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                                                       "num_experts": 16}),
        Family("gpt_oss", "GptOssConfig", {**_DECODER, "intermediate_size": 32, "head_dim": 16, "num_local_experts": 8,
                                           "sliding_window": _WINDOW}),
        Family("llama4", "Llama4TextConfig", {**_DECODER, "head_dim": 16, "intermediate_size_mlp": 128,
                                              "num_local_experts": 4, "attention_chunk_size": _WINDOW,
                                              "num_hidden_layers": 4}),
        Family("gemma4", "Gemma4TextConfig", {**_DECODER, "head_dim": 16, "global_head_dim": 32, "sliding_window": _WINDOW,
                                              "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256}),
        Family("olmo3", "Olmo3Config", {**_MHA, "num_hidden_layers": 4, "sliding_window": _WINDOW, "eos_token_id": 255}),
        Family("smollm3", "SmolLM3Config", {**_DECODER, "num_hidden_layers": 4, "pad_token_id": 253, "bos_token_id": 254,
                                            "eos_token_id": 255}),
        Family("ministral", "MinistralConfig", {**_DECODER, "head_dim": 16, "sliding_window": _WINDOW}),
        Family("granite", "GraniteConfig", _MHA),
        Family("olmoe", "OlmoeConfig", {**_MHA, "intermediate_size": 32, "num_experts": 16, "eos_token_id": 255}),
        Family("granitemoe", "GraniteMoeConfig", {**_MHA, "intermediate_size": 32, "num_local_experts": 8}),
        Family("granitemoeshared", "GraniteMoeSharedConfig", {**_MHA, "intermediate_size": 32, "num_local_experts": 8,
                                                              "shared_intermediate_size": 64}),
        Family("phimoe", "PhimoeConfig", {**_DECODER, "num_local_experts": 4}),
        Family("ernie4_5_moe", "Ernie4_5_MoeConfig", {**_DECODER, "head_dim": 16, "moe_intermediate_size": 16,
                                                      "num_experts": 8}),
        Family("hunyuan_v1_moe", "HunYuanMoEV1Config", {**_MHA, "head_dim": 16, "num_experts": 4, "moe_topk": 2}),
        Family("helium", "HeliumConfig", {**_MHA, "head_dim": 16}),
        Family("glm4", "Glm4Config", {**_DECODER, "head_dim": 16, "pad_token_id": 255, "eos_token_id": [255]}),
        Family("glm", "GlmConfig", {**_DECODER, "head_dim": 16, "pad_token_id": 255, "eos_token_id": [255]}),
        Family("exaone4", "Exaone4Config", {**_MHA, "num_hidden_layers": 4, "sliding_window": _WINDOW}),
        Family("seed_oss", "SeedOssConfig", {**_DECODER, "head_dim": 16}),
        Family("ernie4_5", "Ernie4_5Config", {**_DECODER, "head_dim": 16}),
        Family("cohere2", "Cohere2Config", {**_MHA, "head_dim": 16, "num_hidden_layers": 4, "sliding_window": _WINDOW,
                                            "bos_token_id": 1, "eos_token_id": 2}),
        Family("hunyuan_v1_dense", "HunYuanDenseV1Config", {**_MHA, "head_dim": 16}),
        Family("apertus", "ApertusConfig", _MHA),
        Family("arcee", "ArceeConfig", {**_MHA, "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2}),
        Family("lfm2", "Lfm2Config", {**_DECODER, "num_hidden_layers": 4}),
        Family("minimax", "MiniMaxConfig", {**_DECODER, "head_dim": 16, "num_local_experts": 4}),
        Family("falcon_h1", "FalconH1Config", {**_DECODER, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
                                               "mamba_d_state": 16, "mamba_n_groups": 1}),
        Family("nemotron_h", "NemotronHConfig", {**_DECODER, "head_dim": 16, "moe_intermediate_size": 16,
                                                 "n_routed_experts": 4, "mamba_num_heads": 8, "mamba_head_dim": 16,
                                                 "ssm_state_size": 16, "n_groups": 1}),
    )
}


def zoo_config(name: str) -> Any:
    """The family's default config with only its sizes shrunk (token ids moved inside the vocabulary)."""
    import transformers

    if name not in FAMILIES:
        raise InputError(f"unknown zoo family {name!r}; known: {', '.join(FAMILIES)}")
    family = FAMILIES[name]
    return getattr(transformers, family.config)(**family.sizes)


def zoo_model(name: str, seed: int = 0) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``zoo_config(name)``, seeded; global RNG untouched
    (``hgraph.core.seeding``: rank threads building it at once get identical models).

    Returned as ``from_config`` returns it (train mode, so a family whose defaults have dropout keeps it).
    """
    import transformers

    config = zoo_config(name)
    return seeded_model(("zoo_model", name), seed, lambda: transformers.AutoModelForCausalLM.from_config(config))


@dataclass(frozen=True)
class ZooFactory:
    """``zoo_model(name)`` as a picklable zero-argument factory (``hgraph profile``, benchmarks: ranks
    in other processes build the model themselves)."""

    name: str

    def __call__(self) -> nn.Module:
        return zoo_model(self.name)


__all__ = ["FAMILIES", "Family", "ZooFactory", "zoo_config", "zoo_model"]
