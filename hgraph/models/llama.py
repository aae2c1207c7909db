"""Small causal language models shipped with hgraph for examples, the demo and tests.

``Llama`` is a hand-written Llama-style decoder (RMSNorm, rotary positions from ``position_ids``,
grouped-query attention through ``scaled_dot_product_attention(enable_gqa=True)``, SwiGLU MLP). It is
written the way users write models — no hgraph-specific hooks — so the compiler is exercised on an
ordinary ``nn.Module``. Rotary angles come from ``position_ids``, so a packed micro-batch whose
positions restart at 0 for every sequence rotates each sequence exactly as if it ran alone.

``tiny_hf_llama`` / ``tiny_hf_gpt2`` build HuggingFace models from small random configs (no download)
to check that hgraph works on models it has never seen.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from hgraph.errors import InputError
from hgraph.core.seeding import seeded_model


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a ``Llama``; the defaults give a ~150K-parameter model that runs in milliseconds."""

    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    max_positions: int = 4096
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn", "max_positions")
        for name in positive:
            if getattr(self, name) <= 0:
                raise InputError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise InputError(f"LlamaConfig.hidden={self.hidden} is not divisible by heads={self.heads}")
        if (self.hidden // self.heads) % 2:
            raise InputError(f"rotary embedding needs an even head dim, got {self.hidden // self.heads}")
        if self.heads % self.kv_heads:
            raise InputError(f"LlamaConfig.heads={self.heads} is not divisible by kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def __str__(self) -> str:
        return (
            f"Llama(vocab={self.vocab_size}, hidden={self.hidden}, layers={self.layers}, "
            f"heads={self.heads}/{self.kv_heads}kv, ffn={self.ffn}{', tied' if self.tie_embeddings else ''})"
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Weight back to ones (what a model built on the meta device is initialised with)."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding; ``cos``/``sin`` of shape ``[b, 1, s, head_dim]`` from position ids."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` (a model built on the meta device has no values for it)."""
        with torch.no_grad():
            self.inv_freq.copy_(self._inv_freq())

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids.unsqueeze(-1).to(self.inv_freq.dtype) * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.ffn, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.ffn, bias=False)
        self.down_proj = nn.Linear(config.ffn, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style causal LM: ``forward(input_ids, position_ids=None) -> logits [b, s, vocab]``.

    Parameters are named ``embed.weight``, ``layers.<i>.attn.q_proj.weight``, ..., ``norm.weight``,
    ``lm_head.weight`` (absent from ``named_parameters()`` when tied to ``embed.weight``).
    """

    def __init__(self, config: LlamaConfig | None = None, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config = config or LlamaConfig()
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if seed is not None and not self.embed.weight.is_meta:  # on meta: nothing to fill
            init_weights(self, seed)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        cos, sin = self.rotary(position_ids)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic init independent of the global RNG: normal(0, 0.02) for matrices, 1 for norms.

    Output projections (``o_proj``, ``down_proj``) are scaled by 1/sqrt(2·layers) as in GPT-2.
    """
    generator = torch.Generator().manual_seed(seed)
    layers = getattr(getattr(model, "config", None), "layers", 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            output_projection = name.endswith(("o_proj.weight", "down_proj.weight"))
            std = 0.02 / math.sqrt(2 * layers) if output_projection else 0.02
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)


# ----------------------------------------------------------------------------- HuggingFace models
def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "the HuggingFace test models need the 'transformers' package: pip install transformers "
            "(or pip install 'hgraph[test]')"
        ) from exc
    return transformers


def tiny_hf_llama(seed: int = 0, **overrides: Any) -> nn.Module:
    """A randomly initialised HuggingFace ``LlamaForCausalLM`` of the default ``LlamaConfig`` sizes.

    ``overrides`` go to ``transformers.LlamaConfig`` (e.g. ``tie_word_embeddings=True``); everything
    else (KV cache, attention implementation, token ids) is the family's default. The model is
    returned in eval mode (no dropout ops in traced graphs); the global RNG is left untouched, and rank
    threads building it at once get identical models (``hgraph.core.seeding``).
    """
    transformers = _transformers()
    options: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    options.update(overrides)
    key = ("tiny_hf_llama", repr(sorted(options.items())))
    model = seeded_model(key, seed, lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**options)))
    return model.eval()


def tiny_hf_gpt2(seed: int = 0, **overrides: Any) -> nn.Module:
    """A randomly initialised HuggingFace ``GPT2LMHeadModel`` in its default config, sizes shrunk.

    Returned in eval mode, so GPT-2's default dropout (0.1) is off; tied embeddings.
    """
    transformers = _transformers()
    options: dict[str, Any] = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=1024)
    options.update(overrides)
    key = ("tiny_hf_gpt2", repr(sorted(options.items())))
    model = seeded_model(key, seed, lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**options)))
    return model.eval()


def load_factory(spec: str) -> Callable[[], Any]:
    """``module:attribute`` -> the callable it names (a model class or a function returning a model)."""
    if ":" not in spec:
        raise InputError(f"model {spec!r}: expected 'module:factory', e.g. 'hgraph.cli.demo:tiny_model'")
    module_name, attr = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"model {spec!r}: cannot import module {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InputError(f"model {spec!r}: {module_name} has no callable {attr!r}")
    return factory
