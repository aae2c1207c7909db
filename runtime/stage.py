"""What one rank's iteration keeps per stage and sends between stages: the per-micro-batch
``StageState``, the activation shape header, the ``IterationOutput``; read by the executor, whose
evaluation runs keep no autograd state (``StageState.settle``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from hgraph.errors import CommunicationError, InputError

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
HEADER = 10  # dtype code, ndim, up to 8 sizes


@dataclass
class IterationOutput:
    """What a rank contributes: its share of the summed loss and its optimizer-layout gradient shards."""

    loss_sum: float
    grad_shards: dict[str, Optional[torch.Tensor]]
    micro_batches: int
    # The rows this rank routed to each expert (``[E]`` int64, CPU), one per expert_dispatch, in call order.
    routing: list[torch.Tensor] = field(default_factory=list)


def send_header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > HEADER - 2:
        raise CommunicationError(f"cannot send a {t.dim()}-d activation; at most {HEADER - 2} dims")
    h = [DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(h + [0] * (HEADER - len(h)), dtype=torch.int64, device=t.device)


def from_header(h: torch.Tensor) -> torch.Tensor:
    """An empty activation buffer, on the header's device, of the dtype and shape it describes."""
    code, ndim, *sizes = h.tolist()
    return torch.empty(tuple(sizes[:ndim]), dtype=DTYPES[code], device=h.device)


def shards_device(shards: dict[str, torch.Tensor]) -> torch.device:
    """The device this rank computes on: that of its optimizer shards (CPU if it holds none)."""
    return next(iter(shards.values())).device if shards else torch.device("cpu")


@dataclass
class StageState:
    """One stage's per-micro-batch values between forward, backward and the sends that use them."""

    stage_graph: Any
    loss_scale: float
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    grads_in: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: dict[int, tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]] = field(default_factory=dict)
    loss_total: float = 0.0

    def data_args(self, batch: dict[str, torch.Tensor], mb: int) -> list[torch.Tensor]:
        """The stage's non-parameter arguments: graph inputs from the batch, then received values."""
        args = []
        for name in self.stage_graph.inputs:
            if name not in batch:
                raise InputError(f"micro-batch {mb} lacks input {name!r}; it has {sorted(batch)}")
            args.append(batch[name])
        return args + self.received.get(mb, [])

    def record(self, mb: int, outs: Any) -> list[torch.Tensor]:
        """Keep a forward's outputs (the loss apart) until its backward and sends; returns its routing
        counts (``StageGraph.routing_outputs``), on the CPU."""
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        kept = len(outs) - self.stage_graph.routing_outputs
        routed = [c.detach().to("cpu", torch.int64) for c in outs[kept:]]
        outs = outs[:kept]
        if self.stage_graph.returns_loss:
            self.losses[mb] = outs[0]
            outs = outs[1:]
        self.outputs[mb] = outs
        return routed

    def settle(self, mb: int) -> None:
        """Close a forward-only micro-batch: its loss summed now, its received activations dropped."""
        if self.stage_graph.returns_loss:
            self.loss_total += float(self.losses.pop(mb))
        self.received.pop(mb, None)

    def _roots(self, mb: int) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
        """Where the backward of ``mb`` starts: the scaled loss, or the outputs and their received grads."""
        if self.stage_graph.returns_loss:
            loss = self.losses.pop(mb)
            self.loss_total += float(loss.detach())
            return [loss * self.loss_scale], None
        pairs = [(o, g) for o, g in zip(self.outputs.pop(mb), self.grads_in.pop(mb)) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def backward(self, mb: int) -> None:
        """Backward of micro-batch ``mb``: from the scaled loss, or from the received output grads."""
        roots, grads = self._roots(mb)
        if roots:
            torch.autograd.backward(roots, grads)
        self.outputs.pop(mb, None)

    def backward_input(self, mb: int) -> None:
        """The input-gradient half (ZB ``I``): gradients of the received activations only, the graph kept
        for ``backward_weight`` (as ``torch.distributed.pipelining``'s ``stage_backward_input``)."""
        roots, grads = self._roots(mb)
        self.pending[mb] = (roots, grads)
        inputs = [r for r in self.received.get(mb, []) if r.requires_grad]
        if roots and inputs:
            for r, g in zip(inputs, torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)):
                r.grad = None if g is None else g.contiguous()  # autograd may hand back an expanded view
        self.outputs.pop(mb, None)

    def backward_weight(self, mb: int, params: Sequence[torch.Tensor]) -> None:
        """The weight-gradient half (ZB ``W``): accumulate the parameters' gradients of ``mb``. It walks
        the kept graph again to the parameters (no per-node input-gradient cache yet)."""
        roots, grads = self.pending.pop(mb)
        leaves = [p for p in params if p.requires_grad]
        if roots and leaves:
            torch.autograd.backward(roots, grads, inputs=leaves)
