"""Compile products: the typed values the compile steps build and hand to each other.

Stage programs (``StageGraph`` with its ``Boundary`` values) and communication subgraphs
(``CommSubgraph``, ``ParameterLayouts``, ``ParameterComm``); the rank program that holds them (and a
rank's overlap order, ``hgraph.schedule.lowerings.PullPushOrder``) is ``rank_program.RankProgram``.
Everything here is data, frozen; the compiler (``hgraph.compiler``) builds it with the passes of
``hgraph.passes``, and the runtime (``hgraph.runtime``) interprets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch.fx as fx

from hgraph.core.layout import AnyLayout, Layout
from hgraph.lnk.plan import ReshardPlan
from hgraph.lnk.rank_plan import RankPlan

PULL, PUSH, ACTIVATION = "pull_parameter", "push_gradient", "communicate_activation"


@dataclass(frozen=True)
class Boundary:
    """A value produced by stage ``src`` and consumed by stage ``dst``."""

    name: str
    src: int
    dst: int


@dataclass(frozen=True)
class StageGraph:
    """One stage's program: placeholders are ``params``, then ``inputs``, then ``recv`` values, then
    (once bound, ``passes/bind_rank.py``) the calling rank's ``RankContext``; outputs are the loss (last
    stage), the ``send`` values, then ``routing_outputs`` routing counts."""

    stage: int
    gm: fx.GraphModule
    params: list[str]
    inputs: list[str]
    recv: list[Boundary]
    send: list[Boundary]
    returns_loss: bool
    layers: tuple[int, ...] = field(default=())
    routing_outputs: int = 0  # trailing outputs: the rows routed to each expert, per expert_dispatch

    @property
    def output_names(self) -> list[str]:
        """Names of the values the stage returns, in order (``"loss"`` first on the last stage)."""
        names = ["loss"] if self.returns_loss else []
        seen = set()
        for b in self.send:
            if b.name not in seen:
                seen.add(b.name)
                names.append(b.name)
        return names

    def __str__(self) -> str:
        return (f"StageGraph(stage {self.stage}, layers {list(self.layers)}, {len(self.gm.graph.nodes)} nodes, "
                f"{len(self.params)} params, recv {[b.name for b in self.recv]}, send {[b.name for b in self.send]})")


@dataclass(frozen=True)
class CommSubgraph:
    """One named communication subgraph: its kind, tensor, layouts, logical bytes and LNK plan."""

    kind: str
    tensor: str
    src: Union[AnyLayout, str]
    dst: Union[AnyLayout, str]
    bytes: int
    plan: Union[ReshardPlan, RankPlan, None] = None  # a full plan, or one rank's part of it
    direction: str = "forward"

    def __str__(self) -> str:
        backward = " (backward)" if self.direction == "backward" and self.kind == ACTIVATION else ""
        return f"{self.kind:<22} {self.tensor:<44} {self.src} -> {self.dst}  {self.bytes} B{backward}"


@dataclass(frozen=True)
class ParameterLayouts:
    """The layouts one parameter moves between in a strategy: fixed optimizer layout, the compute
    layouts of its users (a "duplicate" union) and their gradients (a "partial" union)."""

    name: str
    holders: tuple[tuple[int, int], ...]
    optimizer: Layout
    compute: AnyLayout
    grads: AnyLayout

    def __str__(self) -> str:
        return f"ParameterLayouts({self.name}, holders {list(self.holders)}: {self.optimizer} <-> {self.compute})"



@dataclass(frozen=True)
class ParameterComm:
    """Pull and push of one parameter in one strategy, and which (pipeline, stage) pairs use it."""

    name: str
    holders: tuple[tuple[int, int], ...]
    pull: CommSubgraph
    push: CommSubgraph

    def __str__(self) -> str:
        return f"ParameterComm({self.name}, holders {list(self.holders)}, {self.pull.bytes} B pulled)"


@dataclass(frozen=True)
class PackingProof:
    """How a compiled model's micro-batches are packed, and why.

    ``exact``: several documents may share a micro-batch without changing any document's loss.
    ``method``: ``"graph"`` or ``"probe"`` (how it was proved; ``hgraph.compiler.packing_proof``) or
    ``"unproved"``. ``construct``: what the graph proof could not show (op, node, module);
    ``finding``: what the probe saw; ``probe_lengths``: the documents probed, per probe;
    ``packed_ms`` / ``alone_ms``: the probe's forward time packed and one document at a time;
    ``mode``: ``compile(packing=...)``. Training packs (``packs``) when exact and not ``"off"``.
    ``checked_tokens``: the longest packed row the proof covers; ``None`` for any length (the row's
    length never enters the program as a value). Where the program reads positions in the row (Llama
    4's query scale), only a probe shows packing exact, and only up to the row length it ran:
    ``CompiledModel.packing_for`` probes again before a longer row is trained.
    """

    exact: bool
    method: str
    construct: str = ""
    finding: str = ""
    probe_lengths: tuple[tuple[int, ...], ...] = ()
    packed_ms: Optional[float] = None
    alone_ms: Optional[float] = None
    mode: str = "auto"
    checked_tokens: Optional[int] = None

    @property
    def packs(self) -> bool:
        """Whether training puts several documents in one micro-batch."""
        return self.exact and self.mode != "off"

    @property
    def cost(self) -> Optional[float]:
        """Time of one document per run over packed, measured on the probe (``None`` if not probed)."""
        if self.packed_ms is None or self.alone_ms is None or self.packed_ms <= 0:
            return None
        return self.alone_ms / self.packed_ms

    @property
    def packing(self) -> str:
        """What training does: ``"packed"`` or ``"one document per micro-batch"``."""
        return "packed" if self.packs else "one document per micro-batch"

    def __str__(self) -> str:
        if self.mode == "off":
            return "packing off: one document per micro-batch"
        if self.exact:
            how = "from the graph" if self.method == "graph" else (
                "by probing " + "; ".join("+".join(map(str, p)) for p in self.probe_lengths) + " tokens"
            )
            note = f" (the graph alone could not show it: {self.construct})" if self.construct and self.method == "probe" else ""
            upto = f" for micro-batches of up to {self.checked_tokens} tokens" if self.checked_tokens is not None else ""
            return f"packing exact{upto}, proved {how}{note}"
        cost = f"; on the probe one document at a time took {self.cost:.2f}x the packed time" if self.cost else ""
        return (f"packing not proved exact: {self.construct or 'the graph proof failed'}"
                + (f"; probe: {self.finding}" if self.finding else "") + cost
                + "; training one document per micro-batch")
