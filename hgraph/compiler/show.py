"""Printing a compiled model: ``explain`` (one rank's program as text) and ``write_dot`` (Graphviz).

``CompiledModel.explain`` and ``CompiledModel.write_dot`` call these; the ``hgraph show`` command is
``hgraph.cli.show_cli``. Everything printed is read from the compile products (``hgraph.program.products``).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Protocol, Union

import torch.fx as fx

from hgraph.core.strategy import Strategy
from hgraph.passes.backward import comm_nodes
from hgraph.passes.insert_comm import activation_record
from hgraph.passes.recompute import regions
from hgraph.program.products import CommSubgraph, CompiledPrograms
from hgraph.schedule.actions import steps

StrategyLike = Union[int, Strategy]


class Inspectable(CompiledPrograms, Protocol):
    """What printing reads of a compiled model (``hgraph.compiler.compiled_model.CompiledModel`` is one)."""

    def subgraphs(self, strategy: StrategyLike, rank: int) -> list[CommSubgraph]: ...

    def backward_program(self, strategy: StrategyLike, rank: int, seq_len: int = 16) -> fx.GraphModule: ...


def explain(compiled: Inspectable, strategy: StrategyLike, rank: int, backward: bool = True) -> str:
    """Readable summary of one rank's program: compute, the three subgraph kinds, layouts, bytes;
    with ``backward``, the collectives of its traced backward (``backward_program``)."""
    prog = compiled.program(strategy, rank)
    s = compiled.strategies[prog.strategy_index]
    sg = prog.stage_graph
    lines = [
        f"strategy {s} — rank {rank}: pipeline {prog.pipeline} {s.pipelines[prog.pipeline]}, "
        f"stage {prog.stage}/{prog.pp} (layers {list(sg.layers)}), groups "
        + ", ".join(f"{k}={list(v)}" for k, v in prog.groups.items()),
    ]
    body = [n for r in regions(sg.gm) for n in r.body.graph.nodes]
    compute = [n for n in [*sg.gm.graph.nodes, *body]
               if n.op == "call_function" and not n.meta.get("hgraph_comm")
               and not (n.target is operator.getitem and n.args[0].op == "call_module")]
    schedule = "interleaved" if prog.vpp > 1 else prog.pipeline_schedule
    lines.append(f"compute: {len(compute)} ops; {schedule} schedule (4 micro-batches): "
                 + " ".join(" + ".join(map(str, step)) for step in steps(prog.pipeline_actions(4))))
    pipeline = s.pipelines[prog.pipeline]
    lines.append(f"recompute: {compiled.options.recompute_for(pipeline.cp, pipeline.tp, pipeline.pp)}" + "".join(
        f"{': ' if i == 0 else '; '}layer {r.layer} ({r.summary()})" for i, r in enumerate(regions(sg.gm))))
    totals: dict[str, int] = {}
    for rec in compiled.subgraphs(strategy, rank):
        lines.append("  " + str(rec))
        totals[rec.kind] = totals.get(rec.kind, 0) + rec.bytes
    lines.append("bytes: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    if backward:
        seq_len = 16 * len(prog.groups["cp"])  # 16 local tokens, in 2·cp load-balanced chunks
        nodes = comm_nodes(compiled.backward_program(strategy, rank, seq_len))
        lines.append(f"backward (1 x {seq_len} tokens): {len(nodes)} communication nodes")
        lines += [
            f"  {replace(activation_record(n, n.meta['hgraph_comm']), direction='backward')}"
            for n in nodes
        ]
    return "\n".join(lines)


def write_dot(compiled: Inspectable, strategy: StrategyLike, rank: int, path: str) -> str:
    """Write the rank's stage program as Graphviz dot (communication nodes highlighted)."""
    sg = compiled.program(strategy, rank).stage_graph
    lines = ["digraph hgraph {", "  node [shape=box, fontsize=10];"]
    for n in sg.gm.graph.nodes:
        style = ', style=filled, fillcolor="#ffd27f"' if n.meta.get("hgraph_comm") else ""
        label = f"{n.name}\\n{getattr(n.target, '__name__', n.target)}" if n.op == "call_function" else n.name
        lines.append(f'  "{n.name}" [label="{label}"{style}];')
        for a in n.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{n.name}";')
    lines.append("}")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as fh:
        fh.write(text)
    return text
