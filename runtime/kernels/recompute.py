"""Activation recomputation at run time: one layer of a stage program under ``torch.utils.checkpoint``.

The ``recompute`` pass (``hgraph.passes.recompute``) moves each chosen layer's nodes into a
``RecomputedRegion`` module. Its forward runs the layer under non-reentrant checkpointing with a
selective-checkpoint policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``), which
decides per op whether its output is stored in forward or recomputed in backward:

* ``full``: every op is recomputed, except communication (``torch.ops.hgraph.*`` collectives), whose
  outputs are kept, so a recomputed layer never issues its tensor-parallel collectives twice. With no
  collective in the layer (tp = cp = 1) only the layer's inputs stay alive. With
  ``keep_communication=False`` the collectives are recomputed too (issued again in backward, in the
  same order on every rank of the group), and only the inputs stay alive at any tp.
* ``selective``: matrix products, packed attention and communication are kept; the cheap ops between
  them (norms, activations, rotary, residual adds, views) are recomputed. Packed attention never stores
  its scores (its backward recomputes them, like flash attention), so keeping its output is the
  Megatron choice of not materialising the attention core.

Recomputation replays the layer with the forward's RNG state, so dropout masks match, and with the
forward's arguments, the rank context among them (a bound program passes it to each region as its
last argument; the backward may run on an autograd device thread).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hgraph.runtime.kernels.context import INPUT

MODES = ("none", "selective", "full")

_MATMULS = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
})


def _is_communication(op: Any) -> bool:
    return getattr(op, "namespace", None) == "hgraph" and "attention" not in str(op)


def _is_attention(op: Any) -> bool:
    return getattr(op, "namespace", None) == "hgraph" and "attention" in str(op)


def kept_op(mode: str, op: Any, keep_communication: bool = True) -> bool:
    """Whether ``op``'s output is stored in forward (not recomputed) under ``mode``."""
    if _is_communication(op):
        return keep_communication or mode == "selective"
    return mode == "selective" and (op in _MATMULS or _is_attention(op))


def _policy(mode: str, keep: bool, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if kept_op(mode, op, keep) else CheckpointPolicy.PREFER_RECOMPUTE


class RecomputedRegion(nn.Module):
    """One layer's nodes (``body``, an fx graph) run under checkpointing with the ``mode`` policy."""

    def __init__(self, body: fx.GraphModule, layer: int, mode: str, keep_communication: bool = True) -> None:
        super().__init__()
        self.body = body
        self.layer = layer
        self.mode = mode
        self.keep_communication = keep_communication

    def _contexts(self) -> Any:
        return create_selective_checkpoint_contexts(functools.partial(_policy, self.mode, self.keep_communication))

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body(*args)
        return checkpoint(self.body, *args, use_reentrant=False, context_fn=self._contexts)

    def summary(self) -> str:
        """What the region stores in forward: its inputs and the outputs of the kept ops."""
        nodes = [n for n in self.body.graph.nodes if n.op == "call_function"]
        comm = sum(1 for n in nodes if n.meta.get("hgraph_comm"))
        reissued = not self.keep_communication and self.mode == "full"
        kept = [f"{comm} collectives reissued in backward" if reissued else f"{comm} collective outputs (not reissued)"
                ] if comm else []
        if self.mode == "selective":
            names = [str(getattr(n.target, "__name__", n.target)) for n in nodes if not n.meta.get("hgraph_comm")]
            kept.append(f"{sum('linear' in t or t.startswith(('mm', 'addmm', 'bmm', 'matmul')) for t in names)} "
                        "matmul outputs")
            kept.append(f"{sum('attention' in t for t in names)} attention outputs")
        inputs = sum(1 for n in self.body.graph.nodes if n.op == "placeholder" and n.name != INPUT)
        return f"{len(nodes)} ops, keeps its {inputs} inputs" + "".join(f", {k}" for k in kept)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, mode={self.mode}"
