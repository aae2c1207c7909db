"""The stage mesh the sharding rules see: its mesh-dim names and ``ShardingOptions``.

A pipeline stage runs on a ``cp x tp`` mesh (``MESH_DIMS``); the nodes of an expert body (marked
``node.meta[MESH_KEY] == EXPERT_MESH`` by ``hgraph.passes.experts``) see the same ranks as the expert
mesh ``(ep, etp)`` (``ShardingOptions.experts``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch.fx as fx

from hgraph.errors import ShardingRuleError
from hgraph.lnk.transform import MeshDim

MESH_DIMS = ("cp", "tp")
MESH_KEY = "hgraph_mesh"  # node.meta key: which mesh a node's specs are on (absent: the stage mesh)
EXPERT_MESH = "expert"


@dataclass(frozen=True)
class ShardingOptions:
    """The stage mesh and the knobs of the annotate/localize passes.

    ``params``: names of the parameter placeholders (their spec is chosen by their consumers);
    ``None`` means placeholders named ``p_*`` (the frontend's and torch.export's convention).
    ``buffers``: names of buffer placeholders (replicated; ``None``: those named ``b_*``). Every other
    placeholder is a data input, token-split on cp along ``seq_dim``.
    ``position_ids``: the placeholder that packed attention reads sequence starts from.
    ``seq_dim``: the token dim of ``[batch, seq, ...]`` inputs and activations (cp splits it; sequence
    parallelism reduce-scatters 3-d activations along it).
    ``ep``: expert-parallel degree (``experts()`` gives the options of the expert mesh);
    ``mesh_names``: the group names of the two mesh dims (``("ep", "etp")`` on the expert mesh).
    """

    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    vocab_parallel: bool = True
    params: Optional[frozenset[str]] = None
    buffers: Optional[frozenset[str]] = None
    position_ids: str = "position_ids"
    seq_dim: int = 1
    ep: int = 1
    mesh_names: tuple[str, str] = MESH_DIMS

    def __post_init__(self) -> None:
        for name in ("cp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ShardingRuleError(f"mesh degree {name}={value!r} is invalid; use an integer >= 1")
        if not self.expert_parallel and (self.cp * self.tp) % self.ep:
            raise ShardingRuleError(f"ep={self.ep} does not divide the stage mesh cp{self.cp} x tp{self.tp}")

    @property
    def degrees(self) -> tuple[int, int]:
        return (self.cp, self.tp)

    @property
    def mesh_dims(self) -> tuple[MeshDim, MeshDim]:
        """The mesh as ``hgraph.lnk.transform_steps`` plans on it: cp holds load-balanced token
        chunks, ep (on the expert mesh) the rows of a rank's experts, tp and etp contiguous chunks."""
        first = "fixed" if self.expert_parallel else "balanced"
        return (MeshDim(self.mesh_names[0], self.cp, first), MeshDim(self.mesh_names[1], self.tp))

    @property
    def expert_parallel(self) -> bool:
        """Whether these are the options of an expert mesh ``(ep, etp)``."""
        return self.mesh_names == ("ep", "etp")

    def experts(self) -> "ShardingOptions":
        """The options of this stage's expert mesh: ``(ep, etp = cp·tp / ep)`` in the mesh-dim slots."""
        if self.expert_parallel:
            return self
        return replace(self, cp=self.ep, tp=self.cp * self.tp // self.ep, sequence_parallel=False,
                       mesh_names=("ep", "etp"))

    def for_node(self, node: fx.Node) -> "ShardingOptions":
        """The options of the mesh ``node``'s specs are on."""
        return self.experts() if node.meta.get(MESH_KEY) == EXPERT_MESH else self

    def __str__(self) -> str:
        flags = [name for name, on in (("sequence-parallel", self.sequence_parallel), ("vocab-parallel", self.vocab_parallel)) if on]
        mesh = f"{self.mesh_names[0]}{self.cp} x {self.mesh_names[1]}{self.tp}"
        kind = "expert mesh" if self.expert_parallel else "stage mesh"
        ep = f", ep{self.ep}" if self.ep > 1 and not self.expert_parallel else ""
        return f"{kind} {mesh}{ep}" + (f" ({', '.join(flags)})" if flags else "")

    @classmethod
    def from_context(cls, ctx: Any) -> "ShardingOptions":
        """Read the options from ``ctx``: a ``ShardingOptions``, a ``CompileContext`` or any object
        with ``cp``/``tp`` (and optionally ``sequence_parallel``, ``vocab_parallel``, ``traced``)."""
        if isinstance(ctx, cls):
            return ctx
        params = getattr(ctx, "params", None)
        buffers = getattr(ctx, "buffers", None)
        traced = getattr(ctx, "traced", None)
        if params is None and traced is not None:
            params = frozenset(getattr(traced, "param_names", {}) or ()) or None
        if buffers is None and traced is not None:
            buffers = frozenset(getattr(traced, "buffer_names", {}) or ())
        return cls(
            cp=getattr(ctx, "cp", 1),
            tp=getattr(ctx, "tp", 1),
            ep=getattr(ctx, "ep", 1),
            sequence_parallel=bool(getattr(ctx, "sequence_parallel", False)),
            vocab_parallel=bool(getattr(ctx, "vocab_parallel", True)),
            params=frozenset(params) if params is not None else None,
            buffers=frozenset(buffers) if buffers is not None else None,
        )

    def is_param(self, node: fx.Node) -> bool:
        if node.op != "placeholder":
            return False
        if self.params is not None:
            return node.name in self.params
        return node.name.startswith("p_")

    def is_buffer(self, node: fx.Node) -> bool:
        if node.op != "placeholder":
            return False
        if self.buffers is not None:
            return node.name in self.buffers
        return node.name.startswith("b_")
