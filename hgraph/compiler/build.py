"""The compile walk: every product of a compile computed once, in order (``build``), each step
reading only the products of the steps before it (``hgraph.compiler.compiled_model`` looks them up).

Order (every step a named point of ``hgraph.passes.pipeline``; see docs/architecture.md)::

    1 local programs     per stage mesh (cp, tp, ep): precision -> annotate -> localize
    2 parameter specs    per local program: compute / gradient placements, expert meshes
    3 optimizer layouts  the fixed ZeRO layouts (``hgraph.core.zero``)
    4 stage programs     per (cp, tp, pp, vpp, ep): the partition step, then recompute per stage
    5 plan inputs        per strategy: parameter users and the placements of step 2
    6 parameter layouts  per strategy: the insert_comm step (Pull / Push layouts)
    7 parameter plans    per (strategy, own rank): the rank's part of each LNK plan (or the cache's)
    8 rank programs      per (strategy, own rank): stage programs + pulls + pushes + the schedule
                         step (overlap order and overlap graph)

A rank other than the compiled ones gets steps 7 and 8 on first use (``Builder.rank_program``).
"""

from __future__ import annotations

import contextlib
import copy
from functools import cached_property
import gc
import time
import warnings
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.fx as fx

from hgraph.compiler.compile_cache import CacheWarning, CompileCache, cache_directory, plan_key
from hgraph.compiler.overlap_order import overlap_order
from hgraph.compiler.parameter_plans import (
    PlanInputs,
    ProgramKey,
    itemsizes,
    optimizer_layouts,
    parameter_layouts,
    parameter_specs,
    plan_inputs,
    plan_parameters,
)
from hgraph.compiler.show import activation_subgraphs
from hgraph.core.degrees import Degrees
from hgraph.errors import HGraphError, ShardingRuleError, StrategyError
from hgraph.core.layout import Layout
from hgraph.core.progress import progress
from hgraph.core.strategy import Pipeline, Strategy
from hgraph.frontend.capture import TracedModel
from hgraph.passes.annotate import annotate
from hgraph.passes.bind_rank import bind_rank, route_counts
from hgraph.passes.experts import find_expert_blocks, route_experts
from hgraph.passes.localize import localize
from hgraph.passes.partition import partition
from hgraph.passes.pipeline import LEVELS, PassManager, PassRecord, checked_disabled, checked_user_passes
from hgraph.passes.precision import autocast
from hgraph.passes.recompute import recompute
from hgraph.passes.schedule import overlap_graph
from hgraph.program.context import CompileContext
from hgraph.program.options import CompileOptions
from hgraph.program.plan_codec import decode_plans, encode_plans
from hgraph.program.products import ParameterComm, ParameterLayouts, StageGraph
from hgraph.program.rank_program import RankProgram


def _annotate_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Specs of every value; under expert parallelism each MoE layer's tokens are first routed
    through dispatch and combine (``hgraph.passes.experts``), whose specs annotate then decides."""
    return annotate(route_experts(gm, ctx), ctx)


def _precision_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    return autocast(gm, ctx)


def _recompute_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    return gm if ctx.recompute is None or ctx.recompute.mode == "none" else recompute(gm, ctx)


BUILTIN_PASSES = {"annotate": _annotate_pass, "localize": localize, "precision": _precision_pass, "recompute": _recompute_pass}


@dataclass
class Products:
    """What a compile built, by step (module docstring); a rank's plans and program are added when a
    rank other than the compiled ones is first asked for."""

    local: dict[ProgramKey, fx.GraphModule]  # step 1, by Pipeline.program_key
    specs: dict[ProgramKey, dict[str, tuple]]  # step 2: compute placements
    grad_specs: dict[ProgramKey, dict[str, tuple]]  # step 2: gradient placements
    meshes: dict[ProgramKey, dict[str, tuple[int, int]]]  # step 2: expert weights' (ep, etp)
    optimizer_layouts: dict[str, Layout]  # step 3
    stages: dict[Degrees, list[StageGraph]]  # step 4, by Pipeline.degrees
    inputs: list[PlanInputs]  # step 5, per strategy
    layouts: list[dict[str, ParameterLayouts]]  # step 6, per strategy
    comm: dict[tuple[int, int], dict[str, ParameterComm]] = field(default_factory=dict)  # step 7, (strategy, rank)
    programs: dict[tuple[int, int], RankProgram] = field(default_factory=dict)  # step 8, (strategy, rank)
    cache_hit: bool = False  # step 7's plans came from the compile cache


class Builder:
    """One compile's pass managers and build steps: each step computes one product from the products
    it is given, and records its passes in ``pass_history``."""

    def __init__(self, traced: TracedModel, strategies: list[Strategy], options: CompileOptions) -> None:
        self.traced, self.strategies, self.options = traced, strategies, options
        self.world_size = strategies[0].world_size
        self.pass_history: list[PassRecord] = []
        user = checked_user_passes(options.passes)
        off = checked_disabled(options.disable, user)
        self.passes = {level: PassManager.for_level(level, {n: BUILTIN_PASSES[n] for n in names if n in BUILTIN_PASSES},
                                                    user, off)
                       for level, names in LEVELS}
        self.param_shapes = {fqn: tuple(t.shape) for fqn, t in traced.params().items()}
        self._overlap_graphs: dict[int, fx.GraphModule] = {}  # id(stage gm) -> its overlap graph (ranks share it)

    @cached_property
    def expert_weights(self) -> set[str]:
        """Names of the parameters that hold one slice per routed expert (``[E, ...]``); looked for only
        when a strategy has ``ep > 1`` (``find_expert_blocks`` refuses experts it cannot split)."""
        blocks = find_expert_blocks(self.traced.graph_module, set(self.traced.param_names))
        return {self.traced.param_names[w.name] for b in blocks for w in b.weights}

    def context(self, **kw: Any) -> CompileContext:
        return CompileContext(self.traced, self.world_size, self.options, **kw)

    # ------------------------------------------------------------------ steps
    def local_program(self, key: ProgramKey) -> fx.GraphModule:
        """Step 1: the local (per-rank) program of stage mesh ``(cp, tp)``, its MoE experts split ``ep`` ways."""
        cp, tp, ep = key
        gm = copy.deepcopy(self.traced.graph_module)
        scope = f"cp{cp},tp{tp}" + (f",ep{ep}" if ep > 1 else "")
        try:
            out, records = self.passes["mesh"].run(gm, self.context(cp=cp, tp=tp, ep=ep), scope)
        except ShardingRuleError as exc:
            if ep > 1:
                raise self._router_error(exc, scope) from exc
            raise
        self.pass_history += records
        return out

    def _router_error(self, exc: ShardingRuleError, scope: str) -> HGraphError:
        """A rule that refused a node of an MoE layer under expert parallelism: the layer's router
        cannot run on this rank's share of the tokens (``StrategyError``); any other error as it was."""
        blocks = find_expert_blocks(self.traced.graph_module, set(self.traced.param_names))
        layer = next((b.layer for b in blocks if b.layer and f"module '{b.layer}" in str(exc)), None)
        if layer is None:
            return exc
        error = StrategyError(
            f"{scope}: the router of MoE layer '{layer}' cannot be split by token, which expert parallelism "
            f"needs (each rank routes its own tokens): {exc}. Use ep=1 for this strategy, or a strategy without "
            "the split it refuses (e.g. no cp)"
        )
        error.__cause__ = exc
        return error

    def param_meshes(self, gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
        """Step 2: the expert weights of local program ``gm``, each with the expert mesh ``(ep, etp)``
        its specs are on (every other parameter's are on the stage mesh)."""
        return {self.traced.param_names[n.name]: tuple(n.meta["hgraph_param_mesh"]) for n in gm.graph.nodes
                if n.op == "placeholder" and n.name in self.traced.param_names and "hgraph_param_mesh" in n.meta}

    def stage_graphs(self, pipeline: Pipeline, gm: fx.GraphModule) -> list[StageGraph]:
        """Step 4: the pipeline's ``pp * vpp`` (virtual) stage programs cut from its local program
        ``gm`` (the partition step with the pipeline-level passes, then the stage passes on each)."""
        scope = (f"cp{pipeline.cp},tp{pipeline.tp}" + (f",ep{pipeline.ep}" if pipeline.ep > 1 else "")
                 + f",pp{pipeline.pp}" + (f",vpp{pipeline.vpp}" if pipeline.vpp > 1 else ""))
        ctx = self.context(cp=pipeline.cp, tp=pipeline.tp, pp=pipeline.pp, vpp=pipeline.vpp, ep=pipeline.ep,
                           recompute=self.options.recompute_for(pipeline))
        params = set(self.traced.param_names)
        cut, records = self.passes["pipeline"].around(
            gm, ctx, scope,
            lambda: tuple(partition(gm, pipeline.pp * pipeline.vpp, lambda n: n.name in params, self.options.layer_costs)),
            lambda stages: replace(ctx, stages=stages))
        stages = []
        for sg in cut:
            out, more = self.passes["stage"].run(sg.gm, replace(ctx, stages=cut, stage=sg), f"{scope} stage {sg.stage}")
            stages.append(replace(sg, gm=bind_rank(out), routing_outputs=route_counts(out)))
            records += more
        self.pass_history += records
        return stages

    def parameter_layouts(self, index: int, inputs: PlanInputs, layouts: dict[str, Layout],
                          gm: fx.GraphModule) -> dict[str, ParameterLayouts]:
        """Step 6: every parameter's optimizer, compute and gradient layouts in strategy ``index`` (shared
        by its ranks): the insert_comm step on its first local program ``gm``, with the user passes there."""
        strategy = self.strategies[index]
        ctx = self.context(strategy=strategy)
        with gc_paused():
            out, records = self.passes["strategy"].around(
                gm, ctx, f"strategy {strategy}",
                lambda: parameter_layouts(strategy, *inputs[:3], self.param_shapes, layouts, inputs[3]),
                lambda done: replace(ctx, parameter_layouts=MappingProxyType(done)))
        self.pass_history += records
        return out

    def parameter_comm(self, index: int, rank: int, layouts: dict[str, ParameterLayouts]) -> dict[str, ParameterComm]:
        """Step 7: Pull / Push subgraphs of every parameter in strategy ``index`` with ``rank``'s part of
        each plan (equal to the full plan's steps for that rank, ``hgraph.lnk.solve_rank``)."""
        start = time.perf_counter()
        itemsize, push_itemsize = itemsizes(self.options)
        with gc_paused():  # the plans' cached rules are long-lived: no full collection of the graphs meanwhile
            out = plan_parameters(layouts, itemsize, self.options.topology, push_itemsize, rank)
        self.pass_history.append(
            PassRecord("plan", time.perf_counter() - start, 0, 0, f"strategy {self.strategies[index]} rank {rank}"))
        return out

    def program(self, index: int, rank: int, stages: Sequence[StageGraph], comm: dict[str, ParameterComm]) -> RankProgram:
        """Step 8: the rank's program from its pipeline's stage programs and its parameter plans, then
        the schedule step (with the user passes at the rank level)."""
        s = self.strategies[index]
        pi = s.pipeline_of(rank)
        pipeline = s.pipelines[pi]
        stage = pipeline.stage_of(rank)
        pulls = tuple(comm[name] for name in self.traced.param_names.values() if name in comm)  # forward order
        program = RankProgram(
            strategy_index=index, rank=rank, pipeline=pi, stage=stage, pp=pipeline.pp,
            groups=pipeline.groups_of(rank), stage_graph=stages[stage], chunk_graphs=tuple(stages[stage::pipeline.pp]),
            vpp=pipeline.vpp, param_of_placeholder=dict(self.traced.param_names), pulls=pulls,
            pushes=tuple(reversed(pulls)), activations=tuple(activation_subgraphs(stages, s, pi)),
            compute_dtype=self.options.compute_dtype, reduce_dtype=self.options.reduce_dtype,
            coalesce=self.options.schedule.coalesce, pipeline_schedule=self.options.schedule.pipeline,
        )
        ctx = self.context(cp=pipeline.cp, tp=pipeline.tp, pp=pipeline.pp, ep=pipeline.ep, strategy=s, program=program)
        program, records = self.passes["rank"].around(
            program.stage_graph.gm, ctx, f"strategy {s} rank {rank}",
            lambda: self._scheduled(program), lambda scheduled: replace(ctx, program=scheduled))
        self.pass_history += records
        return program

    def _scheduled(self, program: RankProgram) -> RankProgram:
        """The schedule step: ``program`` with its lowering (``schedule="overlap"``: its overlap order,
        and the overlap graph its first forward runs)."""
        if self.options.schedule.overlap is None:
            return program
        sg = program.stage_graph
        if id(sg.gm) not in self._overlap_graphs:  # the ranks of one stage share it
            self._overlap_graphs[id(sg.gm)] = overlap_graph(sg.gm, sg.params)
        return replace(program, overlap=overlap_order(program, self.options.schedule.overlap),
                       overlap_graph=self._overlap_graphs[id(sg.gm)])

    def rank_comm(self, products: Products, index: int, rank: int) -> dict[str, ParameterComm]:
        """Step 7 for one (strategy, rank), stored in ``products`` (a rank not compiled for: on first use)."""
        if not 0 <= rank < self.world_size:
            raise StrategyError(f"rank {rank} out of range for world size {self.world_size}")
        if (index, rank) not in products.comm:
            products.comm[(index, rank)] = self.parameter_comm(index, rank, products.layouts[index])
        return products.comm[(index, rank)]

    def rank_program(self, products: Products, index: int, rank: int) -> RankProgram:
        """Steps 7 and 8 for one (strategy, rank), stored in ``products``."""
        comm = self.rank_comm(products, index, rank)
        if (index, rank) not in products.programs:
            strategy = self.strategies[index]
            stages = products.stages[(strategy.pipelines[strategy.pipeline_of(rank)]).degrees]
            products.programs[(index, rank)] = self.program(index, rank, stages, comm)
        return products.programs[(index, rank)]


def build(builder: Builder, rank: Optional[int], cache_dir: Optional[str] = None,
          trust_shared_cache: bool = False) -> Products:
    """Every product of the compile in order (module docstring): steps 1-6 for every strategy, 7 and
    8 for the compiled ``rank`` (``None``: every rank) of each; step 7 read from the compile cache
    (``cache_dir``) when an entry fits."""
    strategies, names = builder.strategies, builder.traced.param_names
    keys = list(dict.fromkeys(p.program_key for s in strategies for p in s.pipelines))
    with gc_paused():  # builds every stage mesh's local program
        local = {key: builder.local_program(key) for key in keys}
    specs = {key: parameter_specs(gm, names, "hgraph_param_spec") for key, gm in local.items()}
    grad_specs = {key: parameter_specs(gm, names, "hgraph_grad_spec") for key, gm in local.items()}
    meshes = {key: builder.param_meshes(gm) for key, gm in local.items()}
    # with an ep strategy among them, expert weights are cut along their expert dim (ep Pulls read
    # whole experts); without one, tp-sharded experts keep the cut that matches theirs
    experts = builder.expert_weights if any(p.ep > 1 for s in strategies for p in s.pipelines) else set()
    layouts = optimizer_layouts(builder.param_shapes, builder.world_size, list(specs.values()), experts)
    stages: dict[Degrees, list[StageGraph]] = {}
    for pipeline in (p for s in strategies for p in s.pipelines):
        if pipeline.degrees not in stages:
            with gc_paused():
                stages[pipeline.degrees] = builder.stage_graphs(pipeline, local[pipeline.program_key])
    inputs = [plan_inputs(s, stages, specs, grad_specs, meshes, names) for s in strategies]
    param_layouts = [builder.parameter_layouts(i, inputs[i], layouts, local[s.pipelines[0].program_key])
                     for i, s in enumerate(strategies)]
    products = Products(local, specs, grad_specs, meshes, layouts, stages, inputs, param_layouts)
    own = [(i, r) for i in range(len(strategies)) for r in (range(builder.world_size) if rank is None else (rank,))]
    cache = _cache(builder, products, cache_directory(cache_dir), own, trust_shared_cache)
    if cache is not None:
        with gc_paused():  # decoding builds many small objects, as planning does
            stored = cache.load(decode_plans)
        problem = None if stored is None else _misfit(builder, products, stored, own)
        if stored is not None and problem is None:
            products.comm.update(stored)
            products.cache_hit = True
        elif stored is not None:
            warnings.warn(f"compile cache entry {cache.path} ignored and rebuilt: {problem}", CacheWarning, stacklevel=4)
    bar = progress(desc=f"compiling {len(strategies)} strategies", total=2 * len(own), unit="step",
                   show=len(strategies) > 1 and not rank)  # one bar: the first rank's
    for i, r in own:
        builder.rank_comm(products, i, r)
        bar.update()
    if cache is not None and not products.cache_hit:
        with gc_paused():
            cache.store(encode_plans({key: products.comm[key] for key in own}))
    for i, r in own:
        builder.rank_program(products, i, r)
        bar.update()
    bar.close()
    return products


def _cache(builder: Builder, products: Products, directory: Optional[str], own: list[tuple[int, int]],
           trust_shared: bool) -> Optional[CompileCache]:
    """The cache entry of this compile's own plans, keyed by everything they are built from."""
    if directory is None:
        return None
    options = builder.options
    compute = options.compute_dtype or torch.float32
    inputs = (
        own, torch.finfo(compute).bits, torch.finfo(options.reduce_dtype or compute).bits,
        repr(options.topology), sorted(builder.param_shapes.items()),
        sorted((n, repr(lay)) for n, lay in products.optimizer_layouts.items()),
        [(str(s), *(sorted(d.items()) for d in products.inputs[i])) for i, s in enumerate(builder.strategies)],
    )
    return CompileCache(directory, plan_key(inputs), trust_shared)


def _misfit(builder: Builder, products: Products, stored: dict[tuple[int, int], dict[str, ParameterComm]],
            own: list[tuple[int, int]]) -> Optional[str]:
    """Why plans read from the cache are not this compile's (``None`` when they fit): other ranks,
    other parameters or holders, or Pull / Push ends other than the optimizer layouts."""
    if set(stored) != set(own):
        return "it holds other ranks' plans"
    for (index, _), comms in stored.items():
        users = products.inputs[index][0]
        strategy = builder.strategies[index]
        if comms.keys() != users.keys():
            return f"its parameters of strategy {strategy} are not this model's"
        for name, pc in comms.items():
            home = products.optimizer_layouts[name]
            if pc.holders != tuple(users[name]) or not pc.pull.src == pc.push.dst == home \
                    or pc.pull.plan is None or pc.push.plan is None \
                    or (pc.pull.plan.src, pc.pull.plan.dst, pc.push.plan.src, pc.push.plan.dst) \
                    != (pc.pull.src, pc.pull.dst, pc.push.src, pc.push.dst):
                return f"its plans of {name} in strategy {strategy} do not fit this model"
    return None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Cyclic garbage collection off for the block (restored after): tracing and planning allocate many
    objects that outlive them, which would otherwise set off full collections over every graph built
    so far (0.2-0.8 s each at 32 layers); what they leave is collected later as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
