"""The sequence bound a model states, as torch.export finds it: the dynamic-shape spec for capture.

Real models cap their length in many ways — a position table or rotary cache sliced ``[:t]``, a
``tril`` buffer sliced to ``t``, ``assert t <= config.block_size`` — under whatever name their author
chose — or ``if t > self.max_seq_length: raise ValueError(...)`` (an ``if`` whose only body raises
states a bound as an ``assert`` does: ``raises_only``). Rather than guess names, hgraph exports with
an unbounded (or ``max_seq_len``-bounded) ``seq`` and, when export reports ``Constraints violated``,
takes export's own suggested fix
(``torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes``) and exports again. A fix
that only lowers ``seq``'s maximum is a bound: accepted. Any other fix (a constant, a multiple, a
minimum above 2) means the model branches on the length in Python: refused, naming the module and
source line where the guard was added (``SizeGuards`` records them while export runs).
"""

from __future__ import annotations

import ast
import linecache
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.export import Dim
from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRONTEND_DIR = os.path.dirname(__file__)
_GUARD_LOGGER = "torch.fx.experimental.symbolic_shapes"


@dataclass(frozen=True)
class SizeGuard:
    """A condition on a size that export added while running the user's code at ``filename:lineno``."""

    expr: str
    filename: str
    lineno: int
    code: str
    module: str

    def __str__(self) -> str:
        return f"{self.module}at {self.filename}:{self.lineno}: `{self.code}` (export's guard {self.expr})"


class SizeGuards(logging.Handler):
    """Collects the size conditions the user's own Python evaluated during export (torch's ``[guard
    added]`` log records whose frame is outside torch: an ``if``, an ``assert``), with the ``nn.Module``
    whose ``forward`` it is. Guards torch's ops add (a slice of a table) are bounds, not branches."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(logging.INFO)
        self.guards: list[SizeGuard] = []
        self._names = {id(m): name for name, m in model.named_modules()}

    def emit(self, record: logging.LogRecord) -> None:
        if "[guard added]" not in str(record.msg) or not isinstance(record.args, tuple) or len(record.args) < 3:
            return
        location = getattr(record.args[2], "framework_loc", None)
        filename = getattr(location, "filename", None)
        if not isinstance(filename, str) or filename.startswith((_TORCH_DIR, _FRONTEND_DIR)):
            return
        frame = sys._getframe(1)
        while frame is not None and not (frame.f_code.co_filename == filename and frame.f_lineno == location.lineno):
            frame = frame.f_back  # type: ignore[assignment]
        module, code = "", (location.line or "").strip()
        if frame is not None and frame.f_code.co_argcount:
            owner = frame.f_locals.get(frame.f_code.co_varnames[0])
            if isinstance(owner, nn.Module) and id(owner) in self._names:
                module = f"module '{self._names[id(owner)] or '<root>'}' ({type(owner).__name__}) "
        self.guards.append(SizeGuard(str(record.args[1]), filename, location.lineno, code, module))

    def branch(self) -> Optional[SizeGuard]:
        """The first size condition the user's Python branched on (an ``assert``, a ``torch._check`` or
        an ``if`` that only raises states a bound and is no branch)."""
        for guard in self.guards:
            stated = guard.code.startswith("assert") or "torch._check" in guard.code
            if not stated and not raises_only(guard.filename, guard.lineno):
                return guard
        return None


def raises_only(filename: str, lineno: int) -> bool:
    """Whether the statement at ``filename:lineno`` is an ``if`` without ``else`` whose body is a single
    ``raise``: its condition can only stop the model (a bound), never pick another computation."""
    statement = _statements(filename).get(lineno)
    return (isinstance(statement, ast.If) and not statement.orelse and len(statement.body) == 1
            and isinstance(statement.body[0], ast.Raise))


def _statements(filename: str) -> dict[int, ast.stmt]:
    """The ``if`` statements of a source file by first line ({} when it cannot be read or parsed)."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return {}
    return {node.lineno: node for node in ast.walk(tree) if isinstance(node, ast.If)}


def watching(guards: SizeGuards) -> "_Watch":
    """Attach ``guards`` to torch's symbolic-shapes logger for the duration of an export."""
    return _Watch(guards)


class _Watch:
    def __init__(self, guards: SizeGuards) -> None:
        self.guards = guards
        self.logger = logging.getLogger(_GUARD_LOGGER)

    def __enter__(self) -> SizeGuards:
        self.saved = (self.logger.level, self.logger.propagate, self.logger.handlers)
        self.logger.handlers = [self.guards]  # the records are ours: torch's own handler prints nothing
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        return self.guards

    def __exit__(self, *exc: Any) -> None:
        level, self.logger.propagate, self.logger.handlers = self.saved
        self.logger.setLevel(level)


def sequence_spec(input_names: tuple[str, ...], max_seq_len: Optional[int]) -> dict[str, dict[int, Dim]]:
    """Batch and sequence dynamic in every input; ``seq`` at most ``max_seq_len`` when given."""
    batch, seq = Dim("batch"), Dim("seq", max=max_seq_len)
    return {name: {0: batch, 1: seq} for name in input_names}


def refined_spec(error: BaseException, spec: dict[str, dict[int, Any]], example_seq: int) -> Optional[dict]:
    """Export's suggested fix applied to ``spec`` if it only bounds ``seq`` from above (still covering
    the example's length), else None: the model specialises on its length in another way."""
    message = getattr(error, "msg", None)
    if not isinstance(message, str):
        return None
    if "Suggested fixes:" not in message:
        return _below_the_limit(message, spec, example_seq)
    try:
        refined = refine_dynamic_shapes_from_suggested_fixes(message, spec)
    except Exception:  # noqa: BLE001 - a fix torch's own parser cannot apply is no bound
        return None
    if not all(type(d) is Dim for d in _dims(refined)):  # a constant or a derived (2*_seq) size
        return None
    batch, seq = refined[next(iter(refined))][0], refined[next(iter(refined))][1]
    if batch.min > 2 or batch.max != Dim("batch").max or seq.min > 2 or not example_seq <= seq.max:
        return None
    return refined


def _below_the_limit(message: str, spec: dict[str, dict[int, Any]], example_seq: int) -> Optional[dict]:
    """A bound at the limit itself, for which export suggests no fix (``size != 64`` where ``seq`` may
    reach 64; MPT's ``512 - max(0, 512 - size) != 512``): ``seq`` below the smallest constant of the
    violated guards that exceeds the example. Export proves the graph for the whole new range, so a
    constant that is no bound fails the next round and is refused then."""
    seq = spec[next(iter(spec))][1]
    guards = [line for line in message.splitlines() if "satisfy the generated guard" in line]
    literal = re.compile(r"(?<![\w\[])(\d+)(?!\w)")  # not the ``[1]`` of ``size()[1]``
    constants = {int(c) for line in guards for c in literal.findall(line.split("guard", 1)[1])}
    limits = sorted(c - 1 for c in constants if example_seq < c <= seq.max)
    if not limits or limits[0] >= seq.max:
        return None
    batch, bounded = spec[next(iter(spec))][0], Dim(seq.__name__, min=seq.min, max=limits[0])
    return {name: {0: batch, 1: bounded} for name in spec}


def _dims(spec: dict[str, dict[int, Any]]) -> Iterator[Any]:
    for per_input in spec.values():
        yield from per_input.values()


__all__ = ["SizeGuard", "SizeGuards", "raises_only", "refined_spec", "sequence_spec", "watching"]
