"""The pass pipeline: every compile stage is a named pass ``(GraphModule, CompileContext) -> GraphModule``.

The built-in passes, in order, and the graph each one (and every user pass anchored at it) sees::

    annotate, localize    the local program of a (cp, tp) stage mesh
    partition             that program, once per pipeline scheme (cp, tp, pp); cuts ctx.stages
    precision, recompute  each stage program (ctx.stage)
    insert_comm           once per strategy (ctx.strategy), on the local program of its first
                          pipeline: the Pull/Push layouts of every parameter from the stage programs into
                          ctx.parameter_layouts (each rank plans its part later)
    schedule              the stage program of one rank (ctx.program): lowers its schedule
                          (``schedule="overlap"``: the pull/push order, ``RankSchedule``)

Every run is timed and kept as a ``PassRecord`` (``compiled.pass_history``). User passes plug in
``after=`` or ``before=`` any built-in pass (``Pass("bucket_pushes", fn, after="insert_comm")``) and
run at that pass's level; ``disable=`` switches passes off by name. An unknown anchor or name raises
``InputError`` listing the valid ones. Passes that leave products in the context (partition,
insert_comm, schedule) must hand back the graph they got unchanged: a user pass at their level that
returns another graph (or changes its node count) raises, as the change would be lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import torch.fx as fx

from hgraph.core.errors import HGraphError, InputError

if TYPE_CHECKING:
    from hgraph.program.products import CompileContext

log = logging.getLogger("hgraph.passes")

PassFn = Callable[[fx.GraphModule, "CompileContext"], fx.GraphModule]

# The built-in passes by level, in order; a level's graph is described in the module docstring.
LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mesh", ("annotate", "localize")),
    ("pipeline", ("partition",)),
    ("stage", ("precision", "recompute")),
    ("strategy", ("insert_comm",)),
    ("rank", ("schedule",)),
)
BUILTIN = tuple(name for _, names in LEVELS for name in names)
REQUIRED = frozenset({"partition", "insert_comm", "schedule"})  # they make what later stages read
KEEPS_GRAPH = frozenset({"pipeline", "strategy", "rank"})  # levels whose products live in the context


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


@dataclass(frozen=True)
class PassRecord:
    """What one pass run did: its name, where it ran (``scope``), seconds, graph size before and after."""

    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    scope: str = ""

    def __str__(self) -> str:
        return (f"{self.name} [{self.scope}]: {self.seconds * 1e3:.1f} ms, "
                f"{self.nodes_before} -> {self.nodes_after} nodes")


def level_of(name: str) -> str:
    """The level of a built-in pass."""
    return next(level for level, names in LEVELS if name in names)


def checked_user_passes(passes: Sequence[object]) -> list[Pass]:
    """User passes as ``Pass`` objects anchored at a built-in pass (a bare callable or a ``Pass``
    without an anchor runs after ``localize``); ``InputError`` on anything else."""
    out = []
    for p in passes:
        if not isinstance(p, Pass):
            if not callable(p):
                raise InputError(f"{p!r} is not a hgraph.Pass or a callable (gm, ctx) -> gm")
            p = Pass(getattr(p, "__name__", "user_pass"), p, after="localize")
        elif p.after is None and p.before is None:
            p = Pass(p.name, p.fn, after="localize")
        anchor = p.after or p.before
        if anchor not in BUILTIN:
            raise InputError(
                f"{p} names an unknown point {anchor!r}; user passes go before or after one of {list(BUILTIN)}"
            )
        if p.name in BUILTIN or p.name in [q.name for q in out]:
            raise InputError(f"{p}: the name {p.name!r} is taken; give each pass its own name")
        out.append(p)
    return out


def checked_disabled(disabled: Iterable[str], user: Sequence[Pass]) -> frozenset[str]:
    """``disable=`` names: passes that exist and may be switched off; ``InputError`` otherwise."""
    names = frozenset((disabled,) if isinstance(disabled, str) else disabled)
    switchable = [n for n in BUILTIN if n not in REQUIRED] + [p.name for p in user]
    unknown = sorted(names - set(switchable))
    if unknown:
        required = sorted(names & REQUIRED)
        why = f" ({', '.join(required)} cannot be: later stages read what it makes)" if required else ""
        raise InputError(
            f"disable={unknown} names no pass that can be switched off{why}; the passes that can be "
            f"switched off are {switchable} (compile with passes=[...] to add your own)"
        )
    return names


@dataclass(frozen=True)
class PassManager:
    """The passes of one level in order (built-ins with the user passes anchored at them)."""

    level: str
    passes: tuple[Pass, ...]
    disabled: frozenset[str] = frozenset()

    @classmethod
    def for_level(cls, level: str, builtin: Sequence[Pass], user: Sequence[Pass] = (),
                  disabled: frozenset[str] = frozenset()) -> "PassManager":
        """``builtin`` (this level's passes) with the ``user`` passes anchored at them inserted."""
        order = list(builtin)
        names = {p.name for p in builtin}
        if names != set(dict(LEVELS)[level]):
            raise HGraphError(f"level {level} runs {sorted(dict(LEVELS)[level])}, got {sorted(names)}")
        for p in user:
            anchor = p.after or p.before
            if anchor not in names:
                continue
            i = next(i for i, x in enumerate(order) if x.name == anchor)
            if p.after:  # after the anchor and after the user passes already placed after it
                i += 1
                while i < len(order) and order[i].after == anchor:
                    i += 1
            order.insert(i, p)
        return cls(level, tuple(order), disabled)

    def run(self, gm: fx.GraphModule, ctx: "CompileContext", scope: str = "") -> tuple[fx.GraphModule, list[PassRecord]]:
        """Run every enabled pass on ``gm``; the final graph and one record per pass run."""
        records = []
        for p in self.passes:
            if p.name in self.disabled:
                log.info("pass %s [%s]: disabled", p.name, scope)
                continue
            before = len(gm.graph.nodes)
            start = time.perf_counter()
            out = p.fn(gm, ctx)
            if not isinstance(out, fx.GraphModule):
                raise HGraphError(
                    f"pass {p.name} [{scope}] returned {type(out).__name__}; a pass must return a GraphModule"
                )
            if self.level in KEEPS_GRAPH and (out is not gm or len(out.graph.nodes) != before):
                raise HGraphError(
                    f"pass {p.name} [{scope}] changed the graph at the {self.level} level, whose products "
                    f"live in the context ({', '.join(dict(LEVELS)[self.level])}); return the graph it got "
                    "unchanged, or change graphs at the mesh or stage level (after='localize', 'recompute', ...)"
                )
            gm = out
            record = PassRecord(p.name, time.perf_counter() - start, before, len(gm.graph.nodes), scope)
            records.append(record)
            log.info("pass %s", record)
        return gm, records

    def __str__(self) -> str:
        return f"{self.level}: " + " -> ".join(p.name + (" (off)" if p.name in self.disabled else "") for p in self.passes)
