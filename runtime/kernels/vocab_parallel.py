"""Megatron's vocab-parallel embedding and cross entropy: aten ops composed with the collectives of
``hgraph.runtime.kernels.collectives``, so their adjoints come from those ops' registered backwards."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hgraph.errors import ShardingRuleError
from hgraph.runtime.kernels.collectives import all_reduce, all_reduce_max
from hgraph.runtime.kernels.context import RankContext, required


def _vocab_range(rows: int, mesh_dim: str, rc: Optional[RankContext], what: str) -> tuple[int, int]:
    start = required(rc, what).index(mesh_dim) * rows
    return start, start + rows


def vocab_parallel_embedding(
    ids: torch.Tensor, weight_shard: torch.Tensor, mesh_dim: str, padding_idx: int | None = None, *,
    rank_context: Optional[RankContext] = None,
) -> torch.Tensor:
    """Lookup in rows ``[index·rows, (index+1)·rows)`` of the vocabulary held here; zero elsewhere.

    Returns the *partial* embedding (the caller all-reduces or reduce-scatters it); the gradient flows
    to the rows of ``weight_shard`` that were looked up. ``padding_idx`` (a global row, as in
    ``nn.Embedding``) gets no gradient: only the rank holding that row masks it.
    """
    start, end = _vocab_range(weight_shard.shape[0], mesh_dim, rank_context, "vocab_parallel_embedding")
    inside = (ids >= start) & (ids < end)
    local = torch.where(inside, ids - start, torch.zeros_like(ids))
    local_padding = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None
    return F.embedding(local, weight_shard, padding_idx=local_padding).masked_fill(~inside.unsqueeze(-1), 0.0)


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, mesh_dim: str, ignore_index: int = -100, *,
    rank_context: Optional[RankContext] = None,
) -> torch.Tensor:
    """Summed cross entropy of logits sharded on the last (vocab) dim; the result is replicated.

    ``loss = Σ_t log Σ_v exp(x_tv − m_t) + m_t − x_t,target`` with ``m_t`` the global max (a constant
    for autograd, so the gradient is exactly softmax − onehot on every shard).
    """
    start, end = _vocab_range(logits_shard.shape[-1], mesh_dim, rank_context, "vocab_parallel_cross_entropy")
    logits = logits_shard.flatten(0, -2)
    targets = targets.flatten()
    if logits.shape[0] != targets.shape[0]:
        raise ShardingRuleError(
            f"vocab_parallel_cross_entropy: {logits.shape[0]} logit rows but {targets.shape[0]} targets"
        )
    peak = all_reduce_max(logits.amax(dim=-1), mesh_dim, rank_context=rank_context)
    sum_exp = all_reduce((logits - peak.unsqueeze(-1)).exp().sum(dim=-1), mesh_dim, rank_context=rank_context)
    inside = (targets >= start) & (targets < end)
    local = torch.where(inside, targets - start, torch.zeros_like(targets))
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    target_logit = all_reduce(picked, mesh_dim, rank_context=rank_context)
    per_token = sum_exp.log() + peak - target_logit
    return per_token.masked_fill(targets == ignore_index, 0.0).sum()
