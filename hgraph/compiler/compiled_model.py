"""``hgraph.compile``: one explicit, inspectable program per strategy and rank.

Data flow (every stage a named point of ``hgraph.passes.pipeline``: passes transform graphs,
steps compute products with the typed functions named; results cached; see docs/architecture.md)::

    model --trace--> fx graph (forward + summed loss, params as inputs)
      per stage mesh (cp, tp, ep): precision -> annotate -> localize              = local program
      per (cp, tp, pp):         partition step (``partition``); per stage: recompute
                                                                                 = stage programs
      per strategy:             insert_comm step (``parameter_layouts``): Pull / Push layouts
      per (strategy, rank):     the rank's part of each Pull / Push plan (LNK ``solve_rank``);
                                RankProgram (hgraph.program.products) = stage program + pulls + pushes
                                + pipeline schedule; schedule step (``rank_schedule``): its overlap order

Shared products (trace, local programs, stage partitions, layouts) are built once in ``compile``;
per-rank products for the compiled ``rank`` (default: the process's own under ``hgraph.launch`` /
torchrun; ``None``: every rank) are built in ``compile`` too, any other rank's on first use, so a
rank of a 1,024-rank job plans only its own transfers. Everything is cached, so switching strategies
between iterations costs nothing but the Pulls the new strategy needs. Optimizer state lives in the
fixed layout of ``hgraph.core.zero`` and never moves.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import warnings
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn

from hgraph.compiler.overlap_order import rank_schedule
from hgraph.compiler.compile_cache import CacheWarning, CompileCache, cache_directory, plan_key
from hgraph.schedule.actions import PIPELINE_SCHEDULES, Kind, dry_run, wrapped_chunk
from hgraph.core.errors import HGraphError, ShardingRuleError, StrategyError, TraceError
from hgraph.frontend.capture import CAPTURE_LOCK, TracedModel, trace
from hgraph.frontend.router_loss import loss_for
from hgraph.core.layout import InterleavedShard, Layout
from hgraph.core.model_info import model_dims as model_dims
from hgraph.core.model_info import validate_strategies as validate_strategies
from hgraph.passes.experts import find_expert_blocks, route_experts
from hgraph.passes.insert_comm import activation_record, activation_subgraphs, parameter_layouts, plan_parameters
from hgraph.passes.partition import partition
from hgraph.passes.annotate import annotate
from hgraph.passes.localize import localize
from hgraph.passes.pipeline import LEVELS, PassManager, PassRecord, checked_disabled, checked_user_passes
from hgraph.passes.precision import autocast
from hgraph.passes.recompute import recompute
from hgraph.runtime.kernels.reshard import late_peers
from hgraph.lnk.topology import Topology
from hgraph.program.products import (
    CommSubgraph,
    CompileContext,
    CompileOptions,
    OverlapConfig,
    ParameterComm,
    ParameterLayouts,
    RankProgram,
    RecomputeConfig,
    StageGraph,
)
from hgraph.core.strategy import Pipeline, Strategy, as_strategies
from hgraph.core.zero import optimizer_layout

if TYPE_CHECKING:
    from hgraph.passes.backward import JointGraphs

StrategyLike = Union[int, Strategy]
_COMPILE_LOCK = CAPTURE_LOCK  # one capture at a time per process, shared with per-shape re-traces
VERIFY_WORLD = 64  # default: the compile-time dry run checks every rank up to this world size


def _annotate_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Specs of every value; under expert parallelism each MoE layer's tokens are first routed
    through dispatch and combine (``hgraph.passes.experts``), whose specs annotate then decides."""
    return annotate(route_experts(gm, ctx), ctx)


def _precision_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    return autocast(gm, ctx)


def _recompute_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    return gm if ctx.recompute is None or ctx.recompute.mode == "none" else recompute(gm, ctx)


BUILTIN_PASSES = {"annotate": _annotate_pass, "localize": localize, "precision": _precision_pass, "recompute": _recompute_pass}


class CompiledModel:
    """A model compiled for a list of strategies; see the module docstring for what it holds."""

    def __init__(
        self,
        model: nn.Module,
        traced: TracedModel,
        strategies: list[Strategy],
        options: CompileOptions,
        user_passes: Sequence[Any] = (),
        disabled: Iterable[str] = (),
        rank: Optional[int] = None,
        verify: Optional[bool] = None,
        cache_dir: Optional[str] = None,
    ) -> None:
        self.model = model
        self.traced = traced
        self.strategies = strategies
        self.options = options
        self.world_size = strategies[0].world_size
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise StrategyError(f"compile(rank={rank!r}): expected None or a rank in 0..{self.world_size - 1}")
        self.rank = rank
        self.verify = self.world_size <= VERIFY_WORLD if verify is None else bool(verify)
        self.pass_history: list[PassRecord] = []
        user = checked_user_passes(user_passes)
        off = checked_disabled(disabled, user)
        self._passes = {level: PassManager.for_level(level, {n: BUILTIN_PASSES[n] for n in names if n in BUILTIN_PASSES},
                                                     user, off)
                        for level, names in LEVELS}
        self.param_shapes = {fqn: tuple(t.shape) for fqn, t in traced.params().items()}
        self._local: dict[tuple[int, int, int], fx.GraphModule] = {}  # (cp, tp, ep)
        self._stages: dict[tuple[int, int, int, int, int], list[StageGraph]] = {}  # (cp, tp, pp, vpp, ep)
        self._plan_inputs: dict[int, tuple[dict, dict, dict, dict]] = {}
        self._param_layouts: dict[int, dict[str, ParameterLayouts]] = {}
        self._param_comm: dict[tuple[int, int], dict[str, ParameterComm]] = {}
        self._programs: dict[tuple[int, int], RankProgram] = {}
        self._joints: dict[tuple[int, int, int], JointGraphs] = {}
        start = time.perf_counter()
        self.optimizer_layouts: dict[str, Layout] = self._optimizer_layouts()
        own = [(i, r) for i in range(len(strategies)) for r in (range(self.world_size) if rank is None else (rank,))]
        cache = self._cache(cache_directory(cache_dir), own)
        self.cache_hit = False
        if cache is not None:
            stored = cache.load()
            if stored is not None and set(stored) == set(own):
                self._param_comm.update(stored)
                self.cache_hit = True
            elif stored is not None:
                warnings.warn(f"compile cache entry {cache.path} holds other ranks' plans; rebuilt", CacheWarning, stacklevel=3)
        for i, r in own:
            self.parameter_comm(i, r)
        if cache is not None and not self.cache_hit:
            cache.store({key: self._param_comm[key] for key in own})
        if self.verify and (options.pipeline_schedule != "1f1b" or any(p.vpp > 1 for s in strategies for p in s.pipelines)):
            for i, s in enumerate(strategies):  # the new lowerings are dry-run before anything runs
                self.check_actions(i, [2 * p.pp for p in s.pipelines])
        self._overlap_checked: set[tuple[int, tuple[int, ...]]] = set()
        if options.schedule == "overlap" and self.verify:
            for i in range(len(strategies)):  # typical dispatches; the Trainer checks each real one
                n = len(strategies[i].pipelines)
                for counts in ([1] * n, [2] * n, [3] * n, [2] * (n - 1) + [0]):
                    self.check_overlap(i, counts)
        self.compile_seconds = time.perf_counter() - start

    def check_actions(self, strategy: StrategyLike, micro_batches: Sequence[int]) -> None:
        """Dry-run the action lists (``RankProgram.actions``) of every rank of ``strategy`` with
        ``micro_batches[p]`` micro-batches on pipeline ``p`` (``hgraph.schedule.actions.dry_run``); raises
        ``ScheduleError`` naming rank, action and peer on a deadlock or a mismatched order."""
        index = self.strategy_index(strategy)
        programs = {r: self.program(index, r) for r in range(self.world_size)}
        bucket_ranks = {(r, pc.name): pc.pull.plan.ranks for r, p in programs.items() for pc in p.pulls}
        bucket_ranks.update({(r, pc.name): pc.push.plan.ranks for r, p in programs.items() for pc in p.pushes})
        late = {(r, kind, pc.name): late_peers(plan, r) for r, p in programs.items()
                for kind, pcs in ((Kind.PULL_WAIT, p.pulls), (Kind.PUSH_WAIT, p.pushes))
                for pc in pcs for plan in [pc.pull.plan if kind is Kind.PULL_WAIT else pc.push.plan]}
        dry_run(
            {r: p.actions(micro_batches[p.pipeline]) for r, p in programs.items()},
            members=lambda r, group: bucket_ranks[(r, group)],
            first=lambda r, c: programs[r].stage == 0 and c == 0,
            last=lambda r, c: programs[r].is_last_stage and c == programs[r].vpp - 1,
            route=lambda r, a: wrapped_chunk(programs[r].pp, programs[r].stage, a),
            late=lambda r, a: late[(r, a.kind, a.group)],
        )

    def check_overlap(self, strategy: StrategyLike, micro_batches: Sequence[int]) -> None:
        """Dry-run the overlap schedules of every rank of ``strategy`` with ``micro_batches[p]``
        micro-batches on pipeline ``p``; raises ``ScheduleError`` on a mismatched order or a hang.
        Builds every rank's program, so it runs only when compiled with ``verify`` (default: world
        size <= ``VERIFY_WORLD``); ``verify_overlap`` runs it regardless."""
        if self.verify:
            self.verify_overlap(strategy, micro_batches)

    def verify_overlap(self, strategy: StrategyLike, micro_batches: Sequence[int]) -> None:
        """``check_overlap`` whatever ``verify`` says (the offline check of a per-rank compile)."""
        index = self.strategy_index(strategy)
        key = (index, tuple(micro_batches))
        if key not in self._overlap_checked:
            self.check_actions(index, micro_batches)  # the programs' actions are the overlap lowering
            self._overlap_checked.add(key)

    # ------------------------------------------------------------------ building
    def _context(self, **kw: Any) -> CompileContext:
        return CompileContext(self.traced, self.world_size, self.options, **kw)

    def local_program(self, cp: int, tp: int, ep: int = 1) -> fx.GraphModule:
        """The local (per-rank) program of a ``cp x tp`` stage mesh (its MoE experts split ``ep``
        ways), before pipeline cuts."""
        key = (cp, tp, ep)
        if key not in self._local:
            gm = copy.deepcopy(self.traced.graph_module)
            scope = f"cp{cp},tp{tp}" + (f",ep{ep}" if ep > 1 else "")
            try:
                self._local[key], records = self._passes["mesh"].run(gm, self._context(cp=cp, tp=tp, ep=ep), scope)
            except ShardingRuleError as exc:
                raise self._router_error(exc, scope) if ep > 1 else exc
            self.pass_history += records
        return self._local[key]

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

    def stage_graphs(self, pipeline: Pipeline) -> list[StageGraph]:
        """The pipeline's ``pp * vpp`` (virtual) stage programs; physical stage ``s`` runs ``s, s + pp, ...``."""
        key = (pipeline.cp, pipeline.tp, pipeline.pp, pipeline.vpp, pipeline.ep)
        if key not in self._stages:
            with _gc_paused():
                self._stages[key] = self._stage_graphs(pipeline, key)
        return self._stages[key]

    def _stage_graphs(self, pipeline: Pipeline, key: tuple[int, int, int, int, int]) -> list[StageGraph]:
        """``stage_graphs`` built: the pipeline passes, then the stage passes on each stage."""
        gm = self.local_program(*pipeline.program_key)
        scope = (f"cp{pipeline.cp},tp{pipeline.tp}" + (f",ep{pipeline.ep}" if pipeline.ep > 1 else "")
                 + f",pp{pipeline.pp}" + (f",vpp{pipeline.vpp}" if pipeline.vpp > 1 else ""))
        ctx = self._context(cp=pipeline.cp, tp=pipeline.tp, pp=pipeline.pp, vpp=pipeline.vpp, ep=pipeline.ep,
                            recompute=self.options.recompute_for(*key[:3]))
        params = set(self.traced.param_names)
        cut, records = self._passes["pipeline"].around(
            gm, ctx, scope,
            lambda: tuple(partition(gm, pipeline.pp * pipeline.vpp, lambda n: n.name in params, self.options.layer_costs)),
            lambda stages: replace(ctx, stages=stages))
        stages = []
        for sg in cut:
            out, more = self._passes["stage"].run(sg.gm, replace(ctx, stages=cut, stage=sg), f"{scope} stage {sg.stage}")
            stages.append(replace(sg, gm=out))
            records += more
        self.pass_history += records
        return stages

    def _optimizer_layouts(self) -> dict[str, Layout]:
        """The fixed ZeRO layouts; a fused projection cut by blocks on some stage mesh keeps its blocks;
        with an expert-parallel strategy among them, expert weights ``[E, ...]`` are cut along their
        expert dim (``hgraph.core.zero``: ep Pulls read whole experts; without one, tp-sharded experts
        keep the cut that matches theirs)."""
        blocks: dict[str, InterleavedShard] = {}
        keys = list(dict.fromkeys(p.program_key for s in self.strategies for p in s.pipelines))
        with _gc_paused():  # builds every stage mesh's local program
            specs = [self._specs(key, "hgraph_param_spec") for key in keys]
        for mesh_specs in specs:
            for fqn, spec in mesh_specs.items():
                for p in spec:
                    if isinstance(p, InterleavedShard):
                        blocks.setdefault(fqn, p)
        experts = self.expert_weights() if any(p.ep > 1 for s in self.strategies for p in s.pipelines) else set()
        return {fqn: optimizer_layout(shape, self.world_size, blocks.get(fqn), fqn in experts)
                for fqn, shape in self.param_shapes.items()}

    def expert_weights(self) -> set[str]:
        """Names of the parameters that hold one slice per routed expert (``[E, ...]``)."""
        if not hasattr(self, "_expert_weights"):
            blocks = find_expert_blocks(self.traced.graph_module, set(self.traced.param_names))
            self._expert_weights = {self.traced.param_names[w.name] for b in blocks for w in b.weights}
        return self._expert_weights

    def _specs(self, program_key: tuple[int, int, int], key: str) -> dict[str, tuple]:
        gm = self.local_program(*program_key)
        out = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder" and n.name in self.traced.param_names:
                spec = n.meta.get(key)
                if spec is None:
                    raise HGraphError(f"localize left parameter {n.name} without {key}")
                out[self.traced.param_names[n.name]] = tuple(spec)
        return out

    def _param_meshes(self, program_key: tuple[int, int, int]) -> dict[str, tuple[int, int]]:
        """The expert weights of that local program, each with the expert mesh ``(ep, etp)`` its
        specs are on (every other parameter's are on the stage mesh)."""
        gm = self.local_program(*program_key)
        return {self.traced.param_names[n.name]: tuple(n.meta["hgraph_param_mesh"]) for n in gm.graph.nodes
                if n.op == "placeholder" and n.name in self.traced.param_names and "hgraph_param_mesh" in n.meta}

    def _cache(self, directory: Optional[str], own: list[tuple[int, int]]) -> Optional[CompileCache]:
        """The cache entry of this compile's own plans, keyed by everything they are built from."""
        if directory is None:
            return None
        compute = self.options.compute_dtype or torch.float32
        inputs = (
            own, torch.finfo(compute).bits, torch.finfo(self.options.reduce_dtype or compute).bits,
            repr(self.options.topology), sorted(self.param_shapes.items()),
            sorted((n, repr(lay)) for n, lay in self.optimizer_layouts.items()),
            [(str(s), *(sorted(d.items()) for d in self._comm_inputs(i))) for i, s in enumerate(self.strategies)],
        )
        return CompileCache(directory, plan_key(inputs))

    def _comm_inputs(self, index: int) -> tuple[dict, dict, dict, dict]:
        """Strategy ``index``'s parameter users ``name -> [(pipeline, stage)]``, per local program
        (``Pipeline.program_key``) compute and gradient placements ``key -> {name: spec}`` and the
        expert meshes of its expert weights ``key -> {name: (ep, etp)}``: what its Pull / Push layouts
        are built from."""
        if index in self._plan_inputs:
            return self._plan_inputs[index]
        strategy = self.strategies[index]
        stages_of: dict[tuple[int, int, int, int, int], dict[str, tuple[int, ...]]] = {}  # scheme -> name -> stages
        specs, grad_specs, meshes = {}, {}, {}
        for pipeline in strategy.pipelines:
            mesh, scheme = pipeline.program_key, (pipeline.cp, pipeline.tp, pipeline.pp, pipeline.vpp, pipeline.ep)
            if mesh not in specs:
                specs[mesh] = self._specs(mesh, "hgraph_param_spec")
                grad_specs[mesh] = self._specs(mesh, "hgraph_grad_spec")
                meshes[mesh] = self._param_meshes(mesh)
            if scheme not in stages_of:  # data-parallel pipelines of one scheme share their stage programs
                held: dict[str, dict[int, None]] = {}
                for sg in self.stage_graphs(pipeline):
                    for ph in sg.params:  # the physical stage running this chunk
                        held.setdefault(self.traced.param_names[ph], {})[sg.stage % pipeline.pp] = None
                stages_of[scheme] = {name: tuple(st) for name, st in held.items()}
        schemes = [(p.cp, p.tp, p.pp, p.vpp, p.ep) for p in strategy.pipelines]
        shared: dict[tuple, list[tuple[int, int]]] = {}  # parameters held alike share one holder list
        users: dict[str, list[tuple[int, int]]] = {}
        for name in dict.fromkeys(n for held in stages_of.values() for n in held):  # first use, as the stages hold them
            pattern = tuple(held.get(name, ()) for held in stages_of.values())
            if pattern not in shared:
                at = dict(zip(stages_of, pattern))
                shared[pattern] = [(i, st) for i, scheme in enumerate(schemes) for st in at[scheme]]
            users[name] = shared[pattern]
        self._plan_inputs[index] = (users, specs, grad_specs, meshes)
        return self._plan_inputs[index]

    def _parameter_layouts(self, index: int) -> dict[str, ParameterLayouts]:
        """Every parameter's optimizer, compute and gradient layouts in strategy ``index`` (shared by
        its ranks): the ``insert_comm`` pass and the user passes at its level."""
        if index not in self._param_layouts:
            strategy = self.strategies[index]
            ctx = self._context(strategy=strategy)
            gm = self.local_program(*strategy.pipelines[0].program_key)
            with _gc_paused():
                layouts, records = self._passes["strategy"].around(
                    gm, ctx, f"strategy {strategy}",
                    lambda: parameter_layouts(strategy, *self._comm_inputs(index)[:3], self.param_shapes,
                                              self.optimizer_layouts, self._comm_inputs(index)[3]),
                    lambda layouts: replace(ctx, parameter_layouts=MappingProxyType(layouts)))
            self.pass_history += records
            self._param_layouts[index] = layouts
        return self._param_layouts[index]

    def parameter_comm(self, strategy: StrategyLike, rank: int) -> dict[str, ParameterComm]:
        """Pull / Push subgraphs of every parameter in ``strategy`` with ``rank``'s part of each plan
        (built on first use; equal to the full plan's steps for that rank, ``hgraph.lnk.solve_rank``)."""
        index = self.strategy_index(strategy)
        key = (index, rank)
        if key not in self._param_comm:
            layouts = self._parameter_layouts(index)
            start = time.perf_counter()
            compute = self.options.compute_dtype or torch.float32
            itemsize = torch.finfo(compute).bits // 8
            push_itemsize = torch.finfo(self.options.reduce_dtype or compute).bits // 8
            with _gc_paused():  # the plans' cached rules are long-lived: no full collection of the graphs meanwhile
                self._param_comm[key] = plan_parameters(layouts, itemsize, self.options.topology, push_itemsize, rank)
            self.pass_history.append(
                PassRecord("plan", time.perf_counter() - start, 0, 0, f"strategy {self.strategies[index]} rank {rank}")
            )
        return self._param_comm[key]

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """Canonical FQN -> the user's model's parameter, where fp32 master shards start from."""
        named = dict(self.model.named_parameters())
        return {fqn: named[fqn] for fqn in self.traced.param_names.values()}

    # ------------------------------------------------------------------ inspection
    def strategy_index(self, strategy: StrategyLike) -> int:
        """Index of ``strategy`` (an index or one of the compiled ``Strategy`` objects)."""
        if isinstance(strategy, int) and not isinstance(strategy, bool):
            if not 0 <= strategy < len(self.strategies):
                raise StrategyError(f"strategy index {strategy} out of range 0..{len(self.strategies) - 1}")
            return strategy
        if isinstance(strategy, str):
            strategy = Strategy.parse(strategy)
        for i, s in enumerate(self.strategies):
            if s == strategy:
                return i
        raise StrategyError(
            f"strategy {strategy} was not compiled; compiled: {', '.join(map(str, self.strategies))}"
        )

    def program(self, strategy: StrategyLike, rank: int) -> RankProgram:
        """The per-rank program: its stage's forward graph, pulls, pushes and schedule."""
        index = self.strategy_index(strategy)
        key = (index, rank)
        if key not in self._programs:
            self._programs[key] = self._make_program(index, rank)
        return self._programs[key]

    def _make_program(self, index: int, rank: int) -> RankProgram:
        s = self.strategies[index]
        if not 0 <= rank < self.world_size:
            raise StrategyError(f"rank {rank} out of range for world size {self.world_size}")
        pi = s.pipeline_of(rank)
        pipeline = s.pipelines[pi]
        stage = pipeline.stage_of(rank)
        groups = pipeline.groups_of(rank)
        stages = self.stage_graphs(pipeline)
        comm = self.parameter_comm(index, rank)
        order = self._layer_order()
        pulls = tuple(comm[name] for name in order if name in comm)
        program = RankProgram(
            strategy_index=index,
            rank=rank,
            pipeline=pi,
            stage=stage,
            pp=pipeline.pp,
            groups=groups,
            stage_graph=stages[stage],
            chunk_graphs=tuple(stages[stage::pipeline.pp]),
            vpp=pipeline.vpp,
            param_of_placeholder=dict(self.traced.param_names),
            pulls=pulls,
            pushes=tuple(reversed(pulls)),
            activations=tuple(activation_subgraphs(stages, s, pi)),
            compute_dtype=self.options.compute_dtype,
            reduce_dtype=self.options.reduce_dtype,
            coalesce=self.options.coalesce,
            pipeline_schedule=self.options.pipeline_schedule,
        )
        ctx = self._context(cp=pipeline.cp, tp=pipeline.tp, pp=pipeline.pp, ep=pipeline.ep, strategy=s, program=program)
        program, records = self._passes["rank"].around(
            program.stage_graph.gm, ctx, f"strategy {s} rank {rank}",
            lambda: self._scheduled(program), lambda scheduled: replace(ctx, program=scheduled))
        self.pass_history += records
        return program

    def _scheduled(self, program: RankProgram) -> RankProgram:
        """The schedule step: ``program`` with its lowering (``schedule="overlap"``: its overlap order)."""
        if self.options.schedule != "overlap":
            return program
        return replace(program, overlap=rank_schedule(program, self.options.overlap or OverlapConfig()))

    def _layer_order(self) -> list[str]:
        """Parameters in the order the forward pass uses them (placeholder order of the trace)."""
        return list(self.traced.param_names.values())

    def subgraphs(self, strategy: StrategyLike, rank: int) -> list[CommSubgraph]:
        """Communication subgraphs this rank takes part in: pulls, activations (in-stage and
        between stages), pushes, in execution order."""
        prog = self.program(strategy, rank)
        records: list[CommSubgraph] = [pc.pull for pc in prog.pulls if rank in pc.pull.plan.ranks]
        for n in prog.stage_graph.gm.graph.nodes:
            info = n.meta.get("hgraph_comm")
            if info:
                records.append(activation_record(n, info))
        records += [a for a in prog.activations if f"stage{prog.stage}" in str(a.src) or f"stage{prog.stage}" in str(a.dst)]
        records += [pc.push for pc in prog.pushes if rank in pc.push.plan.ranks]
        return records

    def backward_program(self, strategy: StrategyLike, rank: int, seq_len: int = 16) -> fx.GraphModule:
        """The rank's stage backward as an fx graph ``(*saved, *output grads) -> grads`` (parameters,
        then received activations), traced at one micro-batch of ``seq_len`` tokens; its communication
        nodes (``hgraph.*`` ops) carry ``meta["hgraph_comm"]``. See ``hgraph.passes.backward``."""
        return self.joint_program(strategy, rank, seq_len).backward

    def joint_program(self, strategy: StrategyLike, rank: int, seq_len: int = 16) -> JointGraphs:
        """Forward and backward graphs of the rank's stage (``hgraph.passes.backward.JointGraphs``)."""
        from hgraph.passes.backward import rank_joint

        key = (self.strategy_index(strategy), rank, seq_len)
        if key not in self._joints:
            with _COMPILE_LOCK:  # make_fx keeps global tracing state
                self._joints[key] = rank_joint(self, key[0], rank, seq_len)
        return self._joints[key]

    def explain(self, strategy: StrategyLike, rank: int, backward: bool = True) -> str:
        """Readable summary of one rank's program: compute, the three subgraph kinds, layouts, bytes;
        with ``backward``, the collectives of its traced backward (``backward_program``). See ``hgraph.compiler.show``."""
        from hgraph.compiler.show import explain

        return explain(self, strategy, rank, backward)

    def write_dot(self, strategy: StrategyLike, rank: int, path: str) -> str:
        """Write the rank's stage program as Graphviz dot (communication nodes highlighted)."""
        from hgraph.compiler.show import write_dot

        return write_dot(self, strategy, rank, path)

    def __str__(self) -> str:
        ranks = "every rank" if self.rank is None else f"rank {self.rank}"
        return (
            f"CompiledModel({type(self.model).__name__}, world {self.world_size} ({ranks}), strategies: "
            + "; ".join(str(s) for s in self.strategies)
            + f", compiled in {self.compile_seconds:.2f}s)"
        )

    # ------------------------------------------------------------------ execution
    def simulate(
        self,
        strategy: StrategyLike,
        input_ids: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run every rank of ``strategy`` in one process; return the token-mean loss and full grads."""
        from hgraph.runtime.thread_oracle import simulate_strategy

        return simulate_strategy(self, self.strategy_index(strategy), input_ids, targets, position_ids)


def _recompute_by_scheme(recompute: Any) -> tuple:
    """``compile``'s per-scheme recompute dict as ``((cp, tp, pp), RecomputeConfig)`` pairs."""
    if not isinstance(recompute, dict):
        return ()
    out = []
    for scheme, value in recompute.items():
        p = Strategy.parse(scheme).pipelines[0] if isinstance(scheme, str) else scheme
        if not all(hasattr(p, d) for d in ("cp", "tp", "pp")):
            raise HGraphError(f"recompute key {scheme!r}; expected a scheme like 'tp2,pp2' or a Pipeline")
        out.append(((p.cp, p.tp, p.pp), RecomputeConfig.of(value)))
    return tuple(out)


def compile(
    model: nn.Module,
    strategies: Sequence[Union[Strategy, Pipeline, str]],
    *,
    example_inputs: Any,
    loss_fn: Any = None,
    passes: Sequence[Any] = (),
    disable: Iterable[str] = (),
    compute_dtype: Optional[torch.dtype] = None,
    sequence_parallel: bool = False,
    vocab_parallel: bool = True,
    schedule: Union[str, OverlapConfig] = "none",
    layer_costs: Optional[Sequence[float]] = None,
    topology: Optional[Topology] = None,
    recompute: Union[str, RecomputeConfig, dict] = "none",
    reduce_dtype: Optional[torch.dtype] = torch.float32,
    coalesce: bool = False,
    rank: Union[int, None, str] = "auto",
    verify: Optional[bool] = None,
    cache_dir: Optional[str] = None,
    pipeline_schedule: str = "1f1b",
) -> CompiledModel:
    """Trace ``model`` once and compile it for every strategy (all must cover the same world size).

    ``example_inputs``: ``input_ids`` ``[batch, seq]`` (or a tuple/dict with ``position_ids``,
    ``targets``). ``passes``: user ``hgraph.Pass`` objects placed at named points (``after="localize"``).
    ``disable``: names of built-in passes to skip. ``compute_dtype``: mixed precision as ``torch.autocast``
    computes it (e.g. ``torch.bfloat16``: parameters pulled in bf16, halving Pull bytes; matmuls and
    attention in bf16; buffers, norms, softmax, rotary application and the loss in fp32; see
    ``hgraph.passes.precision``). ``layer_costs``: per-layer cost for balancing stages.
    ``schedule``: ``"none"`` (pull all, 1F1B, push all) or ``"overlap"`` / an
    ``hgraph.program.products.OverlapConfig`` (prefetched pulls, early pushes; same results).
    ``recompute``: ``"none"``, ``"selective"``, ``"full"`` or a ``RecomputeConfig`` choosing layers
    (``RecomputeConfig("full", every=2)``); see ``hgraph.passes.recompute``; or a dict from pipeline
    scheme (``"tp2,pp2"``) to one of those, e.g. the planner's ``choose_recompute`` per scheme. ``reduce_dtype``: dtype
    gradients are reduced in by Push Gradient (fp32 by default, also under a bf16 ``compute_dtype``;
    ``None`` reduces in the compute dtype). ``coalesce``: pull and push each layer's parameters
    together, one merged call per group and kind (``hgraph.runtime.kernels.coalesce``), so an iteration issues
    O(layers) collectives instead of O(parameters); ``schedule="none"`` only for now. ``rank``: the
    rank whose plans and programs are built now (``"auto"``: the process's own rank in an initialised
    process group of this world size, as under ``hgraph.launch`` / torchrun, else ``None``: every
    rank); any other rank's are built on first use and equal a full compile's. ``verify``: run the
    compile-time dry run of ``schedule="overlap"`` over every rank (default: world size <=
    ``VERIFY_WORLD``; it builds every rank's program). ``cache_dir`` (or ``$HGRAPH_COMPILE_CACHE``):
    keep the compiled rank's Pull / Push plans on disk, keyed by what they are built from
    (``hgraph.compiler.compile_cache``); ``compiled.cache_hit`` says whether they came from there.
    ``pipeline_schedule``: ``"1f1b"`` or ``"zb1p"`` (zero-bubble ZB-H1: each backward split into an
    input-gradient and a weight-gradient step, ``schedule="none"`` only); a pipeline with ``vpp > 1``
    (``"tp1,pp2,vpp2"``) runs interleaved 1F1B; see ``hgraph.schedule.actions``.
    """
    strategies = as_strategies(strategies)
    if not strategies:
        raise StrategyError("compile needs at least one strategy")
    world = strategies[0].world_size
    validate_strategies(strategies, world, model_dims(model))
    if loss_fn is None:
        loss_fn = loss_for(model)  # with the MoE router auxiliary loss when the config asks for it
    overlap = schedule if isinstance(schedule, OverlapConfig) else None
    if overlap is not None:
        schedule = "overlap"
    elif schedule not in ("none", "overlap"):
        raise HGraphError(f"schedule={schedule!r}; expected 'none', 'overlap' or an OverlapConfig")
    elif schedule == "overlap":
        overlap = OverlapConfig()
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise HGraphError(f"pipeline_schedule={pipeline_schedule!r}; expected one of {sorted(PIPELINE_SCHEDULES)}")
    if schedule == "overlap" and any(p.vpp > 1 for s in strategies for p in s.pipelines):
        raise HGraphError("interleaved pipelines (vpp > 1) with schedule='overlap' are not supported yet; "
                          "use schedule='none' or vpp=1")
    if pipeline_schedule != "1f1b" and any(p.vpp > 1 for s in strategies for p in s.pipelines):
        raise StrategyError(f"pipeline_schedule={pipeline_schedule!r} with an interleaved pipeline (vpp > 1): "
                            "vpp > 1 always runs interleaved 1F1B; use pipeline_schedule='1f1b' or vpp=1")
    if pipeline_schedule != "1f1b" and schedule == "overlap":
        raise HGraphError(
            f"pipeline_schedule={pipeline_schedule!r} with schedule='overlap' is not supported yet (the overlap "
            "runtime runs whole backwards); use schedule='none', or pipeline_schedule='1f1b'"
        )
    if coalesce and schedule == "overlap":
        raise HGraphError(
            "coalesce=True with schedule='overlap' is not supported yet (the overlap schedule starts pulls "
            "and pushes one parameter at a time); use schedule='none' with coalesce=True, or coalesce=False"
        )
    options = CompileOptions(
        compute_dtype=compute_dtype,
        sequence_parallel=sequence_parallel,
        vocab_parallel=vocab_parallel,
        schedule=schedule,
        layer_costs=tuple(layer_costs) if layer_costs is not None else None,
        topology=topology,
        overlap=overlap,
        recompute=RecomputeConfig.of("none" if isinstance(recompute, dict) else recompute),
        recompute_by_scheme=_recompute_by_scheme(recompute),
        reduce_dtype=reduce_dtype,
        coalesce=coalesce,
        pipeline_schedule=pipeline_schedule,
    )
    # The user's model is traced as it is (fp32); a reduced compute_dtype is applied by the precision
    # pass as torch.autocast would apply it (hgraph.passes.precision).
    with _COMPILE_LOCK:  # torch.export keeps global tracing state: one capture at a time per process
        with _gc_paused():
            traced = trace(model, example_inputs, loss_fn)
        if not traced.dynamic:
            raise TraceError(
                f"cannot compile {type(model).__name__}: one traced graph must serve every micro-batch shape, and "
                f"this model specialises on its input shape — {traced.static_reason or 'export fixed its sizes'}; "
                "write that computation without Python control flow over sizes (or supply a layer that does)"
            )
        own = _own_rank(world) if rank == "auto" else rank
        return CompiledModel(model, traced, strategies, options, passes, disable, own, verify, cache_dir)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
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


def _own_rank(world: int) -> Optional[int]:
    """This process's rank in an initialised process group of ``world`` ranks (else ``None``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world:
        return dist.get_rank()
    return None
