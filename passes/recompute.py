"""Recompute pass: wrap chosen layers of a stage program in checkpointed regions.

``RecomputeConfig(mode, layers=None, every=None, keep_communication=True)`` says what to recompute:
``mode`` ``"none"``, ``"selective"`` or ``"full"`` (see ``hgraph.runtime.kernels.recompute`` for what each
keeps), for every layer, the layer indices in ``layers``, or every ``every``-th layer (0, k, 2k, ...).
``keep_communication=False`` lets full recomputation reissue a layer's collectives in backward (two
all-reduces per tensor-parallel layer, as Megatron does) instead of keeping their outputs, so only the
layer inputs stay alive.

The pass runs on each stage program after ``partition``. Every maximal run of consecutive nodes of one
chosen layer becomes a ``RecomputedRegion`` submodule called once with the run's inputs (values from
outside the run: the layer input, parameters, rotary tables, position ids) and returning the values
used after it. A communication node inserted by ``localize`` belongs to the layer of its input.
Nodes outside layers (embedding, final norm, head, loss) are never recomputed. Results are unchanged:
the region runs the same ops in the same order, in forward and again in backward.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch.fx as fx

from hgraph.core.degrees import Degrees
from hgraph.passes.partition import node_layer
from hgraph.program.context import CompileContext
from hgraph.program.options import RecomputeConfig
from hgraph.runtime.kernels.recompute import RecomputedRegion


def region_layer(node: fx.Node) -> Optional[int]:
    """Layer a node belongs to for recomputation: its own, or for a communication node its input's."""
    if node.op != "call_function":
        return None
    layer = node_layer(node)
    if layer is None and node.meta.get("hgraph_comm") and node.all_input_nodes:
        layer = node_layer(node.all_input_nodes[0])
    return layer


def _runs(gm: fx.GraphModule, config: RecomputeConfig) -> list[tuple[int, list[fx.Node]]]:
    runs: list[tuple[int, list[fx.Node]]] = []
    for n in gm.graph.nodes:
        layer = region_layer(n)
        if layer is None or not config.applies_to(layer):
            continue
        if runs and runs[-1][0] == layer and runs[-1][1][-1].next is n:
            runs[-1][1].append(n)
        else:
            runs.append((layer, [n]))
    return runs


def _outline(gm: fx.GraphModule, layer: int, run: list[fx.Node], index: int, config: RecomputeConfig) -> None:
    members = set(run)
    inputs: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in run if any(u not in members for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in run:
        env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[n] for n in outputs))
    name = f"recompute_layer{layer}_{index}"
    gm.add_submodule(name, RecomputedRegion(fx.GraphModule(gm, body), layer, config.mode, config.keep_communication))
    with gm.graph.inserting_after(run[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["hgraph_recompute"] = {"layer": layer, "mode": config.mode, "nodes": len(run)}
    anchor, renamed = call, []
    for i, n in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            anchor = gm.graph.call_function(operator.getitem, (call, i))
        anchor.meta = dict(n.meta)
        n.replace_all_uses_with(anchor)
        renamed.append((anchor, n.name))
    for n in reversed(run):
        gm.graph.erase_node(n)
    for node, original in renamed:  # stage boundaries and explain refer to values by name
        node._rename(original)


def recompute(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Outline the layers ``ctx.recompute`` (else ``ctx.options.recompute_for`` the context's pipeline
    shape) chooses into ``RecomputedRegion`` calls."""
    config = RecomputeConfig.of(getattr(ctx, "recompute", None) or ctx.options.recompute_for(Degrees(ctx.tp, ctx.pp, ctx.cp)))
    if config.mode == "none":
        return gm
    for i, (layer, run) in enumerate(_runs(gm, config)):
        _outline(gm, layer, run, i, config)
    gm.graph.lint()
    gm.recompile()
    return gm


def regions(gm: fx.GraphModule) -> list[RecomputedRegion]:
    """The recomputed regions of a stage program, in execution order."""
    return [gm.get_submodule(n.target) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), RecomputedRegion)]
