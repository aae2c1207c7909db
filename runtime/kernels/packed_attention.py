"""Causal attention over packed sequences: ``hgraph.packed_attention`` and its backward as custom ops.

A sequence starts wherever ``position_ids == 0`` and attention never crosses that boundary (cost
Σ lᵢ²). The backward op (``hgraph.packed_attention_backward``) recomputes the forward; the kernel per
device, construct and attention variant (window, soft-cap, chunk, sinks, ALiBi: ``AttentionVariant``) comes from
``runtime/kernels/attention_kernels.py`` (per-sequence SDPA on CPU, varlen or FlexAttention on CUDA). With context parallelism the K/V gathers are ``hgraph.all_gather`` calls
outside the op. ``own_kv_heads`` picks the key/value head a rank's query heads read when tp exceeds
the kv heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from hgraph.core.batch import load_balance_indices
from hgraph.errors import ShardingRuleError
from hgraph.runtime.kernels import attention_kernels
from hgraph.runtime.kernels.attention_kernels import VARIANT_SCHEMA, AttentionVariant
from hgraph.runtime.kernels.collectives import all_gather
from hgraph.runtime.kernels.context import RankContext, required
from hgraph.runtime.kernels.custom_op_autograd import autograd_inside_op

Tensor = torch.Tensor


def own_kv_heads(kv: Tensor, mesh_dim: str, *, rank_context: Optional[RankContext] = None) -> Tensor:
    """The key/value head (dim 1) the query heads of this rank read, when tp exceeds the kv heads.

    Query heads are split contiguously over ``mesh_dim``; with ``kv`` heads and ``tp`` ranks
    (``tp % kv == 0``) rank ``r`` reads head ``r·kv // tp``. ``kv`` is replicated, so the gradient
    of each rank is partial and summed by the caller's adjoint.
    """
    rc = required(rank_context, "own_kv_heads")
    size, index = rc.size(mesh_dim), rc.index(mesh_dim)
    return kv.narrow(1, index * kv.shape[1] // size, 1)


def _packed_attention_local(
    q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool, size: int, index: int,
    enable_gqa: bool, variant: AttentionVariant,
) -> Tensor:
    """Attention of the local queries; with ``cp`` k, v and positions are the cp-gathered ones, and this
    rank is ``index`` of the ``size`` cp ranks."""
    if cp:
        total = position_ids.shape[1]
        layout = torch.cat([load_balance_indices(total, size, r) for r in range(size)])
        order = torch.argsort(layout).to(q.device)  # gathered slot of each stream index
        k, v, stream_positions = k[:, :, order], v[:, :, order], position_ids[:, order]
        local_stream = load_balance_indices(total, size, index).to(q.device)
    else:
        stream_positions = position_ids
        local_stream = torch.arange(q.shape[2], device=q.device)
    kernel = attention_kernels.choose_kernel(q.device, q.dtype, cp=cp, needs_grad=torch.is_grad_enabled(),
                                             variant=variant)
    return attention_kernels.attend(kernel, q, k, v, stream_positions, local_stream, scale, enable_gqa, variant)


# The ops take the variant's fields as trailing arguments (their schema comes from AttentionVariant,
# so a new variant field needs no change here).
# Under ``cp`` the op is told its rank's place in the cp group (``cp_size``, ``cp_index``).
_HEAD = "Tensor q, Tensor k, Tensor v, Tensor position_ids, float? scale, bool cp, int cp_size, int cp_index, bool enable_gqa"
torch.library.define("hgraph::packed_attention", f"({_HEAD}, {VARIANT_SCHEMA}) -> Tensor")
torch.library.define(  # dq, dk, dv and the gradients of the variant's tensor fields (sinks) in field order
    "hgraph::packed_attention_backward", f"(Tensor grad, {_HEAD}, {VARIANT_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor[])"
)


@torch.library.impl("hgraph::packed_attention", "CompositeExplicitAutograd")
def _packed_attention(
    q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool, cp_size: int,
    cp_index: int, enable_gqa: bool, *variant: Any,
) -> Tensor:
    with torch.no_grad():
        return _packed_attention_local(
            q, k, v, position_ids, scale, cp, cp_size, cp_index, enable_gqa, AttentionVariant(*variant)
        ).contiguous()


@torch.library.impl("hgraph::packed_attention_backward", "CompositeExplicitAutograd")
def _packed_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool,
    cp_size: int, cp_index: int, enable_gqa: bool, *variant: Any,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    learned = {name: getattr(AttentionVariant(*variant), name).detach().requires_grad_(True)
               for name in AttentionVariant(*variant).tensors()}
    with autograd_inside_op():
        chosen = dataclasses.replace(AttentionVariant(*variant), **learned)
        out = _packed_attention_local(*leaves, position_ids, scale, cp, cp_size, cp_index, enable_gqa, chosen)
        dq, dk, dv, *rest = torch.autograd.grad(out, [*leaves, *learned.values()], grad, allow_unused=True)
    rest = [torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(rest, learned.values())]
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), rest


@torch.library.register_fake("hgraph::packed_attention")
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.register_fake("hgraph::packed_attention_backward")
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    variant = AttentionVariant(*args[6:])
    learned = [getattr(variant, name).new_empty(getattr(variant, name).shape) for name in variant.tensors()]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), learned


def _save_attention(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.args = inputs[4:]


def _attention_backward(ctx: Any, grad: Tensor) -> tuple:
    dq, dk, dv, learned = torch.ops.hgraph.packed_attention_backward(grad, *ctx.saved_tensors, *ctx.args)
    grads = dict(zip(AttentionVariant(*ctx.args[5:]).tensors(), learned))  # the learned fields' gradients
    return (dq, dk, dv, None, None, None, None, None, None,
            *(grads.get(f.name) for f in dataclasses.fields(AttentionVariant)))


torch.library.register_autograd("hgraph::packed_attention", _attention_backward, setup_context=_save_attention)


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    position_ids: Tensor,
    *,
    scale: float | None = None,
    cp: bool = False,
    enable_gqa: bool = False,
    rank_context: Optional[RankContext] = None,
    **variant: Any,
) -> Tensor:
    """Causal attention inside each packed sequence; a sequence starts where ``position_ids == 0``.

    ``variant``: the fields of ``AttentionVariant`` — ``window`` (sliding-window attention: a query
    sees itself and the ``window - 1`` keys before it, Mistral's ``sliding_window``), ``softcap``
    (logits capped as ``softcap · tanh(logits / softcap)``, Gemma 2), ``chunk`` (a query sees the keys
    of its own chunk of the document, Llama 4), ``sinks`` (``[hq]`` learned logits joining each softmax,
    gpt-oss; their gradient is returned), ``alibi`` (``[hq]`` slopes: the
    score of query i and key j of one document gets ``−slopeₕ·(i − j)``, Bloom and MPT; under tp each
    rank holds its query heads' slopes). Every kernel implements them, or the dispatch avoids it.

    q ``[b, hq, s, d]``, k/v ``[b, hkv, s, d]``, position_ids ``[b, s]``. Attention never crosses a
    sequence boundary, and each sequence is computed on its own (cost Σ lᵢ², never a (Σ lᵢ)² mask).
    With ``cp=True`` the sequence dim is split over the ``"cp"`` group with the load-balanced layout
    of ``load_balance_indices``; K, V and positions are gathered here (``hgraph.all_gather``; dK, dV
    are reduce-scattered back by its adjoint); ``rank_context`` is the calling rank's. On fake tensors
    without a rank context (shape propagation of the global graph) only the output's shape and dtype
    are computed.
    """
    unknown = sorted(set(variant) - {f.name for f in dataclasses.fields(AttentionVariant)})
    if unknown:
        raise ShardingRuleError(
            f"packed_attention: unknown attention variant {', '.join(unknown)}; the variants are "
            f"{', '.join(f.name for f in dataclasses.fields(AttentionVariant))}"
        )
    chosen = AttentionVariant(**variant)
    shape_only = is_fake(q) and rank_context is None
    if chosen.alibi is not None and not is_fake(q) and chosen.alibi.shape != (q.shape[1],):
        raise ShardingRuleError(
            f"packed_attention: {tuple(chosen.alibi.shape)} ALiBi slopes for {q.shape[1]} query heads (need one per head)"
        )
    if not is_fake(q) and position_ids.shape != (q.shape[0], q.shape[2]):
        raise ShardingRuleError(
            f"packed_attention: position_ids {tuple(position_ids.shape)} do not match q {tuple(q.shape)} "
            "(need [batch, seq])"
        )
    size, index = 1, 0
    if cp and not shape_only:
        rc = required(rank_context, "packed_attention(cp=True)")
        size, index = rc.size("cp"), rc.index("cp")
        k = all_gather(k, "cp", 2, grad_partial=True, rank_context=rc)
        v = all_gather(v, "cp", 2, grad_partial=True, rank_context=rc)
        position_ids = torch.ops.hgraph.all_gather(position_ids.detach(), "cp", 1, False, rc)
    return torch.ops.hgraph.packed_attention(
        q, k, v, position_ids, scale, cp and not shape_only, size, index, enable_gqa, *chosen.op_args()
    )
