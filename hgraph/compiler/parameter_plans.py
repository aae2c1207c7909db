"""Parameter planning: the fixed optimizer layouts, each strategy's Pull Parameter / Push Gradient
layouts (the ``insert_comm`` step) and each rank's part of their LNK plans.

* **Pull Parameter** (one per parameter): the fp32 shard of the fixed optimizer layout, cast to the
  compute dtype first (halving bytes for bf16), resharded into the compute layouts of every
  (pipeline, stage) that uses it. Several users (pipelines, or stages holding a tied weight) form a
  ``LayoutUnion("duplicate")``.
* **Push Gradient** (one per parameter): the gradients of those users (cast to the reduce dtype, fp32
  by default, before any reduction), each in the placement
  autograd leaves it in (Partial over cp/tp where the local backward produced partial sums), form a
  ``LayoutUnion("partial")`` (tied weights and data-parallel pipelines are summed) and are reduced
  and moved into the optimizer layout in one LNK plan.

(Communicate Activation, the third kind, needs no plan: stage boundaries go to the same mesh
position of the neighbouring stage, and reshards inside a stage are nodes ``localize`` inserted;
their records are ``hgraph.compiler.show.activation_subgraphs``.)

Plans come from ``hgraph.lnk.solve`` (or, compiling for one rank, ``hgraph.lnk.solve_rank``: that
rank's part) and are cached there by layout pair, so strategies that share a layout pair share the plan.
"""

from __future__ import annotations

import functools
from typing import Any, Collection, Mapping, Optional, Sequence

import torch
import torch.fx as fx

from hgraph.core.degrees import Degrees
from hgraph.errors import HGraphError
from hgraph.core.layout import AnyLayout, Layout, LayoutUnion
from hgraph.core.placement import InterleavedShard
from hgraph.core.strategy import Strategy
from hgraph.core.zero import optimizer_layout
from hgraph.lnk import solve, solve_rank
from hgraph.program.options import CompileOptions
from hgraph.program.products import PULL, PUSH, CommSubgraph, ParameterComm, ParameterLayouts, StageGraph


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


def parameter_specs(gm: fx.GraphModule, param_names: dict[str, str], key: str) -> dict[str, tuple]:
    """Canonical parameter name -> its placement on the local program ``gm`` (``meta[key]``:
    ``"hgraph_param_spec"`` for compute, ``"hgraph_grad_spec"`` for gradients)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in param_names:
            spec = n.meta.get(key)
            if spec is None:
                raise HGraphError(f"localize left parameter {n.name} without {key}")
            out[param_names[n.name]] = tuple(spec)
    return out


def optimizer_layouts(shapes: dict[str, tuple[int, ...]], world: int, mesh_specs: Sequence[dict[str, tuple]],
                      experts: Collection[str] = ()) -> dict[str, Layout]:
    """The fixed ZeRO layouts of every parameter; a fused projection cut by blocks on some stage mesh
    (``mesh_specs``: each local program's compute placements) keeps its blocks; the ``experts``
    weights ``[E, ...]`` are cut along their expert dim (``hgraph.core.zero``)."""
    blocks: dict[str, InterleavedShard] = {}
    for specs in mesh_specs:
        for fqn, spec in specs.items():
            for p in spec:
                if isinstance(p, InterleavedShard):
                    blocks.setdefault(fqn, p)
    return {fqn: optimizer_layout(shape, world, blocks.get(fqn), fqn in experts) for fqn, shape in shapes.items()}


ProgramKey = tuple[int, int, int]  # Pipeline.program_key: (cp, tp, ep)
PlanInputs = tuple[dict[str, list[tuple[int, int]]], dict[ProgramKey, dict[str, tuple]],
                   dict[ProgramKey, dict[str, tuple]], dict[ProgramKey, dict[str, tuple[int, int]]]]


def plan_inputs(
    strategy: Strategy,
    stages: Mapping[Degrees, Sequence[StageGraph]],  # by Pipeline.degrees
    specs: Mapping[ProgramKey, dict[str, tuple]],
    grad_specs: Mapping[ProgramKey, dict[str, tuple]],
    meshes: Mapping[ProgramKey, dict[str, tuple[int, int]]],
    param_names: dict[str, str],
) -> PlanInputs:
    """What ``strategy``'s Pull / Push layouts are built from: parameter users ``name -> [(pipeline,
    stage)]``, and of its local programs (``Pipeline.program_key``) the compute and gradient placements
    ``key -> {name: spec}`` and the expert meshes of its expert weights ``key -> {name: (ep, etp)}``.
    Reads the compile's products: ``stages[p.degrees]`` (stage programs), ``specs[key]`` /
    ``grad_specs[key]`` (``parameter_specs`` of each local program), ``meshes[key]`` (expert meshes)."""
    stages_of: dict[Degrees, dict[str, tuple[int, ...]]] = {}  # degrees -> name -> stages
    keys = list(dict.fromkeys(p.program_key for p in strategy.pipelines))
    for pipeline in strategy.pipelines:
        scheme = pipeline.degrees
        if scheme not in stages_of:  # data-parallel pipelines of one scheme share their stage programs
            held: dict[str, dict[int, None]] = {}
            for sg in stages[scheme]:
                for ph in sg.params:  # the physical stage running this chunk
                    held.setdefault(param_names[ph], {})[sg.stage % pipeline.pp] = None
            stages_of[scheme] = {name: tuple(st) for name, st in held.items()}
    schemes = [p.degrees for p in strategy.pipelines]
    shared: dict[tuple, list[tuple[int, int]]] = {}  # parameters held alike share one holder list
    users: dict[str, list[tuple[int, int]]] = {}
    for name in dict.fromkeys(n for held in stages_of.values() for n in held):  # first use, as the stages hold them
        pattern = tuple(held.get(name, ()) for held in stages_of.values())
        if pattern not in shared:
            at = dict(zip(stages_of, pattern))
            shared[pattern] = [(i, st) for i, scheme in enumerate(schemes) for st in at[scheme]]
        users[name] = shared[pattern]
    return users, {k: specs[k] for k in keys}, {k: grad_specs[k] for k in keys}, {k: meshes[k] for k in keys}


def itemsizes(options: CompileOptions) -> tuple[int, int]:
    """Bytes per element pulled (the compute dtype's) and pushed (the reduce dtype's)."""
    compute = options.compute_dtype or torch.float32
    return torch.finfo(compute).bits // 8, torch.finfo(options.reduce_dtype or compute).bits // 8
