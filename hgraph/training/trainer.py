"""``hgraph.Trainer``: one training iteration per ``step`` on every rank, any strategy each time.

Every rank calls ``trainer.step(sequences)`` with the same global batch (a list of 1-D LongTensors);
``step`` checks that they did (a digest of the lengths and tokens, gathered from every rank) and
raises ``InputError`` naming the first rank whose batch differs. With one reader, ``step_data``
reads the batch on rank 0 and sends each rank only its tokens. The planner (or the given strategy with a default dispatch) decides which pipeline runs which
sequences, packed into which micro-batches; each rank builds its own micro-batches from that
decision, runs its program (Pull, 1F1B, Push) and steps its optimizer shards. The loss is the
token-mean next-token cross entropy over the whole batch, so any dispatch and packing gives the
same gradients as one device. One all-reduce closes every iteration: the loss, whether some rank was
asked to stop (SIGTERM, ``trainer.stop_requested``) and, with ``run=RunConfig(metrics=MetricsConfig(...))``, every
rank's peak memory and exposed communication for rank 0's metrics writer.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from hgraph.core.batch import longest_packed_row, rank_micro_batches
from hgraph.errors import InputError, TrainingError
from hgraph.core.flops import ModelFlops
from hgraph.core.placement import Replicate
from hgraph.core.model_info import model_dims
from hgraph.planner.dispatch import default_dispatch
from hgraph.planner.experts import layer_imbalance
from hgraph.planner.plan import Dispatch
from hgraph.frontend.meta import release_parameters
from hgraph.runtime import preemption
from hgraph.runtime.clock import DeviceClock, Mark
from hgraph.runtime.kernels.comm import Communicator
from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm
from hgraph.runtime.kernels.expert_dispatch import expert_dispatch
from hgraph.runtime.executor import run_evaluation, run_iteration
from hgraph.runtime.feed import scatter_sequences, share_lengths
from hgraph.runtime.initial_shards import initial_shards
from hgraph.runtime.metrics import MetricsWriter, peak_memory_bytes, reset_peak_memory
from hgraph.runtime.optimizer import ShardedAdamW
from hgraph.runtime.timeline import Timeline, exposed_communication, gather_events
from hgraph.training.configs import AdamWConfig, RunConfig
from hgraph.training.state import TrainerState, params_without_gradient

if TYPE_CHECKING:
    from hgraph.compiler.compiled_model import CompiledModel
    from hgraph.planner.assign import Planner

log = logging.getLogger(__name__)


class Trainer(TrainerState):
    """Trains a ``CompiledModel`` with a sharded AdamW; construct and call it on every rank. Its state
    (full parameters, ``state_dict``, ``save``/``load``) is read through ``hgraph.training.state``."""

    def __init__(
        self,
        compiled: "CompiledModel",
        *,
        optimizer: AdamWConfig = AdamWConfig(),
        planner: Optional["Planner"] = None,
        run: RunConfig = RunConfig(),
        comm: Optional[Communicator] = None,
    ) -> None:
        """``optimizer``: the sharded AdamW and its learning-rate schedule; ``planner``: decides each
        batch's strategy and dispatch (none: the given strategy with the default dispatch); ``run``: the
        micro-batch budget, device, metrics, timeline and where the weights come from (each field's
        docstring in ``hgraph.training.configs``); ``comm``: the communicator (default: the process group's)."""
        if not isinstance(optimizer, AdamWConfig) or not isinstance(run, RunConfig):
            raise InputError(f"Trainer(optimizer={optimizer!r}, run={run!r}); expected an AdamWConfig and a RunConfig")
        self.compiled = compiled
        self.comm = comm if comm is not None else ProcessGroupComm()
        # Shards, micro-batches and every tensor handed to a collective live here (default: the
        # communicator's device, i.e. this rank's GPU under NCCL, else CPU).
        self.device = torch.device(run.device) if run.device is not None else self.comm.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.comm.world_size != compiled.world_size:
            raise InputError(
                f"the program was compiled for {compiled.world_size} ranks but this world has "
                f"{self.comm.world_size}; launch with world_size={compiled.world_size}"
            )
        self.rank = self.comm.rank
        self.world = tuple(range(compiled.world_size))
        self.planner = planner
        self.grad_clip = optimizer.grad_clip
        self.micro_batch_tokens = run.micro_batch_tokens
        if planner is None:  # rows of up to micro_batch_tokens: refused now where packing is exact only for shorter
            compiled.packing_for(run.micro_batch_tokens)
        layouts = compiled.optimizer_layouts
        shards = initial_shards(compiled, self.rank, self.comm, self.world, self.device, run.weights, run.init_seed)
        replicated = frozenset(f for f, lay in layouts.items() if isinstance(lay.placements[0], Replicate))
        self.optimizer = ShardedAdamW(shards, optimizer.lr, optimizer.betas, optimizer.eps, optimizer.weight_decay,
                                      replicated)
        del shards
        if run.release_model:
            self.comm.barrier(self.world)  # simulated ranks share the model: every one has cut its shards
            for model in (compiled.model, compiled.traced.model):
                release_parameters(model)
        self.frozen = params_without_gradient(compiled.traced)
        self.lr_scheduler = optimizer.lr_scheduler(self.optimizer) if optimizer.lr_scheduler is not None else None
        self.iteration = 0
        self.history: list[dict[str, Any]] = []
        self.data: Any = None  # the TokenLoader of step_data; its position is saved with the checkpoint
        self._feed_batch: Optional[Sequence[torch.Tensor]] = None  # rank 0: the batch being fed
        # timeline=True: this rank's intervals of every step (runtime/timeline.py); gather_timeline()
        self.timeline: Optional[Timeline] = Timeline(self.rank) if run.timeline else None
        self.vocab: Optional[int] = model_dims(compiled.model).get("vocab")
        # metrics: rank 0 writes them (runtime/metrics.py); every rank measures its memory and exposed
        # communication (on a timeline of its own when none was asked for)
        self.metrics: Optional[MetricsWriter] = None
        metrics = run.metrics
        self._comm_timeline = self.timeline if self.timeline is not None or metrics is None else Timeline(self.rank)
        if metrics is not None:
            reset_peak_memory(self.device)
            if self.rank == 0:
                try:
                    flops: Optional[ModelFlops] = ModelFlops.of(compiled.model)
                except InputError as exc:
                    log.warning("no TFLOPs or MFU in the metrics: %s", exc)
                    flops = None
                self.metrics = MetricsWriter(metrics, len(self.world), flops)
        self.measure = metrics is not None
        self.stop_requested = False  # some rank got SIGTERM (runtime/preemption.py); set every step

    # ------------------------------------------------------------------ planning
    def dispatch(self, lengths: Sequence[int], strategy: Union[int, Any, None] = None) -> Dispatch:
        """Where each sequence runs this iteration (planner's choice unless ``strategy`` is given);
        one document per micro-batch where packing is not proved exact (``compiled.packing``); a
        ``PackingError`` where it is proved only for shorter micro-batches (``CompiledModel.packing_for``)."""
        d = self._dispatch(lengths, strategy)
        if not self.compiled.packing.packs:
            return d.one_document_per_micro_batch()
        self.compiled.packing_for(longest_packed_row(d.micro_batches, lengths))  # PackingError past checked_tokens
        return d

    def _dispatch(self, lengths: Sequence[int], strategy: Union[int, Any, None]) -> Dispatch:
        if strategy is None and self.planner is not None:
            # Rank 0 plans and broadcasts: planners may use time budgets, so ranks planning on their
            # own could disagree and then wait on each other forever.
            payload = b""
            if self.rank == 0:
                plan = self.planner.plan(list(lengths))
                payload = plan.dispatch(self.compiled.strategy_index(plan.strategy)).encode()
            return Dispatch.decode(self._broadcast_bytes(payload))
        index = self.compiled.strategy_index(0 if strategy is None else strategy)
        pipelines = self.compiled.strategies[index].pipelines
        return Dispatch(index, default_dispatch(pipelines, lengths, self.micro_batch_tokens))

    def _broadcast_bytes(self, payload: bytes) -> bytes:
        """Rank 0's ``payload`` on every rank."""
        if len(self.world) == 1:
            return payload
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        size = self.comm.broadcast(size, 0, self.world)
        buf = torch.zeros(int(size[0]), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        return bytes(self.comm.broadcast(buf, 0, self.world).tolist())

    # ------------------------------------------------------------------ training
    def step(self, sequences: Sequence[torch.Tensor], strategy: Union[int, Any, None] = None) -> float:
        """One iteration on the global batch ``sequences``; returns the token-mean loss."""
        clock = DeviceClock(self.device)
        start = clock.mark()
        lengths = self._check_sequences(sequences)
        self._check_same_batch(sequences)
        return self._train_on(lengths, sequences, self.dispatch(lengths, strategy), clock, start)

    def _check_same_batch(self, sequences: Sequence[torch.Tensor]) -> None:
        """``InputError`` on every rank unless every rank passed this batch (a 63-bit digest of the
        lengths and tokens, all-gathered): ranks given their own shards would otherwise slice
        different batches by one dispatch and train on them without a word."""
        if len(self.world) == 1:
            return
        h = hashlib.blake2b(digest_size=8)
        h.update(repr([len(s) for s in sequences]).encode())
        for s in sequences:
            h.update(s.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
        digest = int.from_bytes(h.digest(), "little") >> 1  # fits an int64
        mine = torch.tensor([digest], dtype=torch.int64, device=self.device)
        every = [int(d) for d in self.comm.all_gather(mine, self.world).reshape(-1).tolist()]
        differing = next((r for r, d in enumerate(every) if d != every[0]), None)
        if differing is not None:
            raise InputError(
                f"Trainer.step: rank {differing} passed a different batch from rank 0 (digest of the lengths and "
                f"tokens; {len(set(every))} distinct batches over {len(every)} ranks). step() takes the same "
                "global batch on every rank, which the planner splits; to read it once, use "
                "step_data(loader) (rank 0 reads, each rank receives its tokens), or give every rank the "
                "same sampler seed without per-rank sharding (no DistributedSampler)")

    def step_data(self, loader: Any, strategy: Union[int, Any, None] = None) -> Optional[float]:
        """One iteration on ``loader``'s next batch (an ``hgraph.data.TokenLoader``; only rank 0
        reads it, every rank receives just its pipeline's tokens); ``None`` when the data are over.
        ``save`` then stores the loader's position."""
        clock = DeviceClock(self.device)
        start = clock.mark()
        self.data = loader
        lengths = share_lengths(self, lambda: self._checked(loader.next_batch()))
        if lengths is None:
            return None
        d = self.dispatch(lengths, strategy)
        return self._train_on(lengths, scatter_sequences(self, d, lengths), d, clock, start)

    def evaluate(self, batches: Optional[Sequence[Sequence[torch.Tensor]]],
                 strategy: Union[int, Any, None] = None) -> float:
        """Token-mean loss over ``batches`` (held out: the evaluation list of the rank's program, pulls
        and forwards under ``torch.no_grad``; parameters and optimizer untouched), with any compiled
        strategy, interleaved pipelines included. Rank 0's ``batches`` count; other ranks
        may pass ``None`` and receive only their pipeline's tokens."""
        todo = iter(batches or []) if self.rank == 0 else iter(())
        loss_sum, tokens = 0.0, 0
        while True:
            lengths = share_lengths(self, lambda: self._checked(next(todo)))
            if lengths is None:
                break
            d = self.dispatch(lengths, strategy)
            mbs = self._local_micro_batches(d, scatter_sequences(self, d, lengths))
            program = self.compiled.program(d.strategy_index, self.rank)
            loss_sum += run_evaluation(program, self.optimizer.shards, mbs, self.comm)
            tokens += sum(n - 1 for n in lengths)
        if tokens == 0:
            raise InputError("evaluate got no batch; give rank 0 at least one held-out batch")
        total = self.comm.all_reduce(torch.tensor([loss_sum], dtype=torch.float64, device=self.device), self.world)
        return float(total) / tokens

    def _checked(self, sequences: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        self._check_sequences(sequences)
        return sequences

    def _check_sequences(self, sequences: Sequence[torch.Tensor]) -> list[int]:
        """The lengths of a valid batch; ``InputError`` naming the first bad sequence otherwise."""
        if not sequences:
            raise InputError("trainer.step got an empty batch; give at least one sequence")
        lengths = []
        for i, s in enumerate(sequences):
            if not isinstance(s, torch.Tensor) or s.dim() != 1 or s.dtype != torch.long:
                raise InputError(f"sequence {i} must be a 1-D LongTensor of token ids, got {type(s).__name__} "
                                 f"{getattr(s, 'dtype', '')} {tuple(getattr(s, 'shape', ()))}")
            if len(s) < 2:
                raise InputError(f"sequence {i} has {len(s)} token(s); need at least 2 to predict a next token")
            if self.vocab is not None and (int(s.min()) < 0 or int(s.max()) >= self.vocab):
                bad = int(s.min()) if int(s.min()) < 0 else int(s.max())
                raise InputError(f"sequence {i} holds token id {bad}; ids must be in 0..{self.vocab - 1} (the vocabulary)")
            lengths.append(len(s))
        return lengths

    def _local_micro_batches(self, d: Dispatch, sequences: Any) -> list[dict[str, torch.Tensor]]:
        """This rank's packed micro-batches of dispatch ``d`` (``sequences[i]`` for its pipeline's i)."""
        program = self.compiled.program(d.strategy_index, self.rank)
        buffers = {
            ph: self.compiled.traced.buffers()[fqn].to(self.device)
            for ph, fqn in self.compiled.traced.buffer_names.items()
        }
        return rank_micro_batches(sequences, d.micro_batches[program.pipeline], program.groups, self.rank, buffers,
                                  self.compiled.options.sequence_parallel, self.device)

    def _routing_statistics(self, program: Any, routing: Optional[list]) -> dict[str, Any]:
        """Router statistics of an expert-parallel iteration: ``expert_counts`` (rows routed to each
        expert of each MoE layer of this rank's stage, summed over the stage's ranks and micro-batches)
        and ``expert_imbalance`` (the busiest expert group's rows over the mean, slowest layer:
        ``hgraph.planner.experts``); nothing without ep."""
        if routing is None:
            return {}
        layers = sum(1 for sg in program.chunks for n in sg.gm.graph.nodes if n.target is expert_dispatch)
        if not routing or not layers:
            return {}
        counts = torch.stack(routing).view(-1, layers, routing[0].numel()).sum(0).to(self.device)
        counts = self.comm.all_reduce(counts, tuple(program.groups["stage"])).cpu()
        ep = len(program.groups["ep"])
        return {"expert_counts": counts.tolist(), "expert_imbalance": layer_imbalance(counts.tolist(), ep)}

    def _train_on(self, lengths: list[int], sequences: Any, d: Dispatch, clock: DeviceClock, start: Mark) -> float:
        """Run dispatch ``d`` of a batch with ``lengths`` (this rank needs only its pipeline's sequences).
        Times are marks of ``clock`` (``hgraph.runtime.clock``): on CUDA they end when the optimizer's
        kernels have finished, not when they were launched."""
        run_start = clock.mark()  # measured_ms: from here (after planning) to the optimizer's end
        program = self.compiled.program(d.strategy_index, self.rank)
        tokens = sum(l - 1 for l in lengths)
        mbs = self._local_micro_batches(d, sequences)
        if program.overlap is not None:  # dry run of this dispatch's communication order (cached)
            self.compiled.check_overlap(d.strategy_index, [len(m) for m in d.micro_batches])
        timeline = self._comm_timeline
        if timeline is not None:
            timeline.iteration = self.iteration
            first_event = len(timeline.events)
        out = run_iteration(program, self.optimizer.shards, mbs, 1.0 / tokens, timeline=timeline, comm=self.comm,
                            clock=clock)
        routed = self._routing_statistics(program, out.routing if "ep" in program.groups else None)
        # One all-reduce ends the iteration: [loss sum, stop requests, peak memory per rank, exposed
        # communication per rank] (each rank fills its own slots; -1: not measured)
        n = len(self.world)
        stats = torch.zeros(2 + 2 * n, dtype=torch.float64)
        stats[0], stats[1] = out.loss_sum, float(preemption.requested())
        stats[2 + self.rank] = peak_memory_bytes(self.device) if self.measure else -1.0
        if timeline is not None:
            mine = exposed_communication(timeline.events[first_event:]).get(self.rank, {})
            stats[2 + n + self.rank] = 1e3 * mine.get(self.iteration, 0.0)
            if timeline is not self.timeline:
                timeline.clear()
        else:
            stats[2 + n + self.rank] = -1.0
        stats = self.comm.all_reduce(stats.to(self.device), self.world).cpu()
        loss = float(stats[0]) / tokens
        self.stop_requested = bool(stats[1] > 0)
        memory, exposed = stats[2:2 + n].tolist(), stats[2 + n:].tolist()
        if not math.isfinite(loss):
            raise TrainingError(
                f"non-finite loss {loss} at iteration {self.iteration}; optimizer state left unchanged "
                "(lower the learning rate or check the data)"
            )
        grads = {n: None if n in self.frozen else g for n, g in out.grad_shards.items()}
        optimizer_start = clock.mark()
        norm = self.optimizer.global_grad_norm(grads, self.comm, self.world)
        if not math.isfinite(norm):
            raise TrainingError(
                f"non-finite gradient norm {norm} at iteration {self.iteration} (loss {loss}); optimizer state "
                "left unchanged (lower the learning rate, clip gradients or use a wider compute dtype)"
            )
        scale = 1.0
        if self.grad_clip is not None and norm > self.grad_clip:
            scale = self.grad_clip / (norm + 1e-6)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.apply(grads, scale)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        end = clock.mark()
        record = {
            "iteration": self.iteration,
            "loss": loss,
            "strategy": str(self.compiled.strategies[d.strategy_index]),
            "strategy_index": d.strategy_index,
            "grad_norm": norm,
            "predicted_ms": d.predicted_ms,
            "predicted_raw_ms": None if d.prediction is None else d.prediction.total_ms,
            "prediction": None if d.prediction is None else asdict(d.prediction),
            "measured_ms": clock.elapsed_ms(run_start, end),
            "optimizer_ms": clock.elapsed_ms(optimizer_start, end),
            "seconds": clock.elapsed_ms(start, end) / 1e3,
            "lengths": lengths,
            "dispatch": [[list(mb) for mb in p] for p in d.micro_batches],
            "lr": float(lr),
            "peak_memory_bytes": [int(m) for m in memory] if self.measure else None,
            "exposed_comm_ms": None if min(exposed) < 0 else exposed,
            **routed,
        }
        self.history.append(record)
        if self.metrics is not None:
            self.metrics.record(record)
        if self.measure:
            reset_peak_memory(self.device)
        observe = getattr(self.planner, "observe", None)
        if self.rank == 0 and observe is not None and d.prediction is not None:
            observe(d.prediction, record["measured_ms"])  # online correction of the cost model
        log.info("iter %d loss %.4f strategy %s %.3fs predicted %s ms measured %.1f ms", self.iteration, loss,
                 record["strategy"], record["seconds"],
                 "-" if d.predicted_ms is None else f"{d.predicted_ms:.1f}", record["measured_ms"])
        self.iteration += 1
        return loss

    def close(self) -> None:
        """Flush and close the metrics files (rank 0); training on reopens them."""
        if self.metrics is not None:
            self.metrics.close()

    def gather_timeline(self, dst: int = 0) -> list[Any]:
        """Every rank's timeline events on rank ``dst`` (``[]`` elsewhere); call on every rank."""
        if self.timeline is None:
            raise InputError("this Trainer records no timeline; construct it with timeline=True")
        return gather_events(self.timeline.events, self.comm, dst)
