"""``CompiledModel``: one explicit, inspectable program per strategy and rank (``hgraph.compile``,
in ``entry.py``, checks the options, traces the model and builds one).

The compile walk is ``hgraph.compiler.build``: every product (local programs, stage programs,
Pull / Push layouts and plans, rank programs with their schedule and overlap graph) computed once,
in order, when the ``CompiledModel`` is made; this class looks them up, verifies, prints and
simulates. The compiled ``rank``'s programs (default: the process's own under ``hgraph.launch`` /
torchrun; ``None``: every rank) exist when ``compile`` returns, so a training step compiles
nothing; any other rank's are built on first use, so a rank of a 1,024-rank job plans only its own
transfers. Switching strategies between iterations costs nothing but the Pulls the new strategy
needs. Optimizer state lives in the fixed layout of ``hgraph.core.zero`` and never moves.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn

from hgraph.compiler.build import Builder, build, gc_paused
from hgraph.compiler.packing_proof import check_rows, prove_packing
from hgraph.compiler.show import explain, subgraphs, write_dot
from hgraph.compiler.verify import check_actions, typical_dispatches
from hgraph.core.batch import DEFAULT_MICRO_BATCH_TOKENS
from hgraph.errors import InputError, PackingError, StrategyError
from hgraph.core.layout import Layout
from hgraph.core.strategy import Pipeline, Strategy
from hgraph.frontend.capture import CAPTURE_LOCK, TracedModel
from hgraph.frontend.meta import is_meta_model
from hgraph.passes.backward import JointGraphs, rank_joint
from hgraph.passes.pipeline import PassRecord
from hgraph.program.options import CompileOptions
from hgraph.program.products import CommSubgraph, PackingProof, ParameterComm, ParameterLayouts, StageGraph
from hgraph.program.rank_program import RankProgram
from hgraph.runtime.thread_oracle import simulate_strategy

StrategyLike = Union[int, Strategy]
COMPILE_LOCK = CAPTURE_LOCK  # one capture at a time per process, shared with per-shape re-traces
VERIFY_WORLD = 64  # default: the compile-time dry run checks every rank up to this world size


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
        start = time.perf_counter()
        self._builder = Builder(traced, strategies, options)
        self.param_shapes = self._builder.param_shapes
        self._products = build(self._builder, rank, options.build.cache_dir, options.build.trust_shared_cache)
        self.optimizer_layouts: dict[str, Layout] = self._products.optimizer_layouts
        self.cache_hit = self._products.cache_hit
        self._joints: dict[tuple[int, int, int], JointGraphs] = {}
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
    def check_actions(self, strategy: StrategyLike, micro_batches: Sequence[int], mode: str = "train") -> None:
        """Dry-run the action lists (``RankProgram.actions(m, mode)``) of every rank of ``strategy`` with
        ``micro_batches[p]`` micro-batches on pipeline ``p`` (``hgraph.schedule.replay.dry_run``); raises
        ``ScheduleError`` naming rank, action and peer on a deadlock or a mismatched order."""
        check_actions(self, self.strategy_index(strategy), micro_batches, mode)

    def check_overlap(self, strategy: StrategyLike, micro_batches: Sequence[int]) -> None:
        """Dry-run the overlap schedules of every rank of ``strategy`` with ``micro_batches[p]``
        micro-batches on pipeline ``p``; raises ``ScheduleError`` on a mismatched order or a hang.
        Reads every rank's program, so it runs only when compiled with ``verify`` (default: world
        size <= ``VERIFY_WORLD``; compile then builds them all); ``verify_overlap`` runs it regardless."""
        if self.verify:
            self.verify_overlap(strategy, micro_batches)

    def verify_overlap(self, strategy: StrategyLike, micro_batches: Sequence[int]) -> None:
        """``check_overlap`` whatever ``verify`` says (the offline check of a per-rank compile)."""
        index = self.strategy_index(strategy)
        key = (index, tuple(micro_batches))
        if key not in self._overlap_checked:
            self.check_actions(index, micro_batches)  # the programs' actions are the overlap lowering
            self._overlap_checked.add(key)

    # ------------------------------------------------------------------ products (hgraph.compiler.build)
    @property
    def pass_history(self) -> list[PassRecord]:
        """Every pass and step the compile ran, in order (``hgraph.passes.pipeline.PassRecord``)."""
        return self._builder.pass_history

    def local_program(self, cp: int, tp: int, ep: int = 1) -> fx.GraphModule:
        """The local (per-rank) program of a ``cp x tp`` stage mesh (its MoE experts split ``ep``
        ways), before pipeline cuts (built now for a mesh no compiled strategy has)."""
        key = (cp, tp, ep)
        if key not in self._products.local:
            with gc_paused():
                self._products.local[key] = self._builder.local_program(key)
        return self._products.local[key]

    def stage_graphs(self, pipeline: Pipeline) -> list[StageGraph]:
        """The pipeline's ``pp * vpp`` (virtual) stage programs; physical stage ``s`` runs ``s, s + pp, ...``
        (built now for a pipeline shape no compiled strategy has)."""
        key = pipeline.degrees
        if key not in self._products.stages:
            gm = self.local_program(*pipeline.program_key)
            with gc_paused():
                self._products.stages[key] = self._builder.stage_graphs(pipeline, gm)
        return self._products.stages[key]

    def expert_weights(self) -> set[str]:
        """Names of the parameters that hold one slice per routed expert (``[E, ...]``)."""
        return self._builder.expert_weights

    def parameter_layouts(self, strategy: StrategyLike) -> dict[str, ParameterLayouts]:
        """Every parameter's optimizer, compute and gradient layouts in ``strategy`` (the insert_comm step)."""
        return self._products.layouts[self.strategy_index(strategy)]

    def parameter_comm(self, strategy: StrategyLike, rank: int) -> dict[str, ParameterComm]:
        """Pull / Push subgraphs of every parameter in ``strategy`` with ``rank``'s part of each plan
        (equal to the full plan's steps for that rank, ``hgraph.lnk.solve_rank``)."""
        return self._builder.rank_comm(self._products, self.strategy_index(strategy), rank)

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
        """The per-rank program: its stage's forward graph, pulls, pushes and schedule (the compiled
        rank's exist after compile; another rank's are built on first use)."""
        index = self.strategy_index(strategy)
        found = self._products.programs.get((index, rank))
        return found if found is not None else self._builder.rank_program(self._products, index, rank)

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
