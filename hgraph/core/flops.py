"""Model FLOPs of a training iteration, for the TFLOPs and MFU that ``hgraph.runtime.metrics`` reports.

The count is the one PaLM, Megatron and torchtitan report: matrix multiplications only, forward and
backward (3x the forward), attention over each whole sequence (no causal halving)::

    flops(l) = 6 * matmul_params * l + 12 * layers * attention_width * l**2

for one sequence of ``l`` tokens (a packed batch: the sum over its sequences, since attention stays
inside each), where ``matmul_params`` counts the weights of every ``nn.Linear`` (and HF ``Conv1D``)
once, tied LM heads included, embeddings looked up and norms not; ``attention_width`` is
``heads * head_dim``. Recomputation is not counted (model FLOPs, not hardware FLOPs). MoE models count
every expert, so their MFU reads low.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import nn

from hgraph.errors import InputError
from hgraph.core.model_info import model_dims


def _matmul_weights(model: nn.Module) -> dict[int, int]:
    """``id(weight) -> numel`` of every weight used as a matrix product (each tensor once)."""
    out: dict[int, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        is_matmul = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # HF GPT-2's Linear
        if is_matmul and isinstance(weight, nn.Parameter) and weight.dim() == 2:
            out[id(weight)] = weight.numel()
    return out


@dataclass(frozen=True)
class ModelFlops:
    """The two numbers the count needs; ``ModelFlops.of(model)`` reads them off the model."""

    matmul_params: int
    layers: int
    attention_width: int

    @classmethod
    def of(cls, model: nn.Module) -> "ModelFlops":
        dims = model_dims(model)
        missing = [k for k in ("layers", "heads", "hidden") if k not in dims]
        if missing:
            raise InputError(f"{type(model).__name__}: cannot count its FLOPs without {missing} in model.config "
                             "(num_hidden_layers, num_attention_heads, hidden_size)")
        config = model.config  # model_dims found these in it
        head_dim = getattr(config, "head_dim", None)
        if not isinstance(head_dim, int):
            head_dim = dims["hidden"] // dims["heads"]
        return cls(sum(_matmul_weights(model).values()), dims["layers"], dims["heads"] * head_dim)

    def sequence(self, length: int) -> float:
        """Forward + backward FLOPs of one sequence of ``length`` tokens."""
        return 6.0 * self.matmul_params * length + 12.0 * self.layers * self.attention_width * length**2

    def batch(self, lengths: Sequence[int]) -> float:
        """Forward + backward FLOPs of a global batch of sequences."""
        return sum(self.sequence(n) for n in lengths)

    def __str__(self) -> str:
        return (f"ModelFlops: 6 x {self.matmul_params:,} matmul parameters per token + 12 x {self.layers} layers "
                f"x attention width {self.attention_width} per token^2")
