"""The MoE auxiliary load-balancing loss, as a term of hgraph's summed loss.

HuggingFace MoE models built with ``output_router_logits=True`` return ``aux_loss`` — a product of
two means over the tokens of one forward (the fraction of tokens routed to each expert and the mean
router probability, Switch Transformer's loss) — and add ``router_aux_loss_coef · aux_loss`` to their
token-mean cross entropy. hgraph's programs return a *sum* over tokens that the iteration divides by
its global token count, so every micro-batch ``m`` contributes

    cross_entropy_sum(m) + coef · aux_loss(m) · tokens(m)

and the iteration's loss is the token-mean cross entropy plus ``coef`` times the token-weighted mean
of the micro-batches' auxiliary losses. A micro-batch is one forward of the model: on a batch that is
one micro-batch this is exactly the model's own loss, and on several it is the loss of each
micro-batch (its own forward) weighted by its tokens — Megatron's per-micro-batch auxiliary loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hgraph.errors import InputError
from hgraph.frontend.loss_module import default_loss


@dataclass(frozen=True)
class RouterAuxLoss:
    """``default_loss`` plus ``coef · outputs.aux_loss · tokens`` (see the module docstring)."""

    coef: float
    model: str = "the model"

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        aux = getattr(outputs, "aux_loss", None)
        if not isinstance(aux, torch.Tensor):
            raise InputError(
                f"{self.model} has config.output_router_logits=True but its forward returned no aux_loss tensor; "
                "build it with output_router_logits=False or pass loss_fn= to hgraph.compile"
            )
        tokens = (targets != -100).sum()
        return default_loss(outputs, targets) + self.coef * aux.float() * tokens

    def __str__(self) -> str:
        return f"cross entropy + {self.coef} x router aux loss per micro-batch"


def loss_for(model: Any) -> Any:
    """The loss hgraph traces for ``model`` when the user gives none: with the router auxiliary loss
    when its config asks for it (``output_router_logits``), else ``default_loss``."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        return RouterAuxLoss(float(getattr(config, "router_aux_loss_coef", 0.0)), type(model).__name__)
    return default_loss


__all__ = ["RouterAuxLoss", "loss_for"]
