"""``hgraph show``: compile a model and print one rank's program (and write it as dot / SVG).

The printing itself is ``hgraph.compiler.show``; this module is the command.

    hgraph show --model hgraph.cli.demo:tiny_model --strategy "tp2,pp2" --strategy "4x tp1" --rank 1
"""

from __future__ import annotations

import argparse
import shutil
import subprocess

import torch

from hgraph.compiler.entry import compile as compile_model
from hgraph.errors import InputError
from hgraph.models import load_factory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="hgraph.cli.demo:tiny_model", help="module:factory returning an nn.Module")
    parser.add_argument("--strategy", action="append", help="a strategy, e.g. 'tp2 + 2x tp1' (repeatable)")
    parser.add_argument("--index", type=int, default=0, help="which of the strategies to show (default 0)")
    parser.add_argument("--rank", type=int, default=0, help="which rank's program to show")
    parser.add_argument("--seq-len", type=int, default=16, help="example sequence length for tracing")
    parser.add_argument("--code", action="store_true", help="also print the stage program as Python code")
    parser.add_argument("--dot", help="write the stage program as Graphviz dot to this file")
    parser.add_argument("--svg", help="write the stage program as SVG (needs Graphviz 'dot' on PATH)")


def run(args: argparse.Namespace) -> int:
    model = load_factory(args.model)()
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"--model {args.model!r} returned {type(model).__name__}, not a torch.nn.Module")
    vocab = getattr(getattr(model, "config", None), "vocab_size", 256)
    strategies = args.strategy or ["tp1"]
    compiled = compile_model(model, strategies, example_inputs=torch.randint(0, vocab, (1, args.seq_len)))
    print(compiled)
    print(compiled.explain(args.index, args.rank))
    program = compiled.program(args.index, args.rank)
    if args.code:
        print(program.stage_graph.gm.code)
    if args.dot or args.svg:
        dot_path = args.dot or (args.svg + ".dot")
        compiled.write_dot(args.index, args.rank, dot_path)
        print(f"wrote {dot_path}")
        if args.svg:
            exe = shutil.which("dot")
            if exe is None:
                raise InputError("--svg needs Graphviz's 'dot' program (apt-get install graphviz); the .dot file was written")
            subprocess.run([exe, "-Tsvg", dot_path, "-o", args.svg], check=True)
            print(f"wrote {args.svg}")
    return 0
