"""``hgraph.compile``: one explicit, inspectable program per strategy and rank.

Data flow (each step a pass or a cached product, see docs/architecture.md)::

    model --trace--> fx graph (forward + summed loss, params as inputs)
      per stage mesh (cp, tp):  annotate -> localize            (+ user passes)   = local program
      per (cp, tp, pp):         partition                                        = stage programs
      per strategy:             insert_comm: Pull / Push plans (LNK), activation boundaries
      per (strategy, rank):     RankProgram = its stage program + pulls + pushes + 1F1B schedule

Everything is built once in ``compile`` and cached, so switching strategies between iterations
costs nothing but the Pulls the new strategy needs. Optimizer state lives in the fixed layout of
``hgraph.zero`` and never moves.
"""

from __future__ import annotations

import copy
import operator
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn

from hgraph.actions import PIPELINE_SCHEDULES, dry_run, steps, wrapped_chunk
from hgraph.errors import HGraphError, InputError, StrategyError
from hgraph.frontend import CAPTURE_LOCK, TracedModel, trace
from hgraph.layout import InterleavedShard, Layout
from hgraph.passes.insert_comm import CommSubgraph, ParameterComm, activation_subgraphs, plan_parameters
from hgraph.passes.partition import StageGraph, partition
from hgraph.passes.pipeline import Pass, PassManager, PassRecord
from hgraph.passes.precision import fp32_loss
from hgraph.passes.recompute import RecomputeConfig, recompute, regions
from hgraph.runtime.executor import RankProgram
from hgraph.strategy import Pipeline, Strategy, as_strategies
from hgraph.zero import optimizer_layout

StrategyLike = Union[int, Strategy]
_COMPILE_LOCK = CAPTURE_LOCK  # one capture at a time per process, shared with per-shape re-traces


@dataclass(frozen=True)
class CompileOptions:
    """Knobs of ``compile`` (all optional)."""

    compute_dtype: Optional[torch.dtype] = None
    sequence_parallel: bool = False
    vocab_parallel: bool = True
    schedule: str = "none"
    layer_costs: Optional[tuple[float, ...]] = None
    topology: Any = None
    overlap: Any = None  # passes.schedule.OverlapConfig when schedule == "overlap"
    recompute: RecomputeConfig = RecomputeConfig()
    recompute_by_scheme: tuple[tuple[tuple[int, int, int], RecomputeConfig], ...] = ()  # (cp, tp, pp)

    def recompute_for(self, cp: int, tp: int, pp: int) -> RecomputeConfig:
        """The recompute config of pipelines with these degrees."""
        return dict(self.recompute_by_scheme).get((cp, tp, pp), self.recompute)
    reduce_dtype: Optional[torch.dtype] = torch.float32
    coalesce: bool = False
    pipeline_schedule: str = "1f1b"  # hgraph.actions.PIPELINE_SCHEDULES


@dataclass
class CompileContext:
    """What passes see besides the graph: the traced model, the stage mesh and the options.

    Passes that produce more than a graph (stage cuts, plans) leave it here for later passes.
    """

    traced: TracedModel
    world_size: int
    options: CompileOptions
    cp: int = 1
    tp: int = 1
    pp: int = 1
    strategy: Optional[Strategy] = None
    stages: Optional[list[StageGraph]] = None
    parameter_comm: dict[str, ParameterComm] = field(default_factory=dict)
    recompute: Optional[RecomputeConfig] = None  # this pipeline scheme's, for the recompute pass

    @property
    def mesh(self) -> tuple[int, int]:
        return (self.cp, self.tp)

    @property
    def sequence_parallel(self) -> bool:
        return self.options.sequence_parallel

    @property
    def vocab_parallel(self) -> bool:
        return self.options.vocab_parallel


def _annotate_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    from hgraph.passes.annotate import annotate

    return annotate(gm, ctx)


def _localize_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    from hgraph.passes.localize import localize

    return localize(gm, ctx)


MESH_PASSES = (Pass("annotate", _annotate_pass), Pass("localize", _localize_pass))


def model_dims(model: nn.Module) -> dict[str, int]:
    """Heads, kv heads, hidden size, vocabulary and layers, read from the model's config."""
    cfg = getattr(model, "config", None)
    dims: dict[str, int] = {}
    if cfg is None:
        return dims
    names = {
        "heads": ("heads", "num_attention_heads", "n_head"),
        "kv_heads": ("kv_heads", "num_key_value_heads"),
        "hidden": ("hidden", "hidden_size", "n_embd"),
        "vocab": ("vocab_size",),
        "layers": ("layers", "num_hidden_layers", "n_layer"),
    }
    for key, options in names.items():
        for attr in options:
            value = getattr(cfg, attr, None)
            if isinstance(value, int):
                dims[key] = value
                break
    if "heads" in dims and "kv_heads" not in dims:
        dims["kv_heads"] = dims["heads"]
    return dims


def validate_strategies(strategies: Sequence[Strategy], world_size: int, dims: dict[str, int]) -> None:
    """Check every strategy against the world and the model; one clear error per problem."""
    for s in strategies:
        s.check_world_size(world_size)
        for p in s.pipelines:
            for key, label in (("heads", "attention heads"), ("kv_heads", "key/value heads"), ("hidden", "hidden size"), ("vocab", "vocabulary")):
                if key == "kv_heads" and key in dims and p.tp % dims[key] == 0:
                    continue  # fewer key/value heads than tp ranks: each is replicated (Megatron)
                if key in dims and dims[key] % p.tp:
                    raise StrategyError(
                        f"strategy {s}: tp={p.tp} does not divide the {label} ({dims[key]}); "
                        f"use a tp that divides {dims[key]}"
                    )
            if "layers" in dims and p.pp > dims["layers"]:
                raise StrategyError(
                    f"strategy {s}: pp={p.pp} exceeds the model's {dims['layers']} layers; use pp <= {dims['layers']}"
                )
            if "layers" in dims and p.pp * p.vpp > dims["layers"]:
                raise StrategyError(
                    f"strategy {s}: pp*vpp={p.pp * p.vpp} virtual stages exceed the model's {dims['layers']} layers; "
                    f"use vpp <= {dims['layers'] // p.pp}"
                )


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
    ) -> None:
        self.model = model
        self.traced = traced
        self.strategies = strategies
        self.options = options
        self.world_size = strategies[0].world_size
        self.pass_history: list[PassRecord] = []
        self._user_passes = _check_user_passes(user_passes)
        self._disabled = _check_disabled(disabled, self._user_passes)
        self.param_shapes = {fqn: tuple(t.shape) for fqn, t in traced.params().items()}
        self._local: dict[tuple[int, int], fx.GraphModule] = {}
        self._stages: dict[tuple[int, int, int, int], list[StageGraph]] = {}  # (cp, tp, pp, vpp)
        self._param_comm: dict[int, dict[str, ParameterComm]] = {}
        self._programs: dict[tuple[int, int], RankProgram] = {}
        self._joints: dict[tuple[int, int, int], Any] = {}  # passes.backward.JointGraphs
        start = time.perf_counter()
        self.optimizer_layouts: dict[str, Layout] = self._optimizer_layouts()
        for i in range(len(strategies)):
            self._build_strategy(i)
        if options.pipeline_schedule != "1f1b" or any(p.vpp > 1 for s in strategies for p in s.pipelines):
            for i, s in enumerate(strategies):  # the new lowerings are dry-run before anything runs
                self.check_actions(i, [2 * p.pp for p in s.pipelines])
        self._overlap_checked: set[tuple[int, tuple[int, ...]]] = set()
        if options.schedule == "overlap":
            for i in range(len(strategies)):  # typical dispatches; the Trainer checks each real one
                n = len(strategies[i].pipelines)
                for counts in ([1] * n, [2] * n, [3] * n, [2] * (n - 1) + [0]):
                    self.check_overlap(i, counts)
        self.compile_seconds = time.perf_counter() - start

    def check_actions(self, strategy: StrategyLike, micro_batches: Sequence[int]) -> None:
        """Dry-run the action lists (``RankProgram.actions``) of every rank of ``strategy`` with
        ``micro_batches[p]`` micro-batches on pipeline ``p`` (``hgraph.actions.dry_run``); raises
        ``ScheduleError`` naming rank, action and peer on a deadlock or a mismatched order."""
        index = self.strategy_index(strategy)
        programs = {r: self.program(index, r) for r in range(self.world_size)}
        bucket_ranks = {(r, pc.name): pc.pull.plan.ranks for r, p in programs.items() for pc in p.pulls}
        bucket_ranks.update({(r, pc.name): pc.push.plan.ranks for r, p in programs.items() for pc in p.pushes})
        dry_run(
            {r: p.actions(micro_batches[p.pipeline]) for r, p in programs.items()},
            members=lambda r, group: bucket_ranks[(r, group)],
            first=lambda r, c: programs[r].stage == 0 and c == 0,
            last=lambda r, c: programs[r].is_last_stage and c == programs[r].vpp - 1,
            route=lambda r, a: wrapped_chunk(programs[r].pp, programs[r].stage, a),
        )

    def check_overlap(self, strategy: StrategyLike, micro_batches: Sequence[int]) -> None:
        """Dry-run the overlap schedules of every rank of ``strategy`` with ``micro_batches[p]``
        micro-batches on pipeline ``p``; raises ``ScheduleError`` on a mismatched order or a hang."""
        from hgraph.passes.schedule import check

        index = self.strategy_index(strategy)
        key = (index, tuple(micro_batches))
        if key in self._overlap_checked:
            return
        programs = [self.program(index, r) for r in range(self.world_size)]
        check(programs, [p.overlap for p in programs], [micro_batches[p.pipeline] for p in programs])
        self._overlap_checked.add(key)

    # ------------------------------------------------------------------ building
    def _context(self, **kw: Any) -> CompileContext:
        return CompileContext(self.traced, self.world_size, self.options, **kw)

    def local_program(self, cp: int, tp: int) -> fx.GraphModule:
        """The local (per-rank) program of a ``cp x tp`` stage mesh, before pipeline cuts."""
        key = (cp, tp)
        if key not in self._local:
            gm = copy.deepcopy(self.traced.graph_module)
            manager = PassManager.build(MESH_PASSES, self._user_passes_at(MESH_PASSES), self._disabled_at(MESH_PASSES))
            self._local[key] = manager.run(gm, self._context(cp=cp, tp=tp))
            self.pass_history += manager.history
        return self._local[key]

    def _user_passes_at(self, builtin: Sequence[Pass]) -> list[Pass]:
        names = {p.name for p in builtin}
        return [p for p in self._user_passes if p.after in names or p.before in names]

    def _disabled_at(self, builtin: Sequence[Pass]) -> frozenset[str]:
        names = {p.name for p in builtin} | {p.name for p in self._user_passes_at(builtin)}
        return frozenset(self._disabled & names)

    def stage_graphs(self, pipeline: Pipeline) -> list[StageGraph]:
        """The pipeline's ``pp * vpp`` (virtual) stage programs; physical stage ``s`` runs ``s, s + pp, ...``."""
        key = (pipeline.cp, pipeline.tp, pipeline.pp, pipeline.vpp)
        if key not in self._stages:
            gm = self.local_program(pipeline.cp, pipeline.tp)
            start = time.perf_counter()
            params = set(self.traced.param_names)
            stages = partition(gm, pipeline.pp * pipeline.vpp, lambda n: n.name in params, self.options.layer_costs)
            self.pass_history.append(
                PassRecord("partition", time.perf_counter() - start, len(gm.graph.nodes), len(gm.graph.nodes))
            )
            ctx = self._context(cp=pipeline.cp, tp=pipeline.tp, pp=pipeline.pp)
            stages = [replace(sg, gm=fp32_loss(sg.gm, ctx)) if sg.returns_loss else sg for sg in stages]
            config = self.options.recompute_for(*key[:3])
            if config.mode != "none" and "recompute" not in self._disabled:
                start = time.perf_counter()
                ctx = self._context(cp=pipeline.cp, tp=pipeline.tp, pp=pipeline.pp, recompute=config)
                before = sum(len(sg.gm.graph.nodes) for sg in stages)
                stages = [replace(sg, gm=recompute(sg.gm, ctx)) for sg in stages]
                after = sum(len(sg.gm.graph.nodes) for sg in stages)
                self.pass_history.append(PassRecord("recompute", time.perf_counter() - start, before, after))
            self._stages[key] = stages
        return self._stages[key]

    def _optimizer_layouts(self) -> dict[str, Layout]:
        """The fixed ZeRO layouts; a fused projection cut by blocks on some stage mesh keeps its blocks."""
        blocks: dict[str, InterleavedShard] = {}
        for mesh in dict.fromkeys(p.stage_mesh for s in self.strategies for p in s.pipelines):
            for fqn, spec in self._specs(*mesh, "hgraph_param_spec").items():
                for p in spec:
                    if isinstance(p, InterleavedShard):
                        blocks.setdefault(fqn, p)
        return {fqn: optimizer_layout(shape, self.world_size, blocks.get(fqn)) for fqn, shape in self.param_shapes.items()}

    def _specs(self, cp: int, tp: int, key: str) -> dict[str, tuple]:
        gm = self.local_program(cp, tp)
        out = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder" and n.name in self.traced.param_names:
                spec = n.meta.get(key)
                if spec is None:
                    raise HGraphError(f"localize left parameter {n.name} without {key}")
                out[self.traced.param_names[n.name]] = tuple(spec)
        return out

    def _build_strategy(self, index: int) -> None:
        strategy = self.strategies[index]
        start = time.perf_counter()
        users: dict[str, list[tuple[int, int]]] = {}
        specs, grad_specs = {}, {}
        for i, pipeline in enumerate(strategy.pipelines):
            mesh = pipeline.stage_mesh
            specs[mesh] = self._specs(*mesh, "hgraph_param_spec")
            grad_specs[mesh] = self._specs(*mesh, "hgraph_grad_spec")
            for sg in self.stage_graphs(pipeline):
                for ph in sg.params:
                    holder = (i, sg.stage % pipeline.pp)  # the physical stage running this chunk
                    if holder not in users.setdefault(self.traced.param_names[ph], []):
                        users[self.traced.param_names[ph]].append(holder)
        compute = self.options.compute_dtype or torch.float32
        itemsize = torch.finfo(compute).bits // 8
        push_itemsize = torch.finfo(self.options.reduce_dtype or compute).bits // 8
        self._param_comm[index] = plan_parameters(
            strategy, users, specs, grad_specs, self.param_shapes, self.optimizer_layouts, itemsize,
            self.options.topology, push_itemsize,
        )
        self.pass_history.append(PassRecord(f"insert_comm[{strategy}]", time.perf_counter() - start, 0, 0))

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """Canonical FQN -> the user's model's parameter, where fp32 master shards start from (the
        traced copy holds them in the compute dtype)."""
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
        ranks = pipeline.stage_ranks(stage)
        pos = ranks.index(rank)
        c, t = divmod(pos, pipeline.tp)
        groups = {
            "tp": tuple(ranks[c * pipeline.tp + j] for j in range(pipeline.tp)),
            "cp": tuple(ranks[j * pipeline.tp + t] for j in range(pipeline.cp)),
            "stage": tuple(ranks),
            "pipeline": tuple(pipeline.ranks or ()),
        }
        stages = self.stage_graphs(pipeline)
        comm = self._param_comm[index]
        order = self._layer_order()
        pulls = [comm[name] for name in order if name in comm]
        program = RankProgram(
            strategy_index=index,
            rank=rank,
            pipeline=pi,
            stage=stage,
            pp=pipeline.pp,
            groups=groups,
            stage_graph=stages[stage],
            chunk_graphs=stages[stage::pipeline.pp],
            vpp=pipeline.vpp,
            param_of_placeholder=dict(self.traced.param_names),
            pulls=pulls,
            pushes=list(reversed(pulls)),
            activations=activation_subgraphs(stages, s, pi),
            compute_dtype=self.options.compute_dtype,
            reduce_dtype=self.options.reduce_dtype,
            coalesce=self.options.coalesce,
            pipeline_schedule=self.options.pipeline_schedule,
        )
        if self.options.schedule == "overlap":
            from hgraph.passes.schedule import build

            program.overlap = build(program, self.options.overlap)
        return program

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
                records.append(_activation_record(n, info))
        records += [a for a in prog.activations if f"stage{prog.stage}" in str(a.src) or f"stage{prog.stage}" in str(a.dst)]
        records += [pc.push for pc in prog.pushes if rank in pc.push.plan.ranks]
        return records

    def backward_program(self, strategy: StrategyLike, rank: int, seq_len: int = 16) -> fx.GraphModule:
        """The rank's stage backward as an fx graph ``(*saved, *output grads) -> grads`` (parameters,
        then received activations), traced at one micro-batch of ``seq_len`` tokens; its communication
        nodes (``hgraph.*`` ops) carry ``meta["hgraph_comm"]``. See ``hgraph.passes.backward``."""
        return self.joint_program(strategy, rank, seq_len).backward

    def joint_program(self, strategy: StrategyLike, rank: int, seq_len: int = 16) -> Any:
        """Forward and backward graphs of the rank's stage (``hgraph.passes.backward.JointGraphs``)."""
        from hgraph.passes.backward import rank_joint

        key = (self.strategy_index(strategy), rank, seq_len)
        if key not in self._joints:
            with _COMPILE_LOCK:  # make_fx keeps global tracing state
                self._joints[key] = rank_joint(self, key[0], rank, seq_len)
        return self._joints[key]

    def explain(self, strategy: StrategyLike, rank: int, backward: bool = True) -> str:
        """Readable summary of one rank's program: compute, the three subgraph kinds, layouts, bytes;
        with ``backward``, the collectives of its traced backward (``backward_program``)."""
        prog = self.program(strategy, rank)
        s = self.strategies[prog.strategy_index]
        sg = prog.stage_graph
        lines = [
            f"strategy {s} — rank {rank}: pipeline {prog.pipeline} {s.pipelines[prog.pipeline]}, "
            f"stage {prog.stage}/{prog.pp} (layers {list(sg.layers)}), groups "
            + ", ".join(f"{k}={list(v)}" for k, v in prog.groups.items()),
        ]
        body = [n for r in regions(sg.gm) for n in r.body.graph.nodes]
        compute = [n for n in [*sg.gm.graph.nodes, *body]
                   if n.op == "call_function" and not n.meta.get("hgraph_comm")
                   and not (n.target is operator.getitem and n.args[0].op == "call_module")]
        schedule = "interleaved" if prog.vpp > 1 else prog.pipeline_schedule
        lines.append(f"compute: {len(compute)} ops; {schedule} schedule (4 micro-batches): "
                     + " ".join(" + ".join(map(str, step)) for step in steps(prog.pipeline_actions(4))))
        pipeline = s.pipelines[prog.pipeline]
        lines.append(f"recompute: {self.options.recompute_for(pipeline.cp, pipeline.tp, pipeline.pp)}" + "".join(
            f"{': ' if i == 0 else '; '}layer {r.layer} ({r.summary()})" for i, r in enumerate(regions(sg.gm))))
        totals: dict[str, int] = {}
        for rec in self.subgraphs(strategy, rank):
            lines.append("  " + str(rec))
            totals[rec.kind] = totals.get(rec.kind, 0) + rec.bytes
        lines.append("bytes: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
        if backward:
            from hgraph.passes.backward import comm_nodes

            seq_len = 16 * len(prog.groups["cp"])  # 16 local tokens, in 2·cp load-balanced chunks
            nodes = comm_nodes(self.backward_program(strategy, rank, seq_len))
            lines.append(f"backward (1 x {seq_len} tokens): {len(nodes)} communication nodes")
            lines += [
                f"  {replace(_activation_record(n, n.meta['hgraph_comm']), direction='backward')}"
                for n in nodes
            ]
        return "\n".join(lines)

    def write_dot(self, strategy: StrategyLike, rank: int, path: str) -> str:
        """Write the rank's stage program as Graphviz dot (communication nodes highlighted)."""
        sg = self.program(strategy, rank).stage_graph
        lines = ["digraph hgraph {", "  node [shape=box, fontsize=10];"]
        for n in sg.gm.graph.nodes:
            style = ', style=filled, fillcolor="#ffd27f"' if n.meta.get("hgraph_comm") else ""
            label = f"{n.name}\\n{getattr(n.target, '__name__', n.target)}" if n.op == "call_function" else n.name
            lines.append(f'  "{n.name}" [label="{label}"{style}];')
            for a in n.all_input_nodes:
                lines.append(f'  "{a.name}" -> "{n.name}";')
        lines.append("}")
        text = "\n".join(lines) + "\n"
        with open(path, "w") as fh:
            fh.write(text)
        return text

    def __str__(self) -> str:
        return (
            f"CompiledModel({type(self.model).__name__}, world {self.world_size}, strategies: "
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
        from hgraph.simulate import simulate_strategy

        return simulate_strategy(self, self.strategy_index(strategy), input_ids, targets, position_ids)


def _check_disabled(disabled: Iterable[str], user_passes: Sequence[Pass]) -> frozenset[str]:
    """``disable`` names must be passes that exist (built-in or user); anything else is a typo."""
    if isinstance(disabled, str):
        disabled = (disabled,)
    names = frozenset(disabled)
    known = [p.name for p in MESH_PASSES] + ["recompute"] + [p.name for p in user_passes]
    unknown = sorted(names - set(known))
    if unknown:
        raise InputError(
            f"disable={unknown} names no pass; the passes that can be switched off are {known} "
            "(compile with passes=[...] to add your own)"
        )
    return names


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


def _check_user_passes(passes: Sequence[Any]) -> list[Pass]:
    """User passes as ``Pass`` objects anchored at a known point (a bare callable runs after localize)."""
    known = [p.name for p in MESH_PASSES]
    out = []
    for p in passes:
        if not isinstance(p, Pass):
            if not callable(p):
                raise HGraphError(f"{p!r} is not a hgraph.Pass or a callable (gm, ctx) -> gm")
            p = Pass(getattr(p, "__name__", "user_pass"), p, after=known[-1])
        anchor = p.after or p.before
        if anchor is None:
            p = Pass(p.name, p.fn, after=known[-1])
        elif anchor not in known:
            raise HGraphError(f"{p} names an unknown point {anchor!r}; user passes go before or after one of {known}")
        out.append(p)
    return out


def _activation_record(node: fx.Node, info: Any) -> CommSubgraph:
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
    schedule: Any = "none",
    layer_costs: Optional[Sequence[float]] = None,
    topology: Any = None,
    recompute: Any = "none",
    reduce_dtype: Optional[torch.dtype] = torch.float32,
    coalesce: bool = False,
    pipeline_schedule: str = "1f1b",
) -> CompiledModel:
    """Trace ``model`` once and compile it for every strategy (all must cover the same world size).

    ``example_inputs``: ``input_ids`` ``[batch, seq]`` (or a tuple/dict with ``position_ids``,
    ``targets``). ``passes``: user ``hgraph.Pass`` objects placed at named points (``after="localize"``).
    ``disable``: names of built-in passes to skip. ``compute_dtype``: cast pulled parameters (e.g.
    ``torch.bfloat16``, halving Pull bytes). ``layer_costs``: per-layer cost for balancing stages.
    ``schedule``: ``"none"`` (pull all, 1F1B, push all) or ``"overlap"`` / an
    ``hgraph.passes.schedule.OverlapConfig`` (prefetched pulls, early pushes; same results).
    ``recompute``: ``"none"``, ``"selective"``, ``"full"`` or a ``RecomputeConfig`` choosing layers
    (``RecomputeConfig("full", every=2)``); see ``hgraph.passes.recompute``; or a dict from pipeline
    scheme (``"tp2,pp2"``) to one of those, e.g. the planner's ``choose_recompute`` per scheme. ``reduce_dtype``: dtype
    gradients are reduced in by Push Gradient (fp32 by default, also under a bf16 ``compute_dtype``;
    ``None`` reduces in the compute dtype). ``coalesce``: pull and push each layer's parameters
    together, one merged call per group and kind (``hgraph.runtime.coalesce``), so an iteration issues
    O(layers) collectives instead of O(parameters); ``schedule="none"`` only for now.
    ``pipeline_schedule``: ``"1f1b"`` or ``"zb1p"`` (zero-bubble ZB-H1: each backward split into an
    input-gradient and a weight-gradient step, ``schedule="none"`` only); a pipeline with ``vpp > 1``
    (``"tp1,pp2,vpp2"``) runs interleaved 1F1B; see ``hgraph.actions``.
    """
    strategies = as_strategies(strategies)
    if not strategies:
        raise StrategyError("compile needs at least one strategy")
    world = strategies[0].world_size
    validate_strategies(strategies, world, model_dims(model))
    if loss_fn is None and getattr(getattr(model, "config", None), "output_router_logits", False):
        raise InputError(
            f"{type(model).__name__} has config.output_router_logits=True: its auxiliary load-balancing loss "
            "is a product of batch-wide routing statistics, which the token-summed loss of hgraph's programs "
            "cannot split over micro-batches and pipelines; build the model with output_router_logits=False"
        )
    from hgraph.passes.schedule import OverlapConfig

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
    # Trace a copy in the compute dtype, so dtypes the model derives while tracing (rotary tables cast
    # to a buffer's or the hidden state's dtype) are those a bf16 model has; masters stay the user's.
    source = model
    if compute_dtype is not None and compute_dtype != torch.float32:
        source = copy.deepcopy(model).to(compute_dtype)
    with _COMPILE_LOCK:  # torch.export keeps global tracing state: one capture at a time per process
        traced = trace(source, example_inputs, loss_fn)
        return CompiledModel(model, traced, strategies, options, passes, disable)
