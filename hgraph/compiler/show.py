"""Inspecting a compiled model: the communication records of a rank (``subgraphs``), ``explain`` (one
rank's program as text) and ``write_dot`` (Graphviz).

``CompiledModel.subgraphs``, ``explain`` and ``write_dot`` call these; the ``hgraph show`` command is
``hgraph.cli.show_cli``. Everything printed is read from the compile products (``hgraph.program``).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Protocol, Union

import torch
import torch.fx as fx

from hgraph.core import atomic_files
from hgraph.core.strategy import Strategy
from hgraph.passes.backward import comm_nodes
from hgraph.passes.recompute import regions
from hgraph.program.products import ACTIVATION, CommSubgraph
from hgraph.program.rank_program import CompiledPrograms
from hgraph.schedule.actions import steps
from hgraph.schedule.lowerings import lowering_name

StrategyLike = Union[int, Strategy]


class Inspectable(CompiledPrograms, Protocol):
    """What printing reads of a compiled model (``hgraph.compiler.compiled_model.CompiledModel`` is one)."""

    def backward_program(self, strategy: StrategyLike, rank: int, seq_len: int = 16) -> fx.GraphModule: ...


def subgraphs(compiled: CompiledPrograms, strategy: StrategyLike, rank: int) -> list[CommSubgraph]:
    """Communication subgraphs ``rank`` takes part in: pulls, activations (in-stage and between
    stages), pushes, in execution order."""
    prog = compiled.program(strategy, rank)
    records: list[CommSubgraph] = [pc.pull for pc in prog.pulls if rank in pc.pull.plan.ranks]
    for n in prog.stage_graph.gm.graph.nodes:
        info = n.meta.get("hgraph_comm")
        if info:
            records.append(activation_record(n, info))
    records += [a for a in prog.activations if f"stage{prog.stage}" in str(a.src) or f"stage{prog.stage}" in str(a.dst)]
    records += [pc.push for pc in prog.pushes if rank in pc.push.plan.ranks]
    return records


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
    schedule = lowering_name(prog.pipeline_schedule, prog.vpp)
    lines.append(f"compute: {len(compute)} ops; {schedule} schedule (4 micro-batches): "
                 + " ".join(" + ".join(map(str, step)) for step in steps(prog.pipeline_actions(4))))
    pipeline = s.pipelines[prog.pipeline]
    lines.append(f"recompute: {compiled.options.recompute_for(pipeline)}" + "".join(
        f"{': ' if i == 0 else '; '}layer {r.layer} ({r.summary()})" for i, r in enumerate(regions(sg.gm))))
    totals: dict[str, int] = {}
    for rec in subgraphs(compiled, strategy, rank):
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
    atomic_files.write_text(path, text)
    return text


def activation_subgraphs(stage_graphs: list, strategy: Strategy, pipeline_index: int) -> list[CommSubgraph]:
    """Communicate Activation records for the stage boundaries of one pipeline (both directions)."""
    pipeline = strategy.pipelines[pipeline_index]
    records = []
    for sg in stage_graphs:
        for b in sg.send:
            node = next(n for n in sg.gm.graph.nodes if n.name == b.name) if _has(sg.gm, b.name) else None
            spec = node.meta.get("hgraph_spec") if node is not None else None
            src = f"stage{b.src}{list(pipeline.stage_ranks(b.src % pipeline.pp))}"
            dst = f"stage{b.dst}{list(pipeline.stage_ranks(b.dst % pipeline.pp))}"
            if spec is not None:
                src += " " + ",".join(map(str, spec))
            nbytes = _bytes(node) if node is not None else 0
            records.append(CommSubgraph(ACTIVATION, b.name, src, dst, nbytes))
            records.append(CommSubgraph(ACTIVATION, b.name + ".grad", dst, src, nbytes, direction="backward"))
    return records


def _has(gm: fx.GraphModule, name: str) -> bool:
    return any(n.name == name for n in gm.graph.nodes)


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    total = val.element_size()
    for d in val.shape:
        try:
            total *= int(d)
        except (TypeError, ValueError):
            return 0
    return total


def activation_record(node: fx.Node, info: Any) -> CommSubgraph:
    """The ``CommSubgraph`` of a communication node ``localize`` inserted (its ``meta["hgraph_comm"]``)."""
    if isinstance(info, CommSubgraph):
        return info
    if isinstance(info, dict):
        src = info.get("src")
        dst = info.get("dst")
        fmt = lambda spec: ",".join(map(str, spec)) if isinstance(spec, (tuple, list)) else str(spec)  # noqa: E731
        return CommSubgraph(
            info.get("kind", ACTIVATION),
            f"{info.get('tensor', node.name)} ({info.get('op', node.target)}/{info.get('mesh_dim', '')})",
            fmt(src),
            fmt(dst),
            int(info.get("bytes", 0) or 0),
        )
    return CommSubgraph(ACTIVATION, node.name, "?", "?", 0)
