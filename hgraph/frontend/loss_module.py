"""What hgraph traces: the user's model followed by its loss (``LossModule``), and the default loss."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


def output_logits(outputs: Any) -> Any:
    """The logits of a forward's result: ``.logits`` (HF outputs), the first item of a tuple (nanoGPT's
    ``(logits, loss)``), or the tensor itself."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return logits[0] if isinstance(logits, (tuple, list)) else logits


def default_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy over ``targets`` (-100 ignored), on ``output_logits(outputs)``."""
    logits = output_logits(outputs)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum", ignore_index=-100)


class LossModule(nn.Module):
    """``model`` followed by the loss: the function hgraph traces."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        parameters = inspect.signature(model.forward).parameters
        self.takes_positions = "position_ids" in parameters
        # Training never reads a KV cache: ask for none, or the cache's in-place updates are traced
        # (also where ``use_cache`` only reaches the model through ``**kwargs``, as in GraniteMoE).
        forwards_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        has_cache_option = isinstance(getattr(getattr(model, "config", None), "use_cache", None), bool)
        wants = "use_cache" in parameters or (forwards_kwargs and has_cache_option)
        self.call_options = {"use_cache": False} if wants else {}

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        if self.takes_positions:
            outputs = self.model(input_ids=input_ids, position_ids=position_ids, **self.call_options)
        else:
            outputs = self.model(input_ids, **self.call_options)
        return self.loss_fn(outputs, targets)
