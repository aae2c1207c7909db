"""docs/config.md's tables, generated from the config's types: a table per dataclass, a row per key
with its default and its docstring. ``python -m hgraph.training.config_reference`` rewrites the
generated part of docs/config.md; ``tests/test_docs.py`` fails when it is stale."""

from __future__ import annotations

import inspect
import logging
import re
import sys
from pathlib import Path
from typing import Any, Optional

from hgraph.core import atomic_files
from hgraph.training.config_sections import ConfigKey, config_tables, toml_value, walk
from hgraph.training.train_config import TrainConfig

BEGIN = "<!-- generated from the config's types by python -m hgraph.training.config_reference -->"
END = "<!-- end of the generated tables -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _markdown(text: str) -> str:
    """A docstring as markdown: ``x`` -> `x`."""
    return re.sub(r"``([^`]+)``", r"`\1`", text).replace("|", "\\|")


def default_cell(key: ConfigKey) -> str:
    """The default of ``key`` as docs/config.md shows it: a TOML value, ``required`` or ``none``."""
    if key.required:
        return "required"
    value: Any = toml_value(key, key.default)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in value) + "]`"
    return f"`{value!r}`"


def reference() -> str:
    """The generated part of docs/config.md: every table and key of ``TrainConfig``."""
    out = [BEGIN]
    for table in walk(config_tables(TrainConfig)):
        title = table.doc or inspect.getdoc(table.cls) or ""
        out += ["", f"## `[{table.name}]`" if table.name else "## Top level", "", _markdown(" ".join(title.split()))]
        if table.switch:
            out[-1] += " The table, even empty, switches it on; `--no-" + table.name + "` off."
        out += ["", "| key | default | what it does |", "|---|---|---|"]
        out += [f"| `{k.name}` | {default_cell(k)} | {_markdown(k.doc)} |" for k in table.keys]
    return "\n".join([*out, "", END])


def update_reference(page: Optional[Path] = None) -> Path:
    """Rewrite the generated part of docs/config.md (``page``) from ``reference()``."""
    path = page or PAGE
    text = path.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    atomic_files.write_text(path, text[:start] + reference() + text[end:])
    return path


__all__ = ["BEGIN", "END", "default_cell", "reference", "update_reference"]

if __name__ == "__main__":  # the page's path on stderr, as a log record (library code prints nothing)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger(__name__).info("wrote %s", update_reference(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
