"""``CompiledModel``: one explicit, inspectable program per strategy and rank (``hgraph.compile``,
in ``entry.py``, checks the options, traces the model and builds one).

Data flow (every stage a named point of ``hgraph.passes.pipeline``: passes transform graphs,
steps compute products with the typed functions named; results cached; see docs/architecture.md)::

    model --trace--> fx graph (forward + summed loss, params as inputs)
      per stage mesh (cp, tp, ep): precision -> annotate -> localize              = local program
      per (cp, tp, pp):         partition step (``partition``); per stage: recompute
                                                                                 = stage programs
      per strategy:             insert_comm step (``parameter_layouts``): Pull / Push layouts
      per (strategy, rank):     the rank's part of each Pull / Push plan (LNK ``solve_rank``);
                                RankProgram (hgraph.program.rank_program) = stage program + pulls + pushes
                                + pipeline schedule; schedule step (``rank_schedule``): its overlap order

Shared products (trace, local programs, stage partitions, layouts) are built once in ``compile``;
per-rank products for ``options.build.rank`` (default: the process's own under ``hgraph.launch`` /
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
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn

from hgraph.compiler.compile_cache import CacheWarning, CompileCache, cache_directory, plan_key
from hgraph.compiler.overlap_order import rank_schedule
from hgraph.compiler.packing_proof import check_rows, prove_packing
from hgraph.compiler.parameter_plans import (
    PlanInputs,
    itemsizes,
    optimizer_layouts,
    parameter_layouts,
    parameter_specs,
    plan_inputs,
    plan_parameters,
)
from hgraph.compiler.show import activation_subgraphs, explain, subgraphs, write_dot
from hgraph.compiler.verify import check_actions, typical_dispatches
from hgraph.core.batch import DEFAULT_MICRO_BATCH_TOKENS
from hgraph.errors import HGraphError, InputError, PackingError, ShardingRuleError, StrategyError
from hgraph.core.layout import Layout
from hgraph.core.strategy import Pipeline, Strategy
from hgraph.frontend.capture import CAPTURE_LOCK, TracedModel
from hgraph.frontend.meta import is_meta_model
from hgraph.passes.experts import find_expert_blocks, route_experts
from hgraph.passes.annotate import annotate
from hgraph.passes.backward import JointGraphs, rank_joint
from hgraph.passes.localize import localize
from hgraph.passes.partition import partition
from hgraph.passes.pipeline import LEVELS, PassManager, PassRecord, checked_disabled, checked_user_passes
from hgraph.passes.precision import autocast
from hgraph.passes.recompute import recompute
from hgraph.program.options import CompileOptions
from hgraph.program.plan_codec import decode_plans, encode_plans
from hgraph.program.context import CompileContext
from hgraph.program.products import CommSubgraph, PackingProof, ParameterComm, ParameterLayouts, StageGraph
from hgraph.program.rank_program import RankProgram
from hgraph.runtime.thread_oracle import simulate_strategy

StrategyLike = Union[int, Strategy]
COMPILE_LOCK = CAPTURE_LOCK  # one capture at a time per process, shared with per-shape re-traces
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
        rank: Optional[int] = None,
    ) -> None:
        self.model = model
        self.traced = traced
        self.strategies = strategies
        self.options = options
        self.world_size = strategies[0].world_size
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise StrategyError(f"build.rank={rank!r}: expected 'auto', None or a rank in 0..{self.world_size - 1}")
        self.rank = rank
        verify = options.build.verify
        self.verify = self.world_size <= VERIFY_WORLD if verify is None else bool(verify)
        self.pass_history: list[PassRecord] = []
        user = checked_user_passes(options.passes)
        off = checked_disabled(options.disable, user)
        self._passes = {level: PassManager.for_level(level, {n: BUILTIN_PASSES[n] for n in names if n in BUILTIN_PASSES},
                                                     user, off)
                        for level, names in LEVELS}
        self.param_shapes = {fqn: tuple(t.shape) for fqn, t in traced.params().items()}
        self._local: dict[tuple[int, int, int], fx.GraphModule] = {}  # (cp, tp, ep)
        self._stages: dict[tuple[int, int, int, int, int], list[StageGraph]] = {}  # (cp, tp, pp, vpp, ep)
        self._plan_inputs: dict[int, PlanInputs] = {}
        self._param_layouts: dict[int, dict[str, ParameterLayouts]] = {}
        self._param_comm: dict[tuple[int, int], dict[str, ParameterComm]] = {}
        self._programs: dict[tuple[int, int], RankProgram] = {}
        self._joints: dict[tuple[int, int, int], JointGraphs] = {}
        start = time.perf_counter()
        keys = list(dict.fromkeys(p.program_key for s in strategies for p in s.pipelines))
        with gc_paused():  # builds every stage mesh's local program
            mesh_specs = [self._specs(key, "hgraph_param_spec") for key in keys]
        # with an ep strategy among them, expert weights are cut along their expert dim (ep Pulls read
        # whole experts); without one, tp-sharded experts keep the cut that matches theirs
        experts = self.expert_weights() if any(p.ep > 1 for s in strategies for p in s.pipelines) else set()
        self.optimizer_layouts: dict[str, Layout] = optimizer_layouts(self.param_shapes, self.world_size, mesh_specs,
                                                                      experts)
        own = [(i, r) for i in range(len(strategies)) for r in (range(self.world_size) if rank is None else (rank,))]
        cache = self._cache(cache_directory(options.build.cache_dir), own, options.build.trust_shared_cache)
        self.cache_hit = False
        if cache is not None:
            with gc_paused():  # decoding builds many small objects, as planning does
                stored = cache.load(decode_plans)
            problem = None if stored is None else self._misfit(stored, own)
            if stored is not None and problem is None:
                self._param_comm.update(stored)
                self.cache_hit = True
            elif stored is not None:
                warnings.warn(f"compile cache entry {cache.path} ignored and rebuilt: {problem}", CacheWarning, stacklevel=3)
        for i, r in own:
            self.parameter_comm(i, r)
        if cache is not None and not self.cache_hit:
            with gc_paused():
                cache.store(encode_plans({key: self._param_comm[key] for key in own}))
        if self.verify and (options.schedule.pipeline != "1f1b" or any(p.vpp > 1 for s in strategies for p in s.pipelines)):
            for i, s in enumerate(strategies):  # the new lowerings are dry-run before anything runs
                self.check_actions(i, [2 * p.pp for p in s.pipelines])
        self._overlap_checked: set[tuple[int, tuple[int, ...]]] = set()
        if options.schedule.overlap is not None and self.verify:
            for i in range(len(strategies)):  # typical dispatches; the Trainer checks each real one
                for counts in typical_dispatches(len(strategies[i].pipelines)):
                    self.check_overlap(i, counts)
        # How training packs documents (hgraph.compiler.packing_proof): proved once everything else compiled,
        # so a refusal of the model comes first and the probe runs only on a model that compiles.
        self.packing: PackingProof = prove_packing(traced, options.packing)
        _check_padding(self.packing, strategies, options)
        self.compile_seconds = time.perf_counter() - start

    # ------------------------------------------------------------------ verification (verify.py)
    def check_actions(self, strategy: StrategyLike, micro_batches: Sequence[int]) -> None:
        """Dry-run the action lists (``RankProgram.actions``) of every rank of ``strategy`` with
        ``micro_batches[p]`` micro-batches on pipeline ``p`` (``hgraph.schedule.actions.dry_run``); raises
        ``ScheduleError`` naming rank, action and peer on a deadlock or a mismatched order."""
        check_actions(self, self.strategy_index(strategy), micro_batches)

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
            with gc_paused():
                self._stages[key] = self._stage_graphs(pipeline, key)
        return self._stages[key]

    def _stage_graphs(self, pipeline: Pipeline, key: tuple[int, int, int, int, int]) -> list[StageGraph]:
        """``stage_graphs`` built: the partition step (with the pipeline-level passes), then the stage
        passes on each stage."""
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

    def expert_weights(self) -> set[str]:
        """Names of the parameters that hold one slice per routed expert (``[E, ...]``)."""
        if not hasattr(self, "_expert_weights"):
            blocks = find_expert_blocks(self.traced.graph_module, set(self.traced.param_names))
            self._expert_weights = {self.traced.param_names[w.name] for b in blocks for w in b.weights}
        return self._expert_weights

    def _specs(self, program_key: tuple[int, int, int], key: str) -> dict[str, tuple]:
        return parameter_specs(self.local_program(*program_key), self.traced.param_names, key)

    def _param_meshes(self, program_key: tuple[int, int, int]) -> dict[str, tuple[int, int]]:
        """The expert weights of that local program, each with the expert mesh ``(ep, etp)`` its
        specs are on (every other parameter's are on the stage mesh)."""
        gm = self.local_program(*program_key)
        return {self.traced.param_names[n.name]: tuple(n.meta["hgraph_param_mesh"]) for n in gm.graph.nodes
                if n.op == "placeholder" and n.name in self.traced.param_names and "hgraph_param_mesh" in n.meta}

    def _cache(self, directory: Optional[str], own: list[tuple[int, int]], trust_shared: bool) -> Optional[CompileCache]:
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
        return CompileCache(directory, plan_key(inputs), trust_shared)

    def _misfit(self, stored: dict[tuple[int, int], dict[str, ParameterComm]], own: list[tuple[int, int]]) -> Optional[str]:
        """Why plans read from the cache are not this compile's (``None`` when they fit): other ranks,
        other parameters or holders, or Pull / Push ends other than the optimizer layouts."""
        if set(stored) != set(own):
            return "it holds other ranks' plans"
        for (index, _), comms in stored.items():
            users = self._comm_inputs(index)[0]
            if comms.keys() != users.keys():
                return f"its parameters of strategy {self.strategies[index]} are not this model's"
            for name, pc in comms.items():
                home = self.optimizer_layouts[name]
                if pc.holders != tuple(users[name]) or not pc.pull.src == pc.push.dst == home \
                        or pc.pull.plan is None or pc.push.plan is None \
                        or (pc.pull.plan.src, pc.pull.plan.dst, pc.push.plan.src, pc.push.plan.dst) \
                        != (pc.pull.src, pc.pull.dst, pc.push.src, pc.push.dst):
                    return f"its plans of {name} in strategy {self.strategies[index]} do not fit this model"
        return None

    def _comm_inputs(self, index: int) -> PlanInputs:
        """Strategy ``index``'s ``plan_inputs`` (built once)."""
        if index not in self._plan_inputs:
            self._plan_inputs[index] = plan_inputs(self.strategies[index], self.stage_graphs, self._specs,
                                                   self._param_meshes, self.traced.param_names)
        return self._plan_inputs[index]

    def _parameter_layouts(self, index: int) -> dict[str, ParameterLayouts]:
        """Every parameter's optimizer, compute and gradient layouts in strategy ``index`` (shared by
        its ranks): the insert_comm step, with the user passes at its level."""
        if index not in self._param_layouts:
            strategy = self.strategies[index]
            ctx = self._context(strategy=strategy)
            gm = self.local_program(*strategy.pipelines[0].program_key)
            with gc_paused():
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
            itemsize, push_itemsize = itemsizes(self.options)
            with gc_paused():  # the plans' cached rules are long-lived: no full collection of the graphs meanwhile
                self._param_comm[key] = plan_parameters(layouts, itemsize, self.options.topology, push_itemsize, rank)
            self.pass_history.append(
                PassRecord("plan", time.perf_counter() - start, 0, 0, f"strategy {self.strategies[index]} rank {rank}")
            )
        return self._param_comm[key]

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """Canonical FQN -> the user's model's parameter, where fp32 master shards start from. A model
        built on meta holds no values: its shards come from ``Trainer(weights=...)`` or its own
        initialisation instead."""
        if is_meta_model(self.model):
            raise InputError(
                f"{type(self.model).__name__} holds no parameter values (built on the meta device or released): "
                "give the Trainer weights=PATH (a safetensors checkpoint) or let it initialise the model layer by layer"
            )
        named = dict(self.model.named_parameters())
        return {fqn: named[fqn] for fqn in self.traced.param_names.values()}

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
        stages = self.stage_graphs(pipeline)
        comm = self.parameter_comm(index, rank)
        pulls = tuple(comm[name] for name in self.traced.param_names.values() if name in comm)  # forward order
        program = RankProgram(
            strategy_index=index,
            rank=rank,
            pipeline=pi,
            stage=stage,
            pp=pipeline.pp,
            groups=pipeline.groups_of(rank),
            stage_graph=stages[stage],
            chunk_graphs=tuple(stages[stage::pipeline.pp]),
            vpp=pipeline.vpp,
            param_of_placeholder=dict(self.traced.param_names),
            pulls=pulls,
            pushes=tuple(reversed(pulls)),
            activations=tuple(activation_subgraphs(stages, s, pi)),
            compute_dtype=self.options.compute_dtype,
            reduce_dtype=self.options.reduce_dtype,
            coalesce=self.options.schedule.coalesce,
            pipeline_schedule=self.options.schedule.pipeline,
        )
        ctx = self._context(cp=pipeline.cp, tp=pipeline.tp, pp=pipeline.pp, ep=pipeline.ep, strategy=s, program=program)
        program, records = self._passes["rank"].around(
            program.stage_graph.gm, ctx, f"strategy {s} rank {rank}",
            lambda: self._scheduled(program), lambda scheduled: replace(ctx, program=scheduled))
        self.pass_history += records
        return program

    def _scheduled(self, program: RankProgram) -> RankProgram:
        """The schedule step: ``program`` with its lowering (``schedule="overlap"``: its overlap order)."""
        if self.options.schedule.overlap is None:
            return program
        return replace(program, overlap=rank_schedule(program, self.options.schedule.overlap))

    # ------------------------------------------------------------------ inspection (show.py)
    def subgraphs(self, strategy: StrategyLike, rank: int) -> list[CommSubgraph]:
        """Communication subgraphs this rank takes part in: pulls, activations (in-stage and
        between stages), pushes, in execution order."""
        return subgraphs(self, strategy, rank)

    def backward_program(self, strategy: StrategyLike, rank: int, seq_len: int = 16) -> fx.GraphModule:
        """The rank's stage backward as an fx graph ``(*saved, *output grads) -> grads`` (parameters,
        then received activations), traced at one micro-batch of ``seq_len`` tokens; its communication
        nodes (``hgraph.*`` ops) carry ``meta["hgraph_comm"]``. See ``hgraph.passes.backward``."""
        return self.joint_program(strategy, rank, seq_len).backward

    def joint_program(self, strategy: StrategyLike, rank: int, seq_len: int = 16) -> JointGraphs:
        """Forward and backward graphs of the rank's stage (``hgraph.passes.backward.JointGraphs``)."""
        key = (self.strategy_index(strategy), rank, seq_len)
        if key not in self._joints:
            with COMPILE_LOCK:  # make_fx keeps global tracing state
                self._joints[key] = rank_joint(self, key[0], rank, seq_len)
        return self._joints[key]

    def explain(self, strategy: StrategyLike, rank: int, backward: bool = True) -> str:
        """Readable summary of one rank's program: compute, the three subgraph kinds, layouts, bytes;
        with ``backward``, the collectives of its traced backward (``backward_program``). See ``hgraph.compiler.show``."""
        return explain(self, strategy, rank, backward)

    def write_dot(self, strategy: StrategyLike, rank: int, path: str) -> str:
        """Write the rank's stage program as Graphviz dot (communication nodes highlighted)."""
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
        input_ids: Union[torch.Tensor, Sequence[torch.Tensor]],
        targets: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run every rank of ``strategy`` in one process; return the token-mean loss and full grads.

        ``input_ids``: a list of 1-D documents of any lengths, dispatched and packed as ``Trainer.step``
        packs them (``micro_batch_tokens`` per micro-batch, cp chunks) — compare with the model run on
        each document alone; or a ``[batch, seq]`` tensor, each row its own micro-batch."""
        return simulate_strategy(self, self.strategy_index(strategy), input_ids, targets, position_ids,
                                 micro_batch_tokens)

    def packing_for(self, tokens: int) -> PackingProof:
        """``packing``, checked to cover packed micro-batches of ``tokens`` tokens: ``PackingError``
        where it is exact only for shorter ones (``PackingProof.checked_tokens``)."""
        check_rows(self.traced, self.packing, tokens)
        return self.packing


def _check_padding(proof: PackingProof, strategies: Sequence[Strategy], options: CompileOptions) -> None:
    """A strategy that pads every micro-batch (cp chunks, sequence-parallel tp) puts padding next to
    each document: refused unless packing is proved exact."""
    if proof.exact:
        return
    for s in strategies:
        for p in s.pipelines:
            if p.cp > 1 or (options.sequence_parallel and p.tp > 1):
                why = "cuts it into 2·cp chunks" if p.cp > 1 else "splits its tokens over tp (sequence parallelism)"
                raise PackingError(
                    f"strategy '{s}' pads every micro-batch (it {why}), so each document shares its micro-batch "
                    f"with padding, which needs packing proved exact; {proof}. Use strategies without cp"
                    + (" or CompileOptions(sequence_parallel=False)" if options.sequence_parallel else "")
                )


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
