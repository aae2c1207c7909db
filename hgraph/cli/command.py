"""The ``hgraph`` command line: one subcommand per module, imported only when used.

Each subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``. Errors that
derive from ``HGraphError`` (and missing/bad input files) end the program with a one-line message
and a non-zero exit code instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from importlib import metadata
from typing import Optional, Sequence

from hgraph.errors import HGraphError

SUBCOMMANDS = {
    "demo": ("hgraph.cli.demo_run", "train a small model on local CPU ranks, choosing the strategy per batch"),
    "lnk-demo": ("hgraph.cli.lnk_demo", "plan and execute layout changes with the LNK solver on 4 local ranks"),
    "plan": ("hgraph.cli.plan_cli", "plan iterations for a length file with a cost model"),
    "profile": ("hgraph.profiling.profile", "profile T(l) on this machine and write a cost table"),
    "show": ("hgraph.cli.show_cli", "compile a model and print a rank's program (dot/SVG too)"),
    "train": ("hgraph.cli.train_cli", "train a model from a TOML or JSON config on local ranks or under torchrun"),
}


def version() -> str:
    """The installed hgraph's version (``"source"`` when run from a checkout that is not installed)."""
    try:
        return metadata.version("hgraph")
    except metadata.PackageNotFoundError:
        return "source"


class DefaultsFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, unless the help names it or it is None / off."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hgraph", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hgraph {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=DefaultsFormatter)
        p.set_defaults(_module=module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("hgraph"):
                p.set_defaults(_missing=str(exc))
                continue
            raise
        module.add_arguments(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"hgraph {args.command}: not available in this build ({args._missing})", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except HGraphError as exc:
        print(f"hgraph {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:
        print(f"hgraph {args.command}: error: file not found: {exc.filename}", file=sys.stderr)
        return 1
    except json.JSONDecodeError as exc:
        print(f"hgraph {args.command}: error: bad JSON ({exc})", file=sys.stderr)
        return 1
    except UnicodeDecodeError as exc:
        print(f"hgraph {args.command}: error: an input file is not UTF-8 text ({exc.reason} at byte {exc.start})",
              file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"hgraph {args.command}: error: cannot read {exc.filename or 'an input file'}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hgraph {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
