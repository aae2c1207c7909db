"""The trainer's state in the open: full parameters, the model's ``state_dict`` and checkpoints.

``TrainerState`` is the part of ``hgraph.Trainer`` that reads or replaces what training holds: each
parameter gathered in full from the optimizer shards (one at a time, a collective per tensor), the
unmodified model's ``state_dict`` under its own names, and sharded checkpoints
(``hgraph.runtime.checkpoint``). ``params_without_gradient`` names the parameters the optimizer skips.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from hgraph.core.layout import Layout
from hgraph.core.placement import Replicate
from hgraph.errors import CheckpointError
from hgraph.lnk import solve
from hgraph.runtime import checkpoint
from hgraph.runtime.kernels.comm import Communicator
from hgraph.runtime.kernels.reshard import execute
from hgraph.runtime.optimizer import ShardedAdamW

if TYPE_CHECKING:
    from hgraph.compiler.compiled_model import CompiledModel


def params_without_gradient(traced: Any) -> frozenset[str]:
    """FQNs that never get a gradient: frozen (``requires_grad=False``) or not on the loss's path.

    The optimizer skips them, as ``torch.optim.AdamW`` skips a parameter whose ``.grad`` is ``None``
    (the Push of such a parameter still runs, carrying zeros, so every rank issues the same plans).
    """
    graph = traced.graph_module.graph
    stack = [n for n in graph.nodes if n.op == "output"]
    reaches_loss: set[str] = set()
    while stack:
        for node in stack.pop().all_input_nodes:
            if node.name not in reaches_loss:
                reaches_loss.add(node.name)
                stack.append(node)
    params = traced.params()
    return frozenset(
        fqn
        for placeholder, fqn in traced.param_names.items()
        if placeholder not in reaches_loss or not params[fqn].requires_grad
    )


class TrainerState:
    """Gathering, exporting and checkpointing the state of a ``Trainer`` (its base class; the
    attributes below are set by ``Trainer.__init__``)."""

    compiled: "CompiledModel"
    comm: Communicator
    optimizer: ShardedAdamW
    rank: int
    world: tuple[int, ...]
    data: Any

    def iter_parameters(self, dst: Optional[int] = None) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """Every parameter in full (fp32), one at a time, gathered from the optimizer shards onto rank
        ``dst`` alone (``None``: onto every rank); ranks that receive nothing get ``None``. Call on every
        rank and consume it whole: each step is a collective."""
        ranks = self.world if dst is None else (dst,)
        for fqn, shard in self.optimizer.shards.items():
            src = self.compiled.optimizer_layouts[fqn]
            dst_layout = Layout(src.shape, ranks, (len(ranks),), (Replicate(),))
            yield fqn, execute(solve(src, dst_layout), shard.detach(), self.comm)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full (fp32), gathered from the optimizer shards onto every rank."""
        return {fqn: value for fqn, value in self.iter_parameters() if value is not None}

    def save(self, path: str, extra: Optional[dict[str, Any]] = None) -> Any:
        """Write a sharded checkpoint (see ``hgraph.runtime.checkpoint``), with the data position of
        the loader ``step_data`` reads; call on every rank."""
        return checkpoint.save(self, path, extra)

    def load(self, path: str, data: Any = None) -> dict[str, Any]:
        """Resume from a checkpoint, resharding if the world or layouts changed; returns its ``extra``.
        ``data``: the ``TokenLoader`` to put back at the saved position (then read by ``step_data``)."""
        path = str(checkpoint.resolve(path))
        extra = checkpoint.load(self, path)
        if data is not None:
            state = checkpoint.read_manifest(path).get("data")
            if state is None:
                raise CheckpointError(f"checkpoint {path} holds no data position (it was saved before any "
                                      "step_data); resume the data another way or pass data=None")
            data.load_state_dict(state)
            self.data = data
        return extra

    def state_items(self, dtype: Optional[torch.dtype] = None, dst: Optional[int] = None,
                    aliases: bool = True) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """The unmodified model's ``state_dict`` entries one at a time, in its order: parameters gathered
        from the optimizer shards as they come (one in full at a time), buffers as the model holds
        them; each on CPU in its dtype in the model (or ``dtype``). Only rank ``dst`` receives values
        (``None``: every rank); elsewhere they are ``None``. ``aliases=False`` leaves out the second and
        later names of a tied parameter. Call on every rank and consume it whole."""
        model = self.compiled.model
        canonical = {id(p): fqn for fqn, p in model.named_parameters()}
        refs = model.state_dict(keep_vars=True)
        names = Counter(canonical[id(ref)] for ref in refs.values() if id(ref) in canonical)
        layouts = self.compiled.optimizer_layouts
        ranks = self.world if dst is None else (dst,)
        receive = self.rank in ranks
        held: dict[str, Optional[torch.Tensor]] = {}  # gathered values of tied parameters, for their aliases
        for name, ref in refs.items():
            fqn = canonical.get(id(ref))
            if fqn is None:
                value: Optional[torch.Tensor] = ref.detach().to("cpu").clone() if receive else None
            elif fqn in held:
                if not aliases:
                    continue
                value = held[fqn]
            else:
                src = layouts[fqn]
                plan = solve(src, Layout(src.shape, ranks, (len(ranks),), (Replicate(),)))
                value = execute(plan, self.optimizer.shards[fqn].detach(), self.comm)
                if value is not None:
                    value = value.to(device="cpu", dtype=dtype or ref.dtype)
                if names[fqn] > 1:
                    held[fqn] = value
            if fqn is None and value is not None and dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            yield name, value

    def state_dict(self, dtype: Optional[torch.dtype] = None, dst: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The unmodified model's ``state_dict`` with the trained parameters: the model's own names
        (tied aliases included), full tensors on CPU, each in its dtype in the model (or ``dtype``);
        buffers as the model holds them. Gathered tensor by tensor (``state_items``) onto every rank,
        or with ``dst`` onto that rank alone (the others get ``{}``). Call on every rank."""
        items = self.state_items(dtype, dst)
        out = {name: value for name, value in items if value is not None}
        return out if dst is None or self.rank == dst else {}
