"""The pass pipeline: an ordered list of named passes ``(GraphModule, ctx) -> GraphModule``.

Every pass is timed and logged, can be switched off by name, and user passes plug in at named
points (``Pass("bucket_pushes", fn, after="insert_comm")``). The context object carries what a pass
needs besides the graph (mesh degrees, strategy, options) and what later passes read (stage graphs,
communication plans), so passes stay plain functions that are easy to test alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch.fx as fx

from hgraph.errors import HGraphError

log = logging.getLogger("hgraph.passes")

PassFn = Callable[[fx.GraphModule, Any], fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    """A named pass; ``after``/``before`` place a user pass relative to a built-in one."""

    name: str
    fn: PassFn
    after: Optional[str] = None
    before: Optional[str] = None

    def __str__(self) -> str:
        where = f" after {self.after}" if self.after else f" before {self.before}" if self.before else ""
        return f"Pass({self.name}{where})"


@dataclass
class PassRecord:
    """What one pass run did: its name, seconds taken, and graph size before and after."""

    name: str
    seconds: float
    nodes_before: int
    nodes_after: int


@dataclass
class PassManager:
    """Runs passes in order; ``disabled`` names passes to skip."""

    passes: list[Pass]
    disabled: frozenset[str] = field(default_factory=frozenset)
    history: list[PassRecord] = field(default_factory=list)

    @classmethod
    def build(
        cls, builtin: Sequence[Pass], user: Iterable[Pass] = (), disabled: Iterable[str] = ()
    ) -> "PassManager":
        """Merge user passes into the built-in order at their named points."""
        order = list(builtin)
        names = {p.name for p in order}
        for p in user:
            if not isinstance(p, Pass):
                if callable(p):
                    p = Pass(getattr(p, "__name__", "user_pass"), p, after=order[-1].name if order else None)
                else:
                    raise HGraphError(f"{p!r} is not a Pass or a callable (gm, ctx) -> gm")
            anchor = p.after or p.before
            if anchor is None:
                order.append(p)
                continue
            if anchor not in names:
                raise HGraphError(
                    f"{p} names an unknown point {anchor!r}; known passes: {', '.join(x.name for x in order)}"
                )
            i = next(i for i, x in enumerate(order) if x.name == anchor)
            order.insert(i + 1 if p.after else i, p)
            names.add(p.name)
        disabled = frozenset(disabled)
        unknown = disabled - {p.name for p in order}
        if unknown:
            raise HGraphError(f"cannot disable unknown passes {sorted(unknown)}")
        return cls(order, disabled)

    def run(self, gm: fx.GraphModule, ctx: Any) -> fx.GraphModule:
        for p in self.passes:
            if p.name in self.disabled:
                log.info("pass %s: disabled", p.name)
                continue
            before = len(gm.graph.nodes)
            start = time.perf_counter()
            out = p.fn(gm, ctx)
            if not isinstance(out, fx.GraphModule):
                raise HGraphError(f"pass {p.name} returned {type(out).__name__}; a pass must return a GraphModule")
            gm = out
            record = PassRecord(p.name, time.perf_counter() - start, before, len(gm.graph.nodes))
            self.history.append(record)
            log.info("pass %s: %.3fs, %d -> %d nodes", p.name, record.seconds, before, record.nodes_after)
        return gm

    def __str__(self) -> str:
        return " -> ".join(p.name + (" (off)" if p.name in self.disabled else "") for p in self.passes)
