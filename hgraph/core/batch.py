"""Batches as the programs see them: packed sequences, next-token targets, cp chunks, a rank's share.

One micro-batch is ``{"input_ids", "position_ids", "targets"}``, each ``[1, tokens]``: sequences are
concatenated, positions restart at 0 where a sequence starts (packed attention never crosses that
boundary) and each sequence's last token predicts nothing (target ``-100``). Under context
parallelism every rank of a cp group holds ``2·cp`` chunks' worth of the stream: chunks ``c`` and
``2·cp − 1 − c`` (causal load balance). The trainer and the thread-rank oracle (``hgraph.runtime.thread_oracle``)
build a rank's micro-batches with one function, ``rank_micro_batches``; the traced backward
(``hgraph.passes.backward``) and the profiler build theirs here too, so all feed programs the same way.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch

from hgraph.errors import ShardingRuleError

MicroBatch = dict[str, torch.Tensor]

DEFAULT_MICRO_BATCH_TOKENS = 4096
"""Token budget of one packed micro-batch when no planner decides (``Trainer``, ``compiled.simulate``)."""


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets of a causal LM: each position predicts the next token; the last predicts nothing."""
    targets = torch.full_like(input_ids, -100)
    targets[..., :-1] = input_ids[..., 1:]
    return targets


def load_balance_indices(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """Stream positions held by CP rank ``index``: chunks ``index`` and ``2·cp−1−index`` of ``2·cp``.

    Pairing an early chunk with a late one gives every rank the same causal-attention work.
    """
    if seq_len % (2 * cp):
        raise ShardingRuleError(
            f"context parallelism over {cp} ranks needs a sequence length divisible by {2 * cp}, "
            f"got {seq_len}"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(index * chunk, (index + 1) * chunk)
    second = torch.arange((2 * cp - 1 - index) * chunk, (2 * cp - index) * chunk)
    return torch.cat([first, second])


def cp_chunk_indices(length: int, cp: int, index: int) -> torch.Tensor:
    """Token positions CP rank ``index`` holds (all of them without context parallelism)."""
    return torch.arange(length) if cp == 1 else load_balance_indices(length, cp, index)


def pack_micro_batch(sequences: Sequence[torch.Tensor], align: int = 1) -> MicroBatch:
    """Concatenate sequences into one ``[1, tokens]`` micro-batch: positions restart per sequence
    and each sequence's last token predicts nothing; padded (as its own ignored segment) to ``align``."""
    ids, pos, tgt = [], [], []
    for s in sequences:
        s = s.reshape(-1).to(torch.long)
        ids.append(s)
        pos.append(torch.arange(len(s)))
        tgt.append(next_token_targets(s))
    total = sum(len(s) for s in ids)
    pad = (-total) % align
    if pad:
        ids.append(torch.zeros(pad, dtype=torch.long))
        pos.append(torch.arange(pad))
        tgt.append(torch.full((pad,), -100, dtype=torch.long))
    return {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat(pos)[None],
        "targets": torch.cat(tgt)[None],
    }


def micro_batch_align(groups: Mapping[str, Sequence[int]], sequence_parallel: bool = False) -> int:
    """Token multiple a packed micro-batch needs on a rank with these ``groups``: ``2·cp`` chunks
    under context parallelism, and a multiple of tp under sequence parallelism."""
    cp = len(groups.get("cp", (0,)))
    align = 2 * cp if cp > 1 else 1
    if sequence_parallel:
        align = math.lcm(align, len(groups.get("tp", (0,))))
    return align


def local_micro_batches(
    rows: Sequence[MicroBatch],
    groups: Mapping[str, Sequence[int]],
    rank: int,
    buffers: Mapping[str, torch.Tensor],
    device: Optional[torch.device] = None,
) -> list[MicroBatch]:
    """``rank``'s local view of its pipeline's micro-batches ``rows``: its cp chunks of every tensor,
    plus the model's ``buffers`` (placeholder name -> tensor), moved to ``device`` if given."""
    cp_group = tuple(groups.get("cp", (rank,)))
    out = []
    for row in rows:
        idx = cp_chunk_indices(row["input_ids"].shape[-1], len(cp_group), cp_group.index(rank))
        mb = {k: (v[..., idx] if device is None else v[..., idx].to(device)) for k, v in row.items()}
        mb.update(buffers)
        out.append(mb)
    return out


def rank_micro_batches(
    sequences: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    micro_batches: Sequence[Sequence[int]],
    groups: Mapping[str, Sequence[int]],
    rank: int,
    buffers: Mapping[str, torch.Tensor],
    sequence_parallel: bool = False,
    device: Optional[torch.device] = None,
) -> list[MicroBatch]:
    """``rank``'s micro-batches: each of its pipeline's ``micro_batches`` (indices into ``sequences``)
    packed (``pack_micro_batch``, aligned for cp and sequence parallelism), cut to the rank's cp chunks,
    with the model's ``buffers``. The one path from documents to program inputs, for the ``Trainer``
    and the packed oracle (``compiled.simulate`` of a list of documents) alike."""
    align = micro_batch_align(groups, sequence_parallel)
    rows = [pack_micro_batch([sequences[i].cpu() for i in mb], align) for mb in micro_batches]
    return local_micro_batches(rows, groups, rank, buffers, device)


def one_document_per_micro_batch(micro_batches: Sequence[Sequence[Sequence[int]]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per pipeline, every micro-batch split into one micro-batch per document (same order): how a
    model whose packing is not proved exact trains (``hgraph.compiler.packing_proof``)."""
    return tuple(tuple((i,) for mb in pipeline for i in mb) for pipeline in micro_batches)


def longest_packed_row(micro_batches: Sequence[Sequence[Sequence[int]]], lengths: Sequence[int]) -> int:
    """Tokens in the longest micro-batch holding more than one document (0 if none): the row length
    packing must be exact for (``CompiledModel.packing_for``)."""
    return max((sum(lengths[i] for i in mb) for pipeline in micro_batches for mb in pipeline if len(mb) > 1), default=0)
