"""The overlap graph: a stage program whose parameters are waited for at their first use.

Under ``hgraph.compile(..., schedule="overlap")`` each rank's pulls are prefetched and each one is
waited just before the forward first uses its parameter (the order: ``hgraph.compiler.overlap_order``).
``overlap_graph`` (the compiler's schedule step; the result is ``RankProgram.overlap_graph``)
rewrites a stage graph so that the first use of each parameter placeholder goes through a *use
node* that calls the graph's first argument, ``use(placeholder_name)``: the executor
(``hgraph.runtime.executor``) passes its own ``Executor.use``, which runs the pull ops attached
there; the parameter placeholders then receive ``None``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import fx

USE = "hgraph_use"  # the overlap graph's first placeholder: the callback its use nodes call


def use_parameter(use: Callable[[str], torch.Tensor], placeholder: str) -> torch.Tensor:
    """Graph node of ``overlap_graph``: the parameter of ``placeholder``, as ``use`` hands it over."""
    return use(placeholder)


def overlap_graph(gm: fx.GraphModule, params: Sequence[str]) -> fx.GraphModule:
    """A copy of a stage graph taking ``use`` first, where each parameter placeholder's first use
    goes through ``use_parameter(use, placeholder_name)`` (which waits its pull); the placeholders
    then receive ``None``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    first_placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_before(first_placeholder):
        use = graph.placeholder(USE)
    params = set(params)
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.name not in params or not node.users:
            continue
        first = next(n for n in graph.nodes if n in node.users)
        with graph.inserting_before(first):
            ready = graph.call_function(use_parameter, (use, node.name))
        node.replace_all_uses_with(ready, delete_user_cb=lambda n: n is not ready)
    graph.lint()
    return fx.GraphModule(gm, graph)
