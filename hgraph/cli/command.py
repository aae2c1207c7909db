"""The ``hgraph`` command line: one subcommand per module, imported only when used.

Each subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``. Errors that
derive from ``HGraphError`` (and missing/bad input files) end the program with a one-line message
and a non-zero exit code instead of a traceback. Library code prints nothing: its records go to the
``hgraph`` logger, shown here on stderr (warnings; ``--verbose``: info too; ``--quiet``: errors
only, and no progress bars).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from importlib import metadata
from typing import Iterator, Optional, Sequence

from hgraph.core.progress import PROGRESS_ENV
from hgraph.errors import HGraphError

SUBCOMMANDS = {
    "demo": ("hgraph.cli.demo_run", "train a small model on local CPU ranks, choosing the strategy per batch"),
    "lnk-demo": ("hgraph.cli.lnk_demo", "plan and execute layout changes with the LNK solver on 4 local ranks"),
    "plan": ("hgraph.cli.plan_cli", "plan iterations for a length file with a cost model"),
    "profile": ("hgraph.cli.profile_cli", "profile T(l) on this machine and write a cost table"),
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
        talk = p.add_mutually_exclusive_group()
        talk.add_argument("-v", "--verbose", action="store_true", help="show hgraph's info log records on stderr")
        talk.add_argument("-q", "--quiet", action="store_true",
                          help=f"only errors on stderr, no progress bars (as {PROGRESS_ENV}=0)")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("hgraph"):
                p.set_defaults(_missing=str(exc))
                continue
            raise
        module.add_arguments(p)
    return parser


@contextlib.contextmanager
def console_logging(verbose: bool = False, quiet: bool = False) -> Iterator[logging.Handler]:
    """While inside: hgraph's log records on stderr, one line each (``LEVEL logger: message``):
    warnings and errors, info too when ``verbose``, errors only when ``quiet`` (which also turns
    progress bars off, in the ranks started meanwhile as well). Afterwards as before."""
    level = logging.INFO if verbose else logging.ERROR if quiet else logging.WARNING
    logger = logging.getLogger("hgraph")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(level)
    saved_level, saved_progress = logger.level, os.environ.get(PROGRESS_ENV)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    if quiet:
        os.environ[PROGRESS_ENV] = "0"
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)
        if saved_progress is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = saved_progress


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with console_logging(getattr(args, "verbose", False), getattr(args, "quiet", False)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the subcommand; its errors as one line on stderr and an exit code."""
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
