"""The ``hgraph train`` config tables that are the library's option types, one to one: ``[optimizer]``
is an ``AdamWConfig``, ``[lr_schedule]`` an ``LRScheduleConfig``, ``[compile]`` a ``CompileOptions``
with ``[compile.recompute]``, ``[compile.schedule]`` (``[compile.schedule.overlap]``: overlap on) and
``[compile.build]``, ``[run]`` a ``RunConfig``. A table's keys are the dataclass's field names, its
values are checked by the field's type and by the dataclass itself (``__post_init__``), and
docs/config.md's rows for them are generated from the field docstrings (``reference``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Optional

import torch

from hgraph.core import atomic_files
from hgraph.core.field_docs import field_docs
from hgraph.errors import HGraphError, InputError
from hgraph.program.options import BuildConfig, CompileOptions, OverlapConfig, RecomputeConfig, ScheduleConfig
from hgraph.training.configs import AdamWConfig, LRScheduleConfig, RunConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BEGIN = "<!-- generated from the field docstrings by hgraph.training.config_sections.reference -->"
END = "<!-- end of the generated tables -->"


@dataclass(frozen=True)
class Section:
    """One config table and the dataclass it is."""

    name: str
    """The table (``compile.schedule``); a dot nests it in the table before (a field of that dataclass)."""
    cls: type
    """The dataclass the table is."""
    default: Any
    """The value without the table (``None``: the table switches the field on, e.g. overlap)."""
    skip: frozenset[str] = frozenset()
    """Fields ``hgraph train`` sets itself (or that take Python values)."""
    title: str = ""
    """What the table is for, above its rows in docs/config.md."""

    @property
    def field(self) -> str:
        return self.name.rpartition(".")[2]

    def children(self) -> list["Section"]:
        return [s for s in SECTIONS if s.name.rpartition(".")[0] == self.name]

    def keys(self) -> list[str]:
        nested = {c.field for c in self.children()}
        return [f.name for f in fields(self.cls) if f.name not in self.skip and f.name not in nested]


SECTIONS: tuple[Section, ...] = (
    Section("optimizer", AdamWConfig, AdamWConfig(grad_clip=1.0), frozenset({"lr_scheduler"}),
            "The sharded AdamW (`hgraph.AdamWConfig`)."),
    Section("lr_schedule", LRScheduleConfig, LRScheduleConfig(), title="The learning-rate schedule "
            "(`hgraph.training.configs.LRScheduleConfig`, handed to the optimizer as its `lr_scheduler`)."),
    Section("compile", CompileOptions, CompileOptions(), frozenset({"layer_costs", "topology", "passes", "disable"}),
            "How the model is compiled (`hgraph.CompileOptions`)."),
    Section("compile.recompute", RecomputeConfig, RecomputeConfig(), title="Recomputation (`hgraph.RecomputeConfig`); "
            "the planner's cost model counts the mode."),
    Section("compile.schedule", ScheduleConfig, ScheduleConfig(), title="The pipeline schedule (`hgraph.ScheduleConfig`)."),
    Section("compile.schedule.overlap", OverlapConfig, None, title="Overlapped communication "
            "(`hgraph.program.options.OverlapConfig`): the table, even empty, switches it on (bit-identical results)."),
    Section("compile.build", BuildConfig, BuildConfig(), frozenset({"rank"}),
            "What is built at compile and the plan cache (`hgraph.BuildConfig`; every rank builds its own programs)."),
    Section("run", RunConfig, RunConfig(), frozenset({"timeline", "device", "metrics", "weights", "init_seed",
                                                      "release_model"}),
            "How the `Trainer` runs (`hgraph.RunConfig`; device, metrics and weights come from the keys above)."),
)
TOP_SECTIONS = tuple(s for s in SECTIONS if "." not in s.name)


def read_sections(path: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Each top-level section's value from the config ``raw`` (its defaults where a table is absent)."""
    return {s.name: _read(path, raw.get(s.name), s) for s in TOP_SECTIONS}


def _fail(path: str, key: str, message: str) -> InputError:
    return InputError(f"config {path}: {key}: {message}")


def _read(path: str, table: Any, section: Section) -> Any:
    if table is None:
        return section.default
    if not isinstance(table, dict):
        raise _fail(path, section.name, f"expected a table of settings, got {table!r}")
    children = {c.field: c for c in section.children()}
    known = section.keys() + list(children)
    unknown = set(table) - set(known)
    if unknown:
        raise _fail(path, section.name, f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
    types = {f.name: str(f.type) for f in fields(section.cls)}
    base = section.default if section.default is not None else section.cls()
    values = {k: _value(path, section, k, types[k], v, getattr(base, k)) for k, v in table.items() if k not in children}
    values.update({k: _read(path, table.get(k), c) for k, c in children.items() if k in table})
    try:
        return replace(base, **values)
    except HGraphError as exc:
        raise _fail(path, section.name, str(exc)) from None


def _value(path: str, section: Section, key: str, annotation: str, value: Any, default: Any) -> Any:
    """``value`` of ``section.key`` as the field's type (TOML has strings for dtypes, lists for tuples)."""
    where = f"{section.name}.{key}"
    if "dtype" in annotation:
        if value not in DTYPES:
            raise _fail(path, where, f"{value!r}; expected one of {', '.join(map(repr, DTYPES))}")
        return None if value == "float32" and default is None else DTYPES[value]  # float32: no mixed precision
    if "tuple[float" in annotation or "frozenset[int]" in annotation:
        kind = float if "float" in annotation else int
        if not isinstance(value, list) or not all(_is(v, kind) for v in value):
            raise _fail(path, where, f"expected a list of {kind.__name__}s, got {value!r}")
        if kind is float and not all(math.isfinite(v) for v in value):
            raise _fail(path, where, f"{value!r}; expected finite numbers")
        return tuple(kind(v) for v in value) if kind is float else frozenset(value)
    for kind in (bool, float, int, str):
        if kind.__name__ in annotation:
            if not _is(value, kind):
                raise _fail(path, where, f"expected {kind.__name__}, got {value!r}")
            if kind is float and not math.isfinite(value):
                raise _fail(path, where, f"{value}; expected a finite number")
            return float(value) if kind is float else value
    raise _fail(path, where, f"cannot be set in a config ({annotation})")


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind) or kind is float and isinstance(value, int)


# ---------------------------------------------------------------------- docs/config.md
def toml_default(section: Section, key: str) -> Any:
    """The default of ``section.key`` as a TOML value (``None``: unset)."""
    base = section.default if section.default is not None else section.cls()
    value = getattr(base, key)
    if isinstance(value, torch.dtype) or value is None and "dtype" in str(
            next(f.type for f in fields(section.cls) if f.name == key)):
        return str(value or torch.float32).removeprefix("torch.")
    if isinstance(value, (tuple, frozenset)):
        return list(value)
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list):
        return "`[" + ", ".join(map(repr, value)) + "]`"
    return f"`{value!r}`"


def _markdown(text: str) -> str:
    """A docstring as markdown: ``x`` -> `x`."""
    return re.sub(r"``([^`]+)``", r"`\1`", text).replace("|", "\\|")


def reference() -> str:
    """docs/config.md's tables of the sections, from the field docstrings and defaults."""
    out = [BEGIN]
    for s in SECTIONS:
        docs = field_docs(s.cls)
        out += ["", f"## `[{s.name}]`", "", s.title, "", "| key | default | what it does |", "|---|---|---|"]
        out += [f"| `{s.name}.{k}` | {_cell(toml_default(s, k))} | {_markdown(docs[k])} |" for k in s.keys()]
    return "\n".join([*out, "", END])


def update_reference(page: Optional[str] = None) -> None:
    """Rewrite the generated part of docs/config.md (``page``) from ``reference()``."""
    path = Path(page) if page else Path(__file__).resolve().parents[2] / "docs" / "config.md"
    text = path.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    atomic_files.write_text(path, text[:start] + reference() + text[end:])


__all__ = ["DTYPES", "SECTIONS", "Section", "read_sections", "reference", "toml_default", "update_reference"]
