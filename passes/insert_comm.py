"""Insert-communication pass: plan the three kinds of communication subgraphs of a strategy.

* **Pull Parameter** (one per parameter): the fp32 shard of the fixed optimizer layout, cast to the
  compute dtype first (halving bytes for bf16), resharded into the compute layouts of every
  (pipeline, stage) that uses it. Several users (pipelines, or stages holding a tied weight) form a
  ``LayoutUnion("duplicate")``.
* **Push Gradient** (one per parameter): the gradients of those users (cast to the reduce dtype, fp32
  by default, before any reduction), each in the placement
  autograd leaves it in (Partial over cp/tp where the local backward produced partial sums), form a
  ``LayoutUnion("partial")`` (tied weights and data-parallel pipelines are summed) and are reduced
  and moved into the optimizer layout in one LNK plan.
* **Communicate Activation**: stage boundaries of each pipeline (forward activations and backward
  activation gradients, same placement on both stages, so rank ``(c, t)`` of stage ``s`` talks to
  rank ``(c, t)`` of stage ``s+1``); reshards inside a stage were already inserted by ``localize``
  as nodes calling the collectives of ``hgraph.runtime.kernels.collectives``.

Plans come from ``hgraph.lnk.solve`` (or, compiling for one rank, ``hgraph.lnk.solve_rank``: that
rank's part) and are cached there by layout pair, so strategies that share a layout pair share the plan.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.fx as fx

from hgraph.core.layout import AnyLayout, Layout, LayoutUnion
from hgraph.lnk import solve, solve_rank
from hgraph.program.products import ACTIVATION as ACTIVATION
from hgraph.program.products import PULL as PULL
from hgraph.program.products import PUSH as PUSH
from hgraph.program.products import CommSubgraph as CommSubgraph
from hgraph.program.products import ParameterComm as ParameterComm
from hgraph.program.products import ParameterLayouts as ParameterLayouts
from hgraph.core.strategy import Strategy

@functools.lru_cache(maxsize=65536)
def _layout(shape: tuple[int, ...], ranks: tuple[int, ...], mesh: tuple[int, ...], spec: tuple) -> Layout:
    """One stage's layout of a parameter (shared by the layers of equal shape and placement)."""
    return Layout(shape, ranks, mesh, spec)


def _union(layouts: list[Layout], hetero: str) -> AnyLayout:
    return layouts[0] if len(layouts) == 1 else LayoutUnion(tuple(layouts), hetero)  # type: ignore[arg-type]


def parameter_layouts(
    strategy: Strategy,
    users: dict[str, list[tuple[int, int]]],
    specs: dict[tuple[int, int, int], dict[str, tuple]],
    grad_specs: dict[tuple[int, int, int], dict[str, tuple]],
    shapes: dict[str, tuple[int, ...]],
    optimizer_layouts: dict[str, Layout],
    meshes: Optional[dict[tuple[int, int, int], dict[str, tuple[int, int]]]] = None,
) -> dict[str, ParameterLayouts]:
    """Pull/push layouts of every parameter of ``strategy``.

    ``users[name]`` lists the (pipeline, stage) pairs whose stage program takes the parameter;
    ``specs[(cp, tp, ep)][name]`` / ``grad_specs[...]`` are its compute and gradient placements in the
    local program of that pipeline key (``Pipeline.program_key``), on the stage mesh ``(cp, tp)`` or,
    for the expert weights listed in ``meshes[key]``, on the expert mesh ``(ep, etp)`` (same ranks).
    """
    out: dict[str, ParameterLayouts] = {}
    held: dict[int, tuple[tuple[tuple[int, int], ...], tuple]] = {}  # id(holders) -> holders, their program keys
    unions: dict[tuple, tuple[AnyLayout, AnyLayout]] = {}  # parameters of equal shape and placement share them
    meshes = meshes or {}
    for name, holders in users.items():
        if id(holders) not in held:
            keys = tuple(dict.fromkeys(strategy.pipelines[i].program_key for i, _ in holders))
            held[id(holders)] = (tuple(holders), keys)
        holder_tuple, keys = held[id(holders)]
        key = (id(holders), shapes[name], tuple(specs[k][name] for k in keys), tuple(grad_specs[k][name] for k in keys),
               tuple(meshes.get(k, {}).get(name) for k in keys))
        if key not in unions:
            compute, grads = [], []
            for pipeline_index, stage in holder_tuple:
                pipeline = strategy.pipelines[pipeline_index]
                program = pipeline.program_key
                mesh = meshes.get(program, {}).get(name, pipeline.stage_mesh)
                ranks = pipeline.stage_ranks(stage)
                compute.append(_layout(shapes[name], ranks, mesh, specs[program][name]))
                grads.append(_layout(shapes[name], ranks, mesh, grad_specs[program][name]))
            unions[key] = (_union(compute, "duplicate"), _union(grads, "partial"))
        out[name] = ParameterLayouts(name, holder_tuple, optimizer_layouts[name], *unions[key])
    return out


def plan_parameters(
    layouts: dict[str, ParameterLayouts],
    itemsize: int,
    topology: Optional[Any] = None,
    push_itemsize: Optional[int] = None,
    rank: Optional[int] = None,
) -> dict[str, ParameterComm]:
    """Pull/push plans of every parameter (``parameter_layouts``): full plans, or with ``rank`` that
    rank's part of each (``hgraph.lnk.solve_rank``: equal steps and bytes, without the world's table).
    ``itemsize``: bytes per element pulled (the compute dtype's); ``push_itemsize``: pushed (the
    reduce dtype's; default ``itemsize``).
    """
    if rank is None:
        def plan(src: AnyLayout, dst: AnyLayout, size: int) -> Any:
            return solve(src, dst, topology, itemsize=size)
    else:
        def plan(src: AnyLayout, dst: AnyLayout, size: int) -> Any:
            return solve_rank(src, dst, rank, topology, itemsize=size)
    out: dict[str, ParameterComm] = {}
    plans: dict[tuple, tuple[Any, Any]] = {}  # layers of equal layouts (shared objects) share their plans
    for name, lay in layouts.items():
        key = (lay.optimizer, id(lay.compute), id(lay.grads))
        if key not in plans:
            plans[key] = (plan(lay.optimizer, lay.compute, itemsize), plan(lay.grads, lay.optimizer, push_itemsize or itemsize))
        pull_plan, push_plan = plans[key]
        out[name] = ParameterComm(
            name=name,
            holders=lay.holders,
            pull=CommSubgraph(PULL, name, lay.optimizer, lay.compute, pull_plan.bytes_moved, pull_plan),
            push=CommSubgraph(PUSH, name, lay.grads, lay.optimizer, push_plan.bytes_moved, push_plan, direction="backward"),
        )
    return out


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
            info.get("kind", "communicate_activation"),
            f"{info.get('tensor', node.name)} ({info.get('op', node.target)}/{info.get('mesh_dim', '')})",
            fmt(src),
            fmt(dst),
            int(info.get("bytes", 0) or 0),
        )
    return CommSubgraph("communicate_activation", node.name, "?", "?", 0)
