"""Partition pass: cut one pipeline's program into ``pp`` stages at layer boundaries.

Layers are the numbered blocks of the model (``layers.3.``, ``h.3.`` in the module path that
torch.export records in ``node.meta["nn_module_stack"]``). Consecutive layers are grouped into
stages so that the largest stage cost is smallest (cost: parameter elements per layer by default,
or a per-layer cost the user supplies); what comes before the first layer (embeddings) joins stage 0
and what comes after the last (final norm, head, loss) joins the last stage.

Stage of every other node:
* a node with a layer ancestor runs in the latest stage among its inputs (comm nodes, residual adds);
* a node computed from graph inputs alone (no parameter, e.g. rotary tables from ``position_ids``) is
  recomputed in every stage that uses it instead of being sent;
* any other node without a layer (embedding) runs in the earliest stage that consumes it.
A value produced in stage ``s`` and used in a later stage ``t`` becomes an output of ``s`` and an
input of ``s + 1`` (a *boundary*), passed on stage by stage until ``t``: the runtime sends it with a
Communicate Activation step, always between neighbouring stages as the 1F1B schedule expects.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from hgraph.errors import StrategyError
from hgraph.core.layer_names import layer_index
from hgraph.program.products import Boundary, StageGraph

def node_layer(node: fx.Node) -> Optional[int]:
    """Layer of a node from the innermost module that recorded one."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        layer = layer_index(path)
        if layer is not None:
            return layer
    return None


def balance_layers(costs: Sequence[float], pp: int, head: float = 0.0, tail: float = 0.0) -> list[int]:
    """Stage of each layer: contiguous groups minimising the largest stage cost.

    ``head``/``tail`` are the costs that always sit in the first/last stage (embedding, head).
    """
    n = len(costs)
    if pp > n:
        raise StrategyError(f"pp={pp} is larger than the model's {n} layers; use pp <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max-cost of splitting layers[:i] into k stages; cut[k][i] = start of stage k.
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (head if k == 1 else 0.0) + (tail if k == pp else 0.0)
                value = max(best[k - 1][j], cost)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    stages = [0] * n
    i = n
    for k in range(pp, 0, -1):
        j = cut[k][i]
        for layer in range(j, i):
            stages[layer] = k - 1
        i = j
    return stages


def _size_op(target: object) -> bool:
    """Arithmetic on sizes: ``sym_size``, Python operators, ``torch.sym_max``..."""
    if target is torch.ops.aten.sym_size.int:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return False
    return getattr(target, "__module__", "") == "_operator" or getattr(target, "__name__", "").startswith("sym_")


def assign_stages(
    gm: fx.GraphModule,
    pp: int,
    is_param: Callable[[fx.Node], bool],
    layer_costs: Optional[Sequence[float]] = None,
) -> tuple[dict[fx.Node, set[int]], list[int]]:
    """Stage set of every node (placeholders and recomputed input-only nodes may have several)."""
    nodes = list(gm.graph.nodes)
    layer = {n: node_layer(n) for n in nodes if n.op == "call_function"}
    layers_seen = sorted({v for v in layer.values() if v is not None})
    if pp > 1 and not layers_seen:
        raise StrategyError(
            "pp > 1 needs numbered layers (module paths like 'layers.3.' or 'h.3.') and none were found"
        )
    n_layers = (max(layers_seen) + 1) if layers_seen else 1
    if layer_costs is None:
        costs = [0.0] * n_layers
        for n in nodes:
            if n.op == "placeholder" and is_param(n):
                users_layers = {layer.get(u) for u in n.users} - {None}
                numel = _numel(n)
                for lay in users_layers:
                    costs[lay] += numel / len(users_layers)
        costs = [c if c > 0 else 1.0 for c in costs]
    else:
        if len(layer_costs) != n_layers:
            raise StrategyError(f"layer_costs has {len(layer_costs)} entries but the model has {n_layers} layers")
        costs = list(layer_costs)
    stage_of_layer = balance_layers(costs, pp) if pp > 1 else [0] * n_layers

    # Forward: nodes with a layer, or downstream of one, get the latest stage among their inputs.
    from_params: dict[fx.Node, bool] = {}
    fixed: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder":
            from_params[n] = is_param(n)
            continue
        if n.op == "output":
            continue
        inputs = [a for a in n.all_input_nodes]
        from_params[n] = any(from_params.get(a, False) for a in inputs)
        stages = [fixed[a] for a in inputs if a in fixed]
        # Size arithmetic (``batch * heads``) belongs to no layer: it is recomputed where it is used.
        val = n.meta.get("val")
        size_only = (isinstance(val, (int, torch.SymInt)) or _size_op(n.target)
                     or (not isinstance(val, torch.Tensor) and not from_params[n] and not stages))
        if layer.get(n) is not None and not size_only:
            fixed[n] = max([stage_of_layer[layer[n]]] + stages)
        elif stages:
            fixed[n] = max(stages)
    # Backward: the rest runs where its first consumer runs (or everywhere it is used, if input-only).
    stage_sets: dict[fx.Node, set[int]] = {n: {s} for n, s in fixed.items()}
    last = pp - 1
    for n in reversed(nodes):
        if n.op == "output":
            for a in n.all_input_nodes:
                if a not in fixed:
                    stage_sets.setdefault(a, set()).add(last)
            continue
        if n in fixed:
            continue
        consumer_stages: set[int] = set()
        for u in n.users:
            if u.op == "output":
                consumer_stages.add(last)
            else:
                consumer_stages |= stage_sets.get(u, set())
        if not consumer_stages:
            consumer_stages = {0}
        if n.op == "placeholder" or not from_params[n]:
            stage_sets[n] = consumer_stages
        else:
            stage_sets[n] = {min(consumer_stages)}
    for n in nodes:
        if n.op == "output":
            continue
        for a in n.all_input_nodes:
            if max(stage_sets[a]) > min(stage_sets[n]) and min(stage_sets[a]) > min(stage_sets[n]):
                raise StrategyError(f"node {n.name} in stage {stage_sets[n]} uses {a.name} from a later stage")
    return stage_sets, stage_of_layer


def partition(
    gm: fx.GraphModule,
    pp: int,
    is_param: Callable[[fx.Node], bool],
    layer_costs: Optional[Sequence[float]] = None,
) -> list[StageGraph]:
    """Split ``gm`` (returning the loss) into ``pp`` stage programs with explicit boundaries."""
    stage_sets, stage_of_layer = assign_stages(gm, pp, is_param, layer_costs)
    nodes = list(gm.graph.nodes)
    output_node = next(n for n in nodes if n.op == "output")
    loss_node = output_node.args[0][0] if isinstance(output_node.args[0], (tuple, list)) else output_node.args[0]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    owner = {n: min(s) for n, s in stage_sets.items()}

    def single_home(n: fx.Node) -> bool:
        return n.op != "placeholder" and len(stage_sets[n]) == 1

    boundaries: list[Boundary] = []
    for n in nodes:
        if n.op in ("placeholder", "output") or not single_home(n):
            continue
        src = owner[n]
        for u in n.users:
            if u.op == "output":
                continue
            for dst in stage_sets[u]:
                # Values skipping stages travel hop by hop, so every boundary joins neighbours.
                for hop in range(src, dst):
                    b = Boundary(n.name, hop, hop + 1)
                    if b not in boundaries:
                        boundaries.append(b)

    stages: list[StageGraph] = []
    for s in range(pp):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        params = [p for p in placeholders if is_param(p) and s in stage_sets.get(p, set())]
        inputs = [p for p in placeholders if not is_param(p) and s in stage_sets.get(p, set())]
        recv = [b for b in boundaries if b.dst == s]
        for p in params + inputs:
            env[p] = graph.node_copy(p, lambda a: env[a])
        by_name = {n.name: n for n in nodes}
        for b in recv:
            src_node = by_name[b.name]
            ph = graph.placeholder(b.name)
            ph.meta = dict(src_node.meta)
            ph.meta["hgraph_boundary"] = b
            env[src_node] = ph
        for n in nodes:
            if n.op in ("placeholder", "output") or n in env:
                continue
            if s in stage_sets[n]:
                env[n] = graph.node_copy(n, lambda a: env[a])
        send = [b for b in boundaries if b.src == s]
        outs: list[fx.Node] = []
        returns_loss = s == pp - 1
        if returns_loss:
            outs.append(env[loss_node])
        for name in dict.fromkeys(b.name for b in send):
            outs.append(env[by_name[name]])
        graph.output(tuple(outs))
        graph.eliminate_dead_code()
        stage_gm = fx.GraphModule(gm, graph)
        stages.append(
            StageGraph(
                stage=s,
                gm=stage_gm,
                params=[p.name for p in params],
                inputs=[p.name for p in inputs],
                recv=recv,
                send=send,
                returns_loss=returns_loss,
                layers=tuple(i for i, st in enumerate(stage_of_layer) if st == s),
            )
        )
    return stages


def _numel(node: fx.Node) -> float:
    val = node.meta.get("val")
    shape = getattr(val, "shape", None)
    if shape is None:
        return 1.0
    total = 1.0
    for d in shape:
        try:
            total *= int(d)
        except TypeError:
            total *= 1.0
    return total
