"""Bind the rank: a stage program takes the calling rank's ``RankContext`` as its last argument.

One compiled stage program serves every rank of its stage (simulated ranks run it on threads at
once), and its communication names logical mesh dims (``"tp"``, ``"cp"``). Which rank runs is thus
an argument of each call: ``bind_rank`` adds the placeholder ``rank_context`` after the others and
passes it, as the ``rank_context`` keyword, to every call of a kernel that communicates or reads the
rank's coordinates (``RANK_KERNELS``), and as the last argument to each recomputed region, whose
body is bound the same way. The runtime calls a bound program as ``gm(*params, *inputs, *received,
rank_context)``.

``route_counts`` makes the router statistics data: the rows routed to each expert (the ``counts``
of every ``expert_dispatch`` of the program, in call order) become the program's last outputs, which
the executor takes off and returns in ``IterationOutput.routing``.
"""

from __future__ import annotations

import torch.fx as fx

from hgraph.runtime.kernels import collectives, expert_dispatch, packed_attention, vocab_parallel
from hgraph.runtime.kernels.context import INPUT
from hgraph.runtime.kernels.recompute import RecomputedRegion

RANK_KERNELS = frozenset({
    collectives.all_reduce, collectives.reduce_scatter, collectives.all_gather, collectives.split,
    collectives.all_to_all, collectives.grad_all_reduce, collectives.all_reduce_max,
    expert_dispatch.expert_dispatch, expert_dispatch.expert_combine, expert_dispatch.token_chunk,
    expert_dispatch.token_gather, packed_attention.packed_attention, packed_attention.own_kv_heads,
    vocab_parallel.vocab_parallel_embedding, vocab_parallel.vocab_parallel_cross_entropy,
})


def bind_rank(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (changed in place) taking the ``RankContext`` as its last argument (module docstring)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if any(n.name == INPUT for n in placeholders):
        return gm
    if placeholders:
        with gm.graph.inserting_after(placeholders[-1]):
            rank = gm.graph.placeholder(INPUT)
    else:
        with gm.graph.inserting_before(nodes[0]):
            rank = gm.graph.placeholder(INPUT)
    for node in nodes:
        if node.op == "call_function" and node.target in RANK_KERNELS:
            node.kwargs = {**node.kwargs, "rank_context": rank}  # the kernels' keyword
        elif node.op == "call_module" and isinstance(gm.get_submodule(node.target), RecomputedRegion):
            bind_rank(gm.get_submodule(node.target).body)
            node.args = (*node.args, rank)
    gm.recompile()
    return gm


def route_counts(gm: fx.GraphModule) -> int:
    """Append the ``counts`` of every ``expert_dispatch`` of ``gm`` (in place) to its outputs; returns
    how many were appended."""
    counts = [n.args[1] for n in gm.graph.nodes
              if n.op == "call_function" and n.target is expert_dispatch.expert_dispatch]
    if not counts:
        return 0
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    output.args = ((*outs, *counts),)
    gm.recompile()
    return len(counts)
