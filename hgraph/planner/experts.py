"""Expert parallelism in the cost model: the terms ep adds to a stage's ``T(l)`` and those it removes.

Under ``ep`` (``hgraph.core.strategy``) a stage's ``n = cp·tp`` ranks each route their own share of an
``l``-token micro-batch (``l/n`` tokens), send every ``(token, expert)`` row whose expert lives in
another group (``(ep-1)/ep`` of the ``k`` rows per token under even routing) and receive the results:
per MoE layer four all-to-alls (dispatch and combine, and their adjoints), where experts cut over tp
all-reduce their output forward and their input's gradient backward. Tokens replicated over tp (no
sequence parallelism) are split before and gathered after (one all-gather forward, one backward).

Each rank computes the rows routed to its experts: ``1/n`` of all rows under even routing, and under
skewed routing the busiest expert group ``imbalance`` times its share; the stage waits for it. The
imbalance comes from router statistics observed in training (``Trainer.history[i]["expert_counts"]``:
rows per expert of each MoE layer, summed over the stage's ranks) through ``expert_imbalance``, or is
a stated assumption (``EVEN_ROUTING = 1.0``: every group gets its share).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hgraph.errors import CostModelError

EVEN_ROUTING = 1.0


def expert_imbalance(counts: Sequence[float], ep: int) -> float:
    """Busiest expert group's rows over the mean group's, for experts split into ``ep`` consecutive
    groups (``counts[e]``: rows routed to expert ``e``); 1.0 under even routing or without rows."""
    if ep < 1 or len(counts) % ep:
        raise CostModelError(f"ep={ep} does not split {len(counts)} experts into equal groups")
    size = len(counts) // ep
    loads = [sum(counts[g * size:(g + 1) * size]) for g in range(ep)]
    mean = sum(loads) / ep
    return max(loads) / mean if mean > 0 else EVEN_ROUTING


def layer_imbalance(per_layer: Sequence[Sequence[float]], ep: int) -> float:
    """The slowest MoE layer's imbalance (``expert_imbalance`` of each layer's counts)."""
    return max((expert_imbalance(c, ep) for c in per_layer), default=EVEN_ROUTING)


@dataclass(frozen=True)
class MoELayerShape:
    """What the ep terms need of a model: ``hidden`` width, routed ``experts``, ``top_k`` experts per
    token, each expert's width ``expert_ffn`` (gate/up/down projections: ``3·hidden·expert_ffn``
    weights) and the number of MoE layers in a stage."""

    hidden: int
    experts: int
    top_k: int
    expert_ffn: int
    layers: int

    def expert_flops_per_token(self) -> float:
        """Forward FLOPs of one layer's routed experts per token: ``k`` experts' three projections."""
        return 2.0 * self.top_k * 3 * self.hidden * self.expert_ffn


def all_to_all_bytes_per_token(shape: MoELayerShape, cp: int, tp: int, ep: int, itemsize: int = 2) -> float:
    """Bytes one rank sends to other ranks per token of a micro-batch, forward and backward, over the
    stage's MoE layers: four all-to-alls of its ``1/(cp·tp)`` share's off-group rows."""
    if ep == 1:
        return 0.0
    rows = shape.top_k * (ep - 1) / ep / (cp * tp)
    return 4 * shape.layers * rows * shape.hidden * itemsize


def token_gather_bytes_per_token(shape: MoELayerShape, cp: int, tp: int, ep: int, itemsize: int = 2) -> float:
    """Bytes one rank sends per token to gather the MoE output back over tp (tokens replicated on tp:
    no sequence parallelism), forward and backward (the input's gradient)."""
    if ep == 1 or tp == 1:
        return 0.0
    return 2 * shape.layers * (tp - 1) / tp * shape.hidden * itemsize / cp


def tp_expert_reduce_bytes_per_token(shape: MoELayerShape, cp: int, tp: int, itemsize: int = 2) -> float:
    """Bytes one rank sends per token in the two ring all-reduces of tp-sharded experts per MoE layer
    (output forward, input gradient backward): what ep saves."""
    if tp == 1:
        return 0.0
    return 2 * shape.layers * 2 * (tp - 1) / tp * shape.hidden * itemsize / cp


__all__ = [
    "EVEN_ROUTING", "MoELayerShape", "all_to_all_bytes_per_token", "expert_imbalance", "layer_imbalance",
    "tp_expert_reduce_bytes_per_token", "token_gather_bytes_per_token",
]
