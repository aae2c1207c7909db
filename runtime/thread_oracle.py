"""Single-process execution of a compiled strategy: every rank a thread, collectives in memory.

``compiled.simulate`` (``simulate_strategy`` here) is the correctness oracle of the compiler: it
runs the very programs the runtime runs (Pull, 1F1B stages, Push) on simulated ranks and returns
the token-mean loss and the full gradient of every parameter, to compare with the unmodified model.

How the batch is spread (the runtime's planner decides this in training; here it is fixed):
rows are split across pipelines in order (``torch.tensor_split``), each row is one micro-batch, and
with context parallelism a row is cut into ``2·cp`` chunks, rank ``c`` taking chunks ``c`` and
``2·cp − 1 − c`` (causal load balance).
"""

from __future__ import annotations

from typing import Optional

import torch
from hgraph.runtime.executor import run_iteration
from hgraph.runtime.kernels.comm import Communicator, run_threads
from hgraph.runtime.kernels.context import RankContext, rank_context

from hgraph.core.batch import local_micro_batches, next_token_targets
from hgraph.core.errors import InputError
from hgraph.program.rank_program import CompiledPrograms


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


def micro_batches_for(
    compiled: CompiledPrograms, rank: int, strategy_index: int, rows: list[dict[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """This rank's local view of its pipeline's micro-batches (cp split; buffers added)."""
    program = compiled.program(strategy_index, rank)
    buffers = {ph: compiled.traced.buffers()[fqn] for ph, fqn in compiled.traced.buffer_names.items()}
    return local_micro_batches(rows, program.groups, rank, buffers)


def simulate_strategy(
    compiled: CompiledPrograms,
    index: int,
    input_ids: torch.Tensor,
    targets: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise InputError(f"input_ids must be a [batch, seq] LongTensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
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
    params = compiled.master_parameters()

    def body(comm: Communicator):
        rank = comm.rank
        program = compiled.program(index, rank)
        mbs = micro_batches_for(compiled, rank, index, rows_of_pipeline[program.pipeline])
        with rank_context(RankContext(rank, comm, program.groups)):
            return run_iteration(program, shard_parameters(compiled, rank, params), mbs, 1.0 / tokens)

    outputs = run_threads(body, compiled.world_size)
    loss = torch.tensor(sum(o.loss_sum for o in outputs) / tokens)
    grads = assemble(compiled, [o.grad_shards for o in outputs])
    frozen = {fqn for fqn, p in compiled.traced.params().items() if not p.requires_grad}
    return loss, {fqn: g for fqn, g in grads.items() if fqn not in frozen}  # as torch: no .grad when frozen
