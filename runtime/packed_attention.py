"""Causal attention over packed sequences: ``hgraph.packed_attention`` and its backward as custom ops.

A sequence starts wherever ``position_ids == 0`` and attention never crosses that boundary (cost
Σ lᵢ²). Variants, each a keyword: ``window`` (sliding window), ``softcap`` (Gemma 2 logit capping),
``alibi`` (per-head ALiBi slopes: the score of query i and key j gets ``−slopeₕ·(i − j)``, i and j in
the same sequence, so it never spans the packed row). The backward op (``hgraph.packed_attention_backward``) recomputes the forward; the kernel per
device and construct comes from ``runtime/attention_kernels.py`` (per-sequence SDPA on CPU, varlen or
FlexAttention on CUDA). With context parallelism the K/V gathers are ``hgraph.all_gather`` calls
outside the op. ``own_kv_heads`` picks the key/value head a rank's query heads read when tp exceeds
the kv heads.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from hgraph.batch import load_balance_indices
from hgraph.errors import ShardingRuleError
from hgraph.runtime import attention_kernels
from hgraph.runtime.collectives import active_context, all_gather, entered
from hgraph.runtime.context import current

Tensor = torch.Tensor


def own_kv_heads(kv: Tensor, mesh_dim: str) -> Tensor:
    """The key/value head (dim 1) the query heads of this rank read, when tp exceeds the kv heads.

    Query heads are split contiguously over ``mesh_dim``; with ``kv`` heads and ``tp`` ranks
    (``tp % kv == 0``) rank ``r`` reads head ``r·kv // tp``. ``kv`` is replicated, so the gradient
    of each rank is partial and summed by the caller's adjoint.
    """
    rc = current()
    size, index = rc.size(mesh_dim), rc.index(mesh_dim)
    return kv.narrow(1, index * kv.shape[1] // size, 1)


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list, scale: float | None, enable_gqa: bool,
    window: int | None = None, softcap: float | None = None, alibi: Tensor | None = None,
) -> torch.Tensor:
    """q ``[b, hq, s_local, d]`` against the stream's k/v ``[b, hkv, S, d]``, run by run.

    A run's queries are the last ``hi - lo`` of its keys; with ``window`` a query at stream index i
    sees keys j with ``i - window < j <= i`` only, so keys before the first query's window are cut.
    With ``alibi`` (``[hq]`` slopes) the scores get ``−slopeₕ·(i − j)``: i − j is the same in the
    run's key range as in the sequence, since a run never crosses a sequence start.
    """
    outputs = []
    for lo, hi, key_lo, key_hi in runs:
        queries = hi - lo
        if window is not None:
            key_lo = max(key_lo, key_hi - queries - window + 1)
        q_run, k_run, v_run = q[:, :, lo:hi], k[:, :, key_lo:key_hi], v[:, :, key_lo:key_hi]
        keys = key_hi - key_lo
        key_index = torch.arange(keys, device=q.device)
        query_index = key_index[keys - queries :, None]  # bottom-right aligned: the queries end the keys
        mask = key_index <= query_index
        if window is not None:
            mask = mask & (key_index > query_index - window)
        bias = None
        if alibi is not None:
            distance = (query_index - key_index).to(torch.float32)  # i - j
            bias = (-alibi.to(torch.float32)[:, None, None] * distance)[None].masked_fill(~mask, float("-inf"))
        if softcap is not None:
            outputs.append(_softcapped_attention(q_run, k_run, v_run, mask, scale, softcap, bias))
            continue
        plain_causal = keys == queries and (window is None or window >= keys) and bias is None
        outputs.append(F.scaled_dot_product_attention(
            q_run, k_run, v_run, attn_mask=None if plain_causal else (mask if bias is None else bias.to(q.dtype)),
            is_causal=plain_causal, scale=scale, enable_gqa=enable_gqa,
        ))
    return torch.cat(outputs, dim=2)


def _softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None, softcap: float, bias: Tensor | None = None
) -> Tensor:
    """Attention with Gemma-2 logit soft-capping: ``scores = softcap · tanh(q·kᵀ·scale / softcap)``
    (then ``+ bias`` if given)."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def _packed_attention_local(
    q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool, enable_gqa: bool,
    window: Optional[int] = None, softcap: Optional[float] = None, alibi: Optional[Tensor] = None,
) -> Tensor:
    """Attention of the local queries; with ``cp`` k, v and positions are the cp-gathered ones."""
    if cp:
        rc = current()
        size, index = rc.size("cp"), rc.index("cp")
        total = position_ids.shape[1]
        layout = torch.cat([load_balance_indices(total, size, r) for r in range(size)])
        order = torch.argsort(layout).to(q.device)  # gathered slot of each stream index
        k, v, stream_positions = k[:, :, order], v[:, :, order], position_ids[:, order]
        local_stream = load_balance_indices(total, size, index).to(q.device)
    else:
        stream_positions = position_ids
        local_stream = torch.arange(q.shape[2], device=q.device)
    kernel = attention_kernels.choose_kernel(q.device, q.dtype, cp=cp, needs_grad=torch.is_grad_enabled(),
                                             alibi=alibi is not None)
    if kernel == "varlen":
        return attention_kernels.varlen(q, k, v, stream_positions, scale, enable_gqa)
    if kernel == "flex":
        return attention_kernels.flex(q, k, v, stream_positions, local_stream, scale, enable_gqa, alibi)
    rows = range(q.shape[0])
    if all(torch.equal(stream_positions[0], stream_positions[b]) for b in rows):
        return _attend_row(q, k, v, _runs(local_stream, stream_positions[0]), scale, enable_gqa, window, softcap, alibi)
    return torch.cat(
        [
            _attend_row(q[b : b + 1], k[b : b + 1], v[b : b + 1], _runs(local_stream, stream_positions[b]),
                        scale, enable_gqa, window, softcap, alibi)
            for b in rows
        ],
        dim=0,
    )


@contextlib.contextmanager
def _autograd_inside_op() -> Iterator[None]:
    """Let autograd record again inside a custom op's kernel (the dispatcher excludes it there)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    autograd = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded - autograd):
        with torch.enable_grad():
            yield


@torch.library.custom_op("hgraph::packed_attention", mutates_args=())
def _packed_attention(
    q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool, enable_gqa: bool,
    window: Optional[int] = None, softcap: Optional[float] = None, alibi: Optional[Tensor] = None,
) -> Tensor:
    with torch.no_grad():
        return _packed_attention_local(q, k, v, position_ids, scale, cp, enable_gqa, window, softcap, alibi).contiguous()


@torch.library.custom_op("hgraph::packed_attention_backward", mutates_args=())
def _packed_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool,
    enable_gqa: bool, window: Optional[int] = None, softcap: Optional[float] = None, alibi: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with _autograd_inside_op():
        out = _packed_attention_local(*leaves, position_ids, scale, cp, enable_gqa, window, softcap, alibi)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_packed_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool, enable_gqa: bool,
      window: Optional[int] = None, softcap: Optional[float] = None, alibi: Optional[Tensor] = None) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@_packed_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool,
      enable_gqa: bool, window: Optional[int] = None, softcap: Optional[float] = None, alibi: Optional[Tensor] = None,
      ) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_attention(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = active_context()
    ctx.save_for_backward(*inputs[:4])
    ctx.args = inputs[4:]


def _attention_backward(ctx: Any, grad: Tensor) -> tuple:
    with entered(ctx.rc):
        dq, dk, dv = torch.ops.hgraph.packed_attention_backward(grad, *ctx.saved_tensors, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


_packed_attention.register_autograd(_attention_backward, setup_context=_save_attention)


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    position_ids: Tensor,
    *,
    scale: float | None = None,
    cp: bool = False,
    enable_gqa: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    alibi: Tensor | None = None,
) -> Tensor:
    """Causal attention inside each packed sequence; a sequence starts where ``position_ids == 0``.

    ``window``: sliding-window attention (a query sees itself and the ``window - 1`` keys before it,
    Mistral's ``sliding_window``); ``softcap``: logits capped as ``softcap · tanh(logits / softcap)``
    (Gemma 2); ``alibi``: ``[hq]`` ALiBi slopes, the score of query i and key j of one sequence
    getting ``−slopeₕ·(i − j)`` (Bloom, MPT; under tp each rank holds its query heads' slopes).

    q ``[b, hq, s, d]``, k/v ``[b, hkv, s, d]``, position_ids ``[b, s]``. Attention never crosses a
    sequence boundary, and each sequence is computed on its own (cost Σ lᵢ², never a (Σ lᵢ)² mask).
    With ``cp=True`` the sequence dim is split over the ``"cp"`` group with the load-balanced layout
    of ``load_balance_indices``; K, V and positions are gathered here (``hgraph.all_gather``; dK, dV
    are reduce-scattered back by its adjoint). On fake tensors without a rank context (shape
    propagation of the global graph) only the output's shape and dtype are computed.
    """
    shape_only = is_fake(q) and active_context() is None
    if not is_fake(q) and position_ids.shape != (q.shape[0], q.shape[2]):
        raise ShardingRuleError(
            f"packed_attention: position_ids {tuple(position_ids.shape)} do not match q {tuple(q.shape)} "
            "(need [batch, seq])"
        )
    if cp and not shape_only:
        k = all_gather(k, "cp", 2, grad_partial=True)
        v = all_gather(v, "cp", 2, grad_partial=True)
        position_ids = torch.ops.hgraph.all_gather(position_ids.detach(), "cp", 1, False)
    if alibi is not None and not is_fake(q) and alibi.shape != (q.shape[1],):
        raise ShardingRuleError(
            f"packed_attention: {tuple(alibi.shape)} ALiBi slopes for {q.shape[1]} query heads (need one per head)"
        )
    return torch.ops.hgraph.packed_attention(
        q, k, v, position_ids, scale, cp and not shape_only, enable_gqa, window, softcap, alibi
    )
