"""What hgraph reads from a user's model: its dimensions, decoder blocks and token embedding, and the
checks of strategies against them (tp must divide the heads, pp at most the layers, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from hgraph.errors import CostModelError, StrategyError
from hgraph.core.strategy import Strategy

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


def validate_strategies(strategies: Sequence[Strategy], world_size: int, dims: dict[str, int]) -> None:
    """Check every strategy against the world and the model; one clear error per problem."""
    for s in strategies:
        s.check_world_size(world_size)
        for p in s.pipelines:
            for key, label in (("heads", "attention heads"), ("kv_heads", "key/value heads"), ("hidden", "hidden size"), ("vocab", "vocabulary")):
                if key == "kv_heads" and key in dims and p.tp % dims[key] == 0:
                    continue  # fewer key/value heads than tp ranks: each is replicated (Megatron)
                if key in dims and dims[key] % p.tp:
                    raise StrategyError(
                        f"strategy {s}: tp={p.tp} does not divide the {label} ({dims[key]}); "
                        f"use a tp that divides {dims[key]}"
                    )
            if "layers" in dims and p.pp > dims["layers"]:
                raise StrategyError(
                    f"strategy {s}: pp={p.pp} exceeds the model's {dims['layers']} layers; use pp <= {dims['layers']}"
                )
            if "layers" in dims and p.pp * p.vpp > dims["layers"]:
                raise StrategyError(
                    f"strategy {s}: pp*vpp={p.pp * p.vpp} virtual stages exceed the model's {dims['layers']} layers; "
                    f"use vpp <= {dims['layers'] // p.pp}"
                )
            if p.ep > 1:
                _check_expert_degree(s, p.ep, dims)


def _check_expert_degree(strategy: Strategy, ep: int, dims: dict[str, int]) -> None:
    """``ep`` needs routed experts in the model, and a number of them it divides."""
    experts = dims.get("experts")
    if not experts:
        raise StrategyError(
            f"strategy {strategy}: ep={ep} but the model has no routed experts (its config names no "
            "num_local_experts / num_experts / n_routed_experts); use ep=1 for a dense model"
        )
    if experts % ep:
        raise StrategyError(
            f"strategy {strategy}: ep={ep} does not divide the model's {experts} experts; "
            f"use an ep dividing {experts}"
        )



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
