"""The overlap graph: a stage program whose parameters are waited for at their first use.

Under ``hgraph.compile(..., schedule="overlap")`` each rank's pulls are prefetched and each one is
waited just before the forward first uses its parameter (the order: ``hgraph.compiler.overlap_order``).
``overlap_graph`` rewrites a stage graph so that the first use of each parameter placeholder goes
through a *use node*, which the executor (``hgraph.runtime.executor``) answers by running the pull
ops attached there; the placeholders then receive ``None``.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import fx


def overlap_graph(gm: fx.GraphModule, params: Sequence[str], use_param: Any) -> fx.GraphModule:
    """A copy of a stage graph where each parameter placeholder's first use goes through
    ``use_param(placeholder_name)`` (which waits its pull); the placeholders then receive ``None``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    params = set(params)
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.name not in params or not node.users:
            continue
        first = next(n for n in graph.nodes if n in node.users)
        with graph.inserting_before(first):
            ready = graph.call_function(use_param, (node.name,))
        node.replace_all_uses_with(ready, delete_user_cb=lambda n: n is not ready)
    graph.lint()
    return fx.GraphModule(gm, graph)
