"""Communication ops of compiled local programs, as autograd functions whose backward is the adjoint.

A compiled per-rank program is an fx graph run under ordinary torch autograd; every communication
in it is a call to one of these functions. Each names a logical mesh dim (``"tp"`` or ``"cp"``) and
finds the calling rank's group through ``hgraph.runtime.context.current()``, so one program serves
every rank of a stage, on threads (``ThreadComm``) or processes (``ProcessGroupComm``) alike.

Placements in the names: P partial (pending sum), R replicated, S(d) sharded along dim d in equal,
rank-ordered chunks. The adjoint of a placement change swaps the roles::

    all_reduce      P -> R      backward: identity (R grad is the P grad of every rank)
    reduce_scatter  P -> S(d)   backward: all_gather
    all_gather      S(d) -> R   backward: own chunk, or reduce_scatter when grads are partial
    split           R -> S(d)   backward: all_gather
    all_to_all      S(c) -> S(s) backward: all_to_all S(s) -> S(c)
    grad_all_reduce R -> R      backward: all_reduce (Megatron's "f")

``packed_attention`` is causal attention over packed sequences (optionally context-parallel) and the
two ``vocab_parallel_*`` functions are the Megatron vocab-parallel embedding and cross entropy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from hgraph.errors import ShardingRuleError
from hgraph.runtime.context import RankContext, current


def _even_chunks(x: torch.Tensor, parts: int, dim: int, what: str) -> tuple[torch.Tensor, ...]:
    size = x.shape[dim]
    if size % parts:
        raise ShardingRuleError(
            f"{what}: dim {dim} of size {size} (shape {tuple(x.shape)}) does not split evenly "
            f"into {parts} parts"
        )
    return x.chunk(parts, dim)


def _gather(rc: RankContext, x: torch.Tensor, mesh_dim: str, dim: int) -> torch.Tensor:
    stacked = rc.comm.all_gather(x.contiguous(), rc.group(mesh_dim))
    return torch.cat(stacked.unbind(0), dim=dim)


def _scatter_sum(rc: RankContext, x: torch.Tensor, mesh_dim: str, dim: int) -> torch.Tensor:
    pieces = _even_chunks(x, rc.size(mesh_dim), dim, f"reduce_scatter over '{mesh_dim}'")
    return rc.comm.reduce_scatter(torch.stack(pieces), rc.group(mesh_dim))


def _own_chunk(rc: RankContext, x: torch.Tensor, mesh_dim: str, dim: int) -> torch.Tensor:
    pieces = _even_chunks(x, rc.size(mesh_dim), dim, f"split over '{mesh_dim}'")
    return pieces[rc.index(mesh_dim)].contiguous()


def _exchange(rc: RankContext, x: torch.Tensor, mesh_dim: str, split_dim: int, cat_dim: int) -> torch.Tensor:
    chunks = _even_chunks(x, rc.size(mesh_dim), split_dim, f"all_to_all over '{mesh_dim}'")
    pieces = [p.contiguous() for p in chunks]
    shapes = [tuple(pieces[0].shape)] * len(pieces)
    received = rc.comm.all_to_all(pieces, rc.group(mesh_dim), shapes)
    return torch.cat(received, dim=cat_dim)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh_dim: str) -> torch.Tensor:
        rc = current()
        return rc.comm.all_reduce(x, rc.group(mesh_dim))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh_dim: str, dim: int) -> torch.Tensor:
        ctx.rc, ctx.mesh_dim, ctx.dim = current(), mesh_dim, dim
        return _scatter_sum(ctx.rc, x, mesh_dim, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather(ctx.rc, grad, ctx.mesh_dim, ctx.dim), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh_dim: str, dim: int, grad_partial: bool) -> torch.Tensor:
        ctx.rc, ctx.mesh_dim, ctx.dim, ctx.grad_partial = current(), mesh_dim, dim, grad_partial
        return _gather(ctx.rc, x, mesh_dim, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.grad_partial:
            return _scatter_sum(ctx.rc, grad, ctx.mesh_dim, ctx.dim), None, None, None
        return _own_chunk(ctx.rc, grad, ctx.mesh_dim, ctx.dim), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh_dim: str, dim: int) -> torch.Tensor:
        ctx.rc, ctx.mesh_dim, ctx.dim = current(), mesh_dim, dim
        return _own_chunk(ctx.rc, x, mesh_dim, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather(ctx.rc, grad, ctx.mesh_dim, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh_dim: str, split_dim: int, cat_dim: int) -> torch.Tensor:
        ctx.rc, ctx.mesh_dim, ctx.split_dim, ctx.cat_dim = current(), mesh_dim, split_dim, cat_dim
        return _exchange(ctx.rc, x, mesh_dim, split_dim, cat_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _exchange(ctx.rc, grad, ctx.mesh_dim, ctx.cat_dim, ctx.split_dim), None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh_dim: str) -> torch.Tensor:
        ctx.rc, ctx.mesh_dim = current(), mesh_dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.rc.comm.all_reduce(grad, ctx.rc.group(ctx.mesh_dim)), None


def all_reduce(x: torch.Tensor, mesh_dim: str) -> torch.Tensor:
    """P -> R: sum over the group; backward passes the (replicated) gradient through."""
    return _AllReduce.apply(x, mesh_dim)


def reduce_scatter(x: torch.Tensor, mesh_dim: str, dim: int) -> torch.Tensor:
    """P -> S(dim): sum over the group and keep this rank's chunk; backward all-gathers."""
    return _ReduceScatter.apply(x, mesh_dim, dim)


def all_gather(x: torch.Tensor, mesh_dim: str, dim: int, grad_partial: bool = False) -> torch.Tensor:
    """S(dim) -> R: concatenate every rank's chunk along ``dim``.

    Backward keeps this rank's chunk of the gradient, or — when the consumers produce *partial*
    gradients (Megatron sequence parallelism: the gathered input feeds a column-parallel matmul) —
    reduce-scatters it.
    """
    return _AllGather.apply(x, mesh_dim, dim, grad_partial)


def split(x: torch.Tensor, mesh_dim: str, dim: int) -> torch.Tensor:
    """R -> S(dim): keep this rank's chunk; backward all-gathers."""
    return _Split.apply(x, mesh_dim, dim)


def all_to_all(x: torch.Tensor, mesh_dim: str, split_dim: int, cat_dim: int) -> torch.Tensor:
    """S(cat_dim) -> S(split_dim): send chunk i of ``split_dim`` to rank i, concatenate along ``cat_dim``."""
    return _AllToAll.apply(x, mesh_dim, split_dim, cat_dim)


def grad_all_reduce(x: torch.Tensor, mesh_dim: str) -> torch.Tensor:
    """Identity forward, all-reduce backward: a replicated activation consumed by sharded ops."""
    return _GradAllReduce.apply(x, mesh_dim)


def all_reduce_max(x: torch.Tensor, mesh_dim: str) -> torch.Tensor:
    """Element-wise max over the group (no gradient: used for numerical stabilisers only)."""
    rc = current()
    return rc.comm.all_gather(x.detach().contiguous(), rc.group(mesh_dim)).amax(dim=0)


# ----------------------------------------------------------------------------- vocab parallel
def _vocab_range(rows: int, mesh_dim: str) -> tuple[int, int]:
    start = current().index(mesh_dim) * rows
    return start, start + rows


def vocab_parallel_embedding(ids: torch.Tensor, weight_shard: torch.Tensor, mesh_dim: str) -> torch.Tensor:
    """Lookup in rows ``[index·rows, (index+1)·rows)`` of the vocabulary held here; zero elsewhere.

    Returns the *partial* embedding (the caller all-reduces or reduce-scatters it); the gradient flows
    to the rows of ``weight_shard`` that were looked up.
    """
    start, end = _vocab_range(weight_shard.shape[0], mesh_dim)
    inside = (ids >= start) & (ids < end)
    local = torch.where(inside, ids - start, torch.zeros_like(ids))
    return F.embedding(local, weight_shard).masked_fill(~inside.unsqueeze(-1), 0.0)


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, mesh_dim: str, ignore_index: int = -100
) -> torch.Tensor:
    """Summed cross entropy of logits sharded on the last (vocab) dim; the result is replicated.

    ``loss = Σ_t log Σ_v exp(x_tv − m_t) + m_t − x_t,target`` with ``m_t`` the global max (a constant
    for autograd, so the gradient is exactly softmax − onehot on every shard).
    """
    start, end = _vocab_range(logits_shard.shape[-1], mesh_dim)
    logits = logits_shard.flatten(0, -2)
    targets = targets.flatten()
    if logits.shape[0] != targets.shape[0]:
        raise ShardingRuleError(
            f"vocab_parallel_cross_entropy: {logits.shape[0]} logit rows but {targets.shape[0]} targets"
        )
    peak = all_reduce_max(logits.amax(dim=-1), mesh_dim)
    sum_exp = all_reduce((logits - peak.unsqueeze(-1)).exp().sum(dim=-1), mesh_dim)
    inside = (targets >= start) & (targets < end)
    local = torch.where(inside, targets - start, torch.zeros_like(targets))
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    target_logit = all_reduce(picked, mesh_dim)
    per_token = sum_exp.log() + peak - target_logit
    return per_token.masked_fill(targets == ignore_index, 0.0).sum()


# ----------------------------------------------------------------------------- packed attention
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


def _runs(stream: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Maximal runs of local tokens at consecutive stream indices of one sequence.

    ``stream[i]``: stream index of local token i; ``positions``: the position ids of the whole stream
    (of one row). Returns ``(local_start, local_end, key_start, key_end)``: the run's queries attend
    the keys ``[key_start, key_end)`` of the stream (its sequence up to the run's last token).
    """
    index = torch.arange(len(positions), device=positions.device)
    starts = torch.where(positions == 0, index, torch.zeros_like(index)).cummax(dim=0).values[stream]
    breaks = ((stream[1:] != stream[:-1] + 1) | (starts[1:] != starts[:-1])).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), len(stream)]
    return [(lo, hi, int(starts[lo]), int(stream[hi - 1]) + 1) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _attend_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list, scale: float | None, enable_gqa: bool
) -> torch.Tensor:
    """q ``[b, hq, s_local, d]`` against the stream's k/v ``[b, hkv, S, d]``, run by run."""
    outputs = []
    for lo, hi, key_lo, key_hi in runs:
        q_run, k_run, v_run = q[:, :, lo:hi], k[:, :, key_lo:key_hi], v[:, :, key_lo:key_hi]
        keys, queries = key_hi - key_lo, hi - lo
        if keys == queries:  # the run starts its sequence: plain causal attention
            mask, causal = None, True
        else:  # the queries are the last `queries` of the keys: bottom-right aligned causal mask
            index = torch.arange(keys, device=q.device)
            mask, causal = index <= index[keys - queries :, None], False
        outputs.append(F.scaled_dot_product_attention(
            q_run, k_run, v_run, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=enable_gqa
        ))
    return torch.cat(outputs, dim=2)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    scale: float | None = None,
    cp: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention inside each packed sequence; a sequence starts where ``position_ids == 0``.

    q ``[b, hq, s, d]``, k/v ``[b, hkv, s, d]``, position_ids ``[b, s]``. Attention never crosses a
    sequence boundary, and each sequence is computed on its own (cost Σ lᵢ², never a (Σ lᵢ)² mask).
    With ``cp=True`` the sequence dim is split over the ``"cp"`` group with the load-balanced layout
    of ``load_balance_indices``; K, V and positions are gathered (dK, dV reduce-scattered back).
    On fake tensors (shape propagation) it only computes the output's shape and dtype.
    """
    if is_fake(q):  # shape propagation (FakeTensorProp, export): same shapes, no data-dependent loop
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if position_ids.shape != (q.shape[0], q.shape[2]):
        raise ShardingRuleError(
            f"packed_attention: position_ids {tuple(position_ids.shape)} do not match q {tuple(q.shape)} "
            "(need [batch, seq])"
        )
    if cp:
        rc = current()
        size, index = rc.size("cp"), rc.index("cp")
        k = all_gather(k, "cp", 2, grad_partial=True)
        v = all_gather(v, "cp", 2, grad_partial=True)
        gathered = _gather(rc, position_ids.detach(), "cp", 1)
        total = gathered.shape[1]
        layout = torch.cat([load_balance_indices(total, size, r) for r in range(size)])
        order = torch.argsort(layout).to(q.device)  # gathered slot of each stream index
        k, v, stream_positions = k[:, :, order], v[:, :, order], gathered[:, order]
        local_stream = load_balance_indices(total, size, index).to(q.device)
    else:
        stream_positions = position_ids
        local_stream = torch.arange(q.shape[2], device=q.device)
    rows = range(q.shape[0])
    if all(torch.equal(stream_positions[0], stream_positions[b]) for b in rows):
        return _attend_row(q, k, v, _runs(local_stream, stream_positions[0]), scale, enable_gqa)
    return torch.cat(
        [
            _attend_row(q[b : b + 1], k[b : b + 1], v[b : b + 1], _runs(local_stream, stream_positions[b]),
                        scale, enable_gqa)
            for b in rows
        ],
        dim=0,
    )
