"""A ``TrainConfig`` as TOML: every key with the value the run used (``hgraph train`` writes it to the
run folder as ``config.toml``; ``read_config`` reads it back to the same config). Keys whose value is
none are left out (none is what a missing key means), a switch table that is off too."""

from __future__ import annotations

import json
from dataclasses import is_dataclass
from typing import Any

from hgraph.training.config_sections import ConfigTable, config_tables, toml_value
from hgraph.training.train_config import TrainConfig


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # finite (the reader refuses others); repr reads back to the same float
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(map(_scalar, value)) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _lines(table: ConfigTable, value: Any) -> list[str]:
    out = [f"[{table.name}]"] if table.name else []
    for key in table.keys:
        written = toml_value(key, getattr(value, key.field))
        if written is not None:
            out.append(f"{key.name.rpartition('.')[2]} = {_scalar(written)}")
    for child in table.tables:
        inner = getattr(value, child.field)
        if is_dataclass(inner):
            out += ["", *_lines(child, inner)]
    return out


def to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a TOML config (``read_config`` of it equals ``cfg``)."""
    return "\n".join(_lines(config_tables(TrainConfig), cfg)) + "\n"


__all__ = ["to_toml"]
