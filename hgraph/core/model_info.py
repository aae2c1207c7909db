"""What hgraph reads from a user's model: its dimensions (which ``Strategy.check`` checks strategies
against), decoder blocks and token embedding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hgraph.errors import CostModelError

if TYPE_CHECKING:
    from torch import nn


def model_dims(model: nn.Module) -> dict[str, int]:
    """Heads, kv heads, hidden size, vocabulary, layers and routed experts, read from the model's config."""
    cfg = getattr(model, "config", None)
    dims: dict[str, int] = {}
    if cfg is None:
        return dims
    names = {
        "heads": ("heads", "num_attention_heads", "n_head"),
        "kv_heads": ("kv_heads", "num_key_value_heads"),
        "hidden": ("hidden", "hidden_size", "n_embd"),
        "vocab": ("vocab_size",),
        "layers": ("layers", "num_hidden_layers", "n_layer"),
        "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    }
    for key, options in names.items():
        for attr in options:
            value = getattr(cfg, attr, None)
            if isinstance(value, int):
                dims[key] = value
                break
    if "heads" in dims and "kv_heads" not in dims:
        dims["kv_heads"] = dims["heads"]
    return dims


def decoder_blocks(model: Any) -> Any:
    """The decoder blocks: the ``nn.ModuleList`` holding the most parameters."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise CostModelError(f"model {type(model).__name__} has no nn.ModuleList of blocks to time per layer")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def embedding_of(model: Any) -> Any:
    """The token embedding: the first ``nn.Embedding`` of the model."""
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m
    raise CostModelError(f"model {type(model).__name__} has no nn.Embedding; cannot tell its vocabulary")
