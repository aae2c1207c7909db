"""The ``hgraph train`` config as a tree of frozen dataclasses, and what is derived from it.

``TrainConfig`` is the root; a field whose type is a dataclass is a table (``[optimizer]`` is an
``AdamWConfig``, ``[compile.schedule]`` a ``ScheduleConfig``; an ``Optional`` one, like
``[compile.schedule.overlap]``, is switched on by its presence); a field of a TOML type (bool, int,
float, str, a dtype name, a list) is a key, documented by the string literal under it
(``field_docs``). ``config_tables`` walks the tree once; ``read_table`` reads a TOML / JSON table into
it (typed values, the closest valid key for an unknown one, the dataclass's own checks). The flags,
the run folder's ``config.toml`` and docs/config.md are derived from the same walk.
"""

from __future__ import annotations

import difflib
import math
import sys
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, replace
from functools import cache
from typing import Any, Mapping, Optional

import torch

from hgraph.core.field_docs import field_docs
from hgraph.errors import HGraphError, InputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NOT_KEYS = frozenset({  # fields of the option types that hgraph train sets itself, or that hold Python values
    "source", "optimizer.lr_scheduler", "compile.layer_costs", "compile.topology", "compile.passes",
    "compile.disable", "compile.build.rank", "run.timeline", "run.device", "run.metrics", "run.weights",
    "run.init_seed", "run.release_model",
})
LEAVES = (bool, int, float, str, torch.dtype)


def setting(default: Any = MISSING, *, choices: tuple[Any, ...] = (), minimum: Optional[float] = None,
            resolve: str = "") -> Any:
    """A config field: its default, the values it takes (``choices``), its least value (``minimum``)
    and, for an input path, how it is resolved (``resolve``: ``"files"`` relative to the config,
    ``"file_or_name"`` too unless it reads as a name: hub id, preset, ``module:factory``)."""
    return field(default=default, metadata={"choices": choices, "minimum": minimum, "resolve": resolve})


@dataclass(frozen=True)
class ConfigKey:
    """One key of the config: a field of a TOML type."""

    name: str
    """The dotted name, as a flag without its ``--`` (``optimizer.lr``, ``world_size``)."""
    field: str
    """The dataclass field (``checkpoint.async`` is the field ``async_``)."""
    kind: Any
    """The type without ``Optional`` (``float``, ``tuple[str, ...]``, ``torch.dtype``)."""
    optional: bool
    """Whether none is a value (written by leaving the key out)."""
    default: Any
    """The value without the key (``MISSING``: required)."""
    doc: str
    choices: tuple[Any, ...] = ()
    minimum: Optional[float] = None
    resolve: str = ""
    """An input path: ``"files"`` or ``"file_or_name"`` (``setting``); ``""``: not a path."""

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def element(self) -> Any:
        """The element type of a list key (``None`` for a scalar)."""
        origin = typing.get_origin(self.kind)
        return typing.get_args(self.kind)[0] if origin in (tuple, frozenset) else None

    def __str__(self) -> str:
        return f"{self.name}: {getattr(self.kind, '__name__', self.kind)} = {self.default!r}"


@dataclass(frozen=True)
class ConfigTable:
    """One table of the config: a dataclass-typed field (the root ``TrainConfig`` is the table ``""``)."""

    name: str
    field: str
    """The field of the dataclass above that holds the table (``""``: the root)."""
    cls: type
    default: Any
    """The value without the table (``None``: the table switches the field on; ``MISSING``: the root)."""
    doc: str
    keys: tuple[ConfigKey, ...]
    tables: tuple["ConfigTable", ...]

    @property
    def switch(self) -> bool:
        return self.default is None

    def __str__(self) -> str:
        return f"[{self.name or 'top level'}] {self.cls.__name__}: {', '.join(k.name for k in self.keys)}"


def key_name(f: Field) -> str:
    """A field's key: its name without the trailing ``_`` that keeps it off a Python keyword (``async_``)."""
    return f.name.rstrip("_")


def _hints(cls: type) -> dict[str, Any]:
    """Field -> its evaluated annotation (``None`` where it names what the module does not import)."""
    namespace = vars(sys.modules[cls.__module__])
    out = {}
    for f in fields(cls):
        try:
            out[f.name] = eval(f.type, namespace) if isinstance(f.type, str) else f.type  # noqa: S307 - source
        except NameError:
            out[f.name] = None
    return out


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> (X, True); a union of a dataclass and other types -> the dataclass."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        tables = [a for a in args if is_dataclass(a)]
        if tables:
            return tables[0], optional
        return (args[0], optional) if len(args) == 1 else (None, optional)
    return hint, False


def _toml_type(kind: Any) -> bool:
    if kind in LEAVES:
        return True
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    return origin in (tuple, frozenset) and bool(args) and args[0] in (int, float, str)


@cache
def config_tables(root: type, name: str = "", field_name: str = "", default: Any = MISSING,
                  doc: str = "") -> ConfigTable:
    """The table tree of the dataclass ``root``: its keys and, recursively, its tables."""
    base = default if is_dataclass(default) else None
    docs, hints = field_docs(root), _hints(root)
    keys, tables = [], []
    for f in fields(root):
        dotted = f"{name}.{key_name(f)}" if name else key_name(f)
        kind, optional = _unwrap(hints[f.name])
        if dotted in NOT_KEYS or kind is None:
            continue
        value = getattr(base, f.name) if base is not None else f.default
        if is_dataclass(kind):
            tables.append(config_tables(typing.cast(type, kind), dotted, f.name, value, docs.get(f.name, "")))
        elif _toml_type(kind):
            meta = f.metadata
            keys.append(ConfigKey(dotted, f.name, kind, optional, value, docs.get(f.name, ""),
                                  meta.get("choices", ()), meta.get("minimum"), meta.get("resolve", "")))
    return ConfigTable(name, field_name, root, default, doc, tuple(keys), tuple(tables))


def walk(table: ConfigTable) -> list[ConfigTable]:
    """``table`` and every table under it, parents first."""
    return [table, *(t for child in table.tables for t in walk(child))]


def all_keys(table: ConfigTable) -> list[ConfigKey]:
    return [k for t in walk(table) for k in t.keys]


def _fail(source: str, key: str, message: str) -> InputError:
    return InputError(f"config {source}: {key}: {message}" if source else f"{key}: {message}")


def closest(name: str, known: list[str], prefix: str = "") -> str:
    """``; did you mean 'table.key'?`` for the valid key nearest to ``name``, else the valid keys."""
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {prefix + near[0]!r}?" if near else f"; valid: {', '.join(sorted(known))}"


def read_table(source: str, values: Any, table: ConfigTable, base: Any = None) -> Any:
    """The dataclass of ``table`` from a TOML / JSON table ``values`` (absent keys keep ``base``'s, or
    the table's default): ``InputError`` naming ``source`` and the key for an unknown key, a wrong
    type or a value the dataclass refuses."""
    where = table.name or "config"
    if not isinstance(values, dict):
        raise _fail(source, where, f"expected a table of settings, got {values!r}")
    if base is None:
        base = table.default if is_dataclass(table.default) else None
    keys = {k.name.rpartition(".")[2]: k for k in table.keys}
    children = {t.name.rpartition(".")[2]: t for t in table.tables}
    prefix = f"{table.name}." if table.name else ""
    for name in values:
        if name not in keys and name not in children:
            raise _fail(source, prefix + name, "unknown key" + closest(name, [*keys, *children], prefix))
    given: dict[str, Any] = {}
    for name, key in keys.items():
        if name in values:
            given[key.field] = typed(source, key, values[name])
        elif base is None and key.required:
            raise _fail(source, key.name, "missing (required)")
    for name, child in children.items():
        if name in values:
            current = getattr(base, child.field) if base is not None else None
            given[child.field] = read_table(source, values[name], child, current)
    try:
        return replace(base, **given) if base is not None else table.cls(**given)
    except HGraphError as exc:
        if not table.name:
            raise InputError(f"config {source}: {exc}" if source else str(exc)) from None
        raise _fail(source, where, str(exc)) from None


def typed(source: str, key: ConfigKey, value: Any) -> Any:
    """``value`` of ``key`` as its field's type (TOML has strings for dtypes, lists for tuples)."""
    if value is None and key.optional and key.default is None:
        return None
    kind, element = key.kind, key.element
    if kind is torch.dtype:
        if value not in DTYPES:
            raise _fail(source, key.name, f"{value!r}; expected one of {', '.join(map(repr, DTYPES))}")
        return None if value == "float32" and key.default is None else DTYPES[value]  # float32: no mixed precision
    if element is not None:
        if element is str and isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(_is(v, element) for v in value):
            raise _fail(source, key.name, f"expected a list of {element.__name__}s, got {value!r}")
        value = [_finite(source, key, element(v)) for v in value]
        return frozenset(value) if typing.get_origin(kind) is frozenset else tuple(value)
    if not _is(value, kind):
        raise _fail(source, key.name, f"expected {kind.__name__}, got {value!r}")
    value = _finite(source, key, kind(value))
    if key.choices and value not in key.choices:
        raise _fail(source, key.name, f"{value!r}; expected one of {', '.join(map(repr, key.choices))}")
    if key.minimum is not None and value < key.minimum:
        raise _fail(source, key.name, f"{value} is below the minimum {key.minimum:g}")
    return value


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind) or kind is float and isinstance(value, int)


def _finite(source: str, key: ConfigKey, value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(source, key.name, f"{value}; expected a finite number")
    return value


def toml_value(key: ConfigKey, value: Any) -> Any:
    """``value`` of ``key`` as TOML holds it (``None``: left out)."""
    if key.kind is torch.dtype:
        return str(value or torch.float32).removeprefix("torch.")
    if isinstance(value, frozenset):
        return sorted(value)
    return list(value) if isinstance(value, tuple) else value


def set_dotted(values: dict[str, Any], name: str, value: Any) -> None:
    """``values[a][b][c] = value`` for the dotted ``name`` ``a.b.c`` (tables made as needed)."""
    *tables, last = name.split(".")
    for t in tables:
        if not isinstance(values.get(t), dict):
            values[t] = {}
        values = values[t]
    values[last] = value


def get_dotted(values: Mapping[str, Any], name: str) -> Any:
    """``values[a][b][c]`` for ``a.b.c``, or ``None``."""
    for part in name.split("."):
        if not isinstance(values, Mapping) or part not in values:
            return None
        values = values[part]
    return values


__all__ = ["DTYPES", "NOT_KEYS", "ConfigKey", "ConfigTable", "all_keys", "closest", "config_tables", "get_dotted",
           "key_name", "read_table", "set_dotted", "setting", "toml_value", "typed", "walk"]
