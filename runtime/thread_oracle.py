"""Single-process execution of a compiled strategy: every rank a thread, collectives in memory.

``compiled.simulate`` (``simulate_strategy`` here) is the correctness oracle of the compiler: it
runs the very programs the runtime runs (Pull, 1F1B stages, Push) on simulated ranks and returns
the token-mean loss and the full gradient of every parameter, to compare with the unmodified model.

Two ways to give the batch:

* **documents** (a list of 1-D LongTensors of any lengths): spread and packed exactly as
  ``Trainer.step`` does without a planner — ``default_dispatch`` over the pipelines, several documents
  per micro-batch (``micro_batch_tokens``), positions restarting at every document, padded and cut
  into ``2·cp`` load-balanced chunks under context parallelism (``hgraph.core.batch.rank_micro_batches``);
  one document per micro-batch where packing is not proved exact (``compiled.packing``).
  Compare with the unmodified model run on each document alone: that is what packed training claims.
* a rectangular ``input_ids`` ``[batch, seq]``: rows split across pipelines in order
  (``torch.tensor_split``), each row one micro-batch (cut into cp chunks, not packed).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from hgraph.core.batch import (
    DEFAULT_MICRO_BATCH_TOKENS, local_micro_batches, longest_packed_row, next_token_targets, one_document_per_micro_batch,
    rank_micro_batches,
)
from hgraph.errors import InputError
from hgraph.planner.dispatch import default_dispatch
from hgraph.program.rank_program import CompiledPrograms
from hgraph.runtime.executor import run_iteration
from hgraph.runtime.kernels.comm import Communicator
from hgraph.runtime.kernels.thread_comm import run_threads


def shard_parameters(compiled: CompiledPrograms, rank: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's fp32 optimizer-layout shards of full parameters."""
    return {
        fqn: layout.local_of(params[fqn].detach().to(torch.float32), rank)
        for fqn, layout in compiled.optimizer_layouts.items()
    }


def assemble(compiled: CompiledPrograms, shards: list[dict[str, Optional[torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's optimizer-layout shards."""
    out = {}
    for fqn, layout in compiled.optimizer_layouts.items():
        full = torch.zeros(layout.shape, dtype=torch.float32)
        for rank in range(compiled.world_size):
            shard = shards[rank][fqn]
            if shard is not None:
                layout.put_local(full, rank, shard)
        out[fqn] = full
    return out


def _buffers(compiled: CompiledPrograms) -> dict[str, torch.Tensor]:
    return {ph: compiled.traced.buffers()[fqn] for ph, fqn in compiled.traced.buffer_names.items()}


def micro_batches_for(
    compiled: CompiledPrograms, rank: int, strategy_index: int, rows: list[dict[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """This rank's local view of its pipeline's micro-batches (cp split; buffers added)."""
    program = compiled.program(strategy_index, rank)
    return local_micro_batches(rows, program.groups, rank, _buffers(compiled))


Documents = Sequence[torch.Tensor]


def simulate_strategy(
    compiled: CompiledPrograms,
    index: int,
    input_ids: Union[torch.Tensor, Documents],
    targets: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean loss and full gradients of strategy ``index`` on ``input_ids``: a list of documents
    (packed as training packs them) or a rectangular ``[batch, seq]`` tensor (module docstring)."""
    if isinstance(input_ids, (list, tuple)):
        if targets is not None or position_ids is not None:
            raise InputError("simulate of a list of documents takes no targets or position_ids: each document "
                             "predicts its own next tokens and its positions restart at 0, as in training")
        return _simulate_documents(compiled, index, input_ids, micro_batch_tokens)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise InputError(f"input_ids must be a [batch, seq] LongTensor or a list of 1-D LongTensor documents, got {got}")
    if targets is None:
        targets = next_token_targets(input_ids)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    tokens = int((targets != -100).sum())
    if tokens == 0:
        raise InputError("the batch has no target tokens; nothing to train on")
    strategy = compiled.strategies[index]
    parts = torch.tensor_split(torch.arange(input_ids.shape[0]), len(strategy.pipelines))
    rows_of_pipeline = [
        [
            {"input_ids": input_ids[r : r + 1], "position_ids": position_ids[r : r + 1], "targets": targets[r : r + 1]}
            for r in part.tolist()
        ]
        for part in parts
    ]

    def micro_batches(rank: int, pipeline: int) -> list[dict[str, torch.Tensor]]:
        return micro_batches_for(compiled, rank, index, rows_of_pipeline[pipeline])

    return _run(compiled, index, micro_batches, tokens)


def _simulate_documents(
    compiled: CompiledPrograms, index: int, documents: Documents, micro_batch_tokens: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Trainer's path without a planner: ``default_dispatch``, then ``rank_micro_batches``."""
    for i, doc in enumerate(documents):
        if not isinstance(doc, torch.Tensor) or doc.dim() != 1 or doc.dtype != torch.long or len(doc) < 2:
            got = f"{doc.dtype} {tuple(doc.shape)}" if isinstance(doc, torch.Tensor) else type(doc).__name__
            raise InputError(f"document {i} must be a 1-D LongTensor of at least 2 token ids, got {got}")
    if not documents:
        raise InputError("simulate got an empty list of documents; give at least one")
    lengths = [len(d) for d in documents]
    strategy = compiled.strategies[index]
    dispatch = default_dispatch(strategy.pipelines, lengths, micro_batch_tokens)
    if not compiled.packing.packs:  # as the Trainer: packing not proved exact
        dispatch = one_document_per_micro_batch(dispatch)
    else:  # as the Trainer: packing proved for rows this long (or PackingError)
        compiled.packing_for(longest_packed_row(dispatch, lengths))
    buffers = _buffers(compiled)

    def micro_batches(rank: int, pipeline: int) -> list[dict[str, torch.Tensor]]:
        program = compiled.program(index, rank)
        return rank_micro_batches(documents, dispatch[pipeline], program.groups, rank, buffers,
                                  compiled.options.sequence_parallel)

    return _run(compiled, index, micro_batches, sum(n - 1 for n in lengths))


def _run(compiled: CompiledPrograms, index: int, micro_batches, tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every rank's iteration on its ``micro_batches(rank, pipeline)``, as threads; loss and full grads."""
    params = compiled.master_parameters()

    def body(comm: Communicator):
        rank = comm.rank
        program = compiled.program(index, rank)
        mbs = micro_batches(rank, program.pipeline)
        return run_iteration(program, shard_parameters(compiled, rank, params), mbs, 1.0 / tokens, comm=comm)

    outputs = run_threads(body, compiled.world_size)
    loss = torch.tensor(sum(o.loss_sum for o in outputs) / tokens)
    grads = assemble(compiled, [o.grad_shards for o in outputs])
    frozen = {fqn for fqn, p in compiled.traced.params().items() if not p.requires_grad}
    return loss, {fqn: g for fqn, g in grads.items() if fqn not in frozen}  # as torch: no .grad when frozen
