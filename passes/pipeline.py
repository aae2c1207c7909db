"""The pass pipeline: every compile stage is a named point where passes ``(GraphModule, CompileContext)
-> GraphModule`` run, with a read-only context.

The built-in points, in order, and the graph each pass (and every user pass anchored there) sees::

    precision, annotate,  passes on the local program of a (cp, tp) stage mesh (precision: a reduced
    localize              compute dtype computes as torch.autocast does)
    partition             step: that program cut into stage programs, once per pipeline scheme
                          (cp, tp, pp); passes after it see them in ctx.stages
    recompute             pass on each stage program (ctx.stage)
    insert_comm           step: once per strategy (ctx.strategy), the Pull/Push layouts of every
                          parameter (ctx.parameter_layouts after it), on the local program of its first
                          pipeline (each rank plans its part later)
    schedule              step: the rank's program lowered (ctx.program; ``schedule="overlap"``: its
                          pull/push order, ``PullPushOrder``), on the rank's stage program

A *pass* transforms the graph it is given. A *step* (partition, insert_comm, schedule) computes a
product instead: the compiler calls a plain typed function there (``hgraph.compiler``) and hands
the passes anchored after it a new context holding the product. Every run is timed and kept as a
``PassRecord`` (``compiled.pass_history``). User passes plug in ``after=`` or ``before=`` any point
(``Pass("bucket_pushes", fn, after="insert_comm")``) and run at that point's level; ``disable=``
switches passes off by name (steps cannot be). An unknown anchor or name raises ``InputError``
listing the valid ones. At a step's level the graph is not what the compile keeps, so a user pass
there must hand back the graph it got unchanged: one that returns another graph (or changes its
node count) raises, as the change would be lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional, Sequence, TypeVar, Union

import torch.fx as fx

from hgraph.errors import HGraphError, InputError

if TYPE_CHECKING:
    from hgraph.program.context import CompileContext

log = logging.getLogger(__name__)

PassFn = Callable[[fx.GraphModule, "CompileContext"], fx.GraphModule]
T = TypeVar("T")

# The built-in passes by level, in order; a level's graph is described in the module docstring.
LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mesh", ("precision", "annotate", "localize")),
    ("pipeline", ("partition",)),
    ("stage", ("recompute",)),
    ("strategy", ("insert_comm",)),
    ("rank", ("schedule",)),
)
BUILTIN = tuple(name for _, names in LEVELS for name in names)
STEPS = {"pipeline": "partition", "strategy": "insert_comm", "rank": "schedule"}  # level -> its compile step
REQUIRED = frozenset(STEPS.values())  # steps: they make what later stages read


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
    """The passes of one level in order: built-ins with the user passes anchored at them, or at a step
    level the user passes before and after the step (its name stands where the step runs)."""

    level: str
    order: tuple[Union[Pass, str], ...]
    disabled: frozenset[str] = frozenset()

    @classmethod
    def for_level(cls, level: str, builtin: Optional[Mapping[str, PassFn]] = None, user: Sequence[Pass] = (),
                  disabled: frozenset[str] = frozenset()) -> "PassManager":
        """This level's built-in passes (``builtin``: name -> function; none at a step level) with the
        ``user`` passes anchored at its points inserted."""
        names, builtin = dict(LEVELS)[level], builtin or {}
        if set(builtin) != {n for n in names if n not in REQUIRED}:
            raise HGraphError(f"level {level} runs {[n for n in names if n not in REQUIRED]}, got {sorted(builtin)}")
        order: list[Union[Pass, str]] = [n if n in REQUIRED else Pass(n, builtin[n]) for n in names]
        for p in user:
            anchor = p.after or p.before
            if anchor not in names:
                continue
            i = next(i for i, x in enumerate(order) if _name(x) == anchor)
            if p.after:  # after the anchor and after the user passes already placed after it
                i += 1
                while i < len(order) and isinstance(order[i], Pass) and order[i].after == anchor:
                    i += 1
            order.insert(i, p)
        return cls(level, tuple(order), disabled)

    @property
    def passes(self) -> tuple[Pass, ...]:
        return tuple(p for p in self.order if isinstance(p, Pass))

    def run(self, gm: fx.GraphModule, ctx: "CompileContext", scope: str = "") -> tuple[fx.GraphModule, list[PassRecord]]:
        """Run every enabled pass of a graph level on ``gm``; the final graph and one record per pass run."""
        if self.level in STEPS:
            raise HGraphError(f"the {self.level} level runs around its step: use PassManager.around")
        return self._run(self.order, gm, ctx, scope)

    def around(self, gm: fx.GraphModule, ctx: "CompileContext", scope: str, step: Callable[[], T],
               with_product: Callable[[T], "CompileContext"]) -> tuple[T, list[PassRecord]]:
        """At a step level: the passes before the step on ``(gm, ctx)``, the step (``step()``: its
        product, timed as a record of the step's name), the passes after it on ``(gm,
        with_product(product))``; returns the product and the records."""
        at = self.order.index(STEPS[self.level])
        _, records = self._run(self.order[:at], gm, ctx, scope)
        start = time.perf_counter()
        product = step()
        nodes = len(gm.graph.nodes)
        records.append(PassRecord(STEPS[self.level], time.perf_counter() - start, nodes, nodes, scope))
        log.info("pass %s", records[-1])
        _, more = self._run(self.order[at + 1:], gm, with_product(product), scope)
        return product, records + more

    def _run(self, passes: Sequence[Union[Pass, str]], gm: fx.GraphModule, ctx: "CompileContext",
             scope: str) -> tuple[fx.GraphModule, list[PassRecord]]:
        records = []
        for p in passes:
            assert isinstance(p, Pass)
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
            if self.level in STEPS and (out is not gm or len(out.graph.nodes) != before):
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
        return f"{self.level}: " + " -> ".join(
            _name(p) + (" (off)" if _name(p) in self.disabled else " (step)" if isinstance(p, str) else "")
            for p in self.order)


def _name(point: Union[Pass, str]) -> str:
    return point if isinstance(point, str) else point.name
