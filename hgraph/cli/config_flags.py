"""The ``hgraph train`` flags: one ``--section.key`` per config key (``--optimizer.lr 3e-4``,
``--checkpoint.resume`` / ``--no-checkpoint.resume``, ``--data.paths a b``), grouped by table, their
help the key's docstring, derived from the config's types; a switch table is a flag of its own
(``--compile.schedule.overlap`` / ``--no-compile.schedule.overlap``). The flags hgraph train had
before (``--world-size``, ``--compute-dtype`` ...) are other names of the same flags."""

from __future__ import annotations

import argparse
from typing import Any

from hgraph.errors import InputError
from hgraph.schedule.lowerings import PLACEMENTS
from hgraph.training.config_reference import default_cell
from hgraph.training.config_sections import DTYPES, ConfigKey, config_tables, typed, walk
from hgraph.training.train_config import TrainConfig

PREFIX = "config:"  # the flags' attributes on the parsed namespace: config:optimizer.lr
ALIASES = {  # the key flags hgraph train had before every key was one
    "world_size": "--world-size", "compile.compute_dtype": "--compute-dtype",
    "compile.reduce_dtype": "--reduce-dtype", "compile.recompute.mode": "--recompute",
    "compile.schedule.pipeline": "--pipeline-schedule", "planner.mode": "--planner",
    "planner.cost_table": "--cost-table",
}
PLACEMENT_FLAG = "--schedule"  # none | overlap: the [compile.schedule.overlap] switch, as before


def _help(text: str, default: str = "") -> str:
    text = " ".join(text.replace("``", "").split()).replace("%", "%%")
    return f"{text} (default: {default.strip('`')})" if default else text


class _Placement(argparse.Action):
    """``--schedule none | overlap``: the overlap table off or on."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values != "none")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per key of ``TrainConfig`` (and per switch table), in a group per table."""
    for table in walk(config_tables(TrainConfig)):
        group = parser.add_argument_group(f"[{table.name}]" if table.name else "config keys",
                                          _help(table.doc) if table.name else None)
        if table.switch:
            group.add_argument(f"--{table.name}", dest=PREFIX + table.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=_help(f"switch [{table.name}] on or off"))
            if table.name == "compile.schedule.overlap":
                group.add_argument(PLACEMENT_FLAG, dest=PREFIX + table.name, action=_Placement,
                                   choices=PLACEMENTS, default=argparse.SUPPRESS,
                                   help=f"the same as --{table.name} (overlap) / --no-{table.name} (none)")
        for key in table.keys:
            _add(group, key)


def _add(group: Any, key: ConfigKey) -> None:
    names = [f"--{key.name}", *([ALIASES[key.name]] if key.name in ALIASES else [])]
    options: dict[str, Any] = {"dest": PREFIX + key.name, "default": argparse.SUPPRESS,
                               "help": _help(key.doc, default_cell(key)), "metavar": key.name.rpartition(".")[2].upper()}
    if key.kind is bool:
        options.pop("metavar")
        options["action"] = argparse.BooleanOptionalAction
    elif key.kind.__name__ == "dtype":
        options["choices"] = tuple(DTYPES)
        options.pop("metavar")
    elif key.element is not None:
        options.update(nargs="+", type=key.element)
    else:
        options["type"] = key.kind
        if key.choices:
            options["choices"] = key.choices
            options.pop("metavar")
    group.add_argument(*names, **options)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys (and switch tables) the command line gives: dotted name -> value, each checked
    against its key (``InputError`` naming the flag)."""
    keys = {k.name: k for t in walk(config_tables(TrainConfig)) for k in t.keys}
    given = {name[len(PREFIX):]: value for name, value in vars(args).items() if name.startswith(PREFIX)}
    for name, value in given.items():
        if name in keys:
            try:
                typed("", keys[name], list(value) if isinstance(value, (list, tuple)) else value)
            except InputError as exc:
                raise InputError(f"--{exc}") from None
    return given


__all__ = ["add_config_flags", "overrides"]
