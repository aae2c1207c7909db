"""Linear-attention layers over packed sequences: the short causal convolution and the gated delta
rule of Gated DeltaNet (Qwen3-Next, Qwen3.5), each restarting at every document boundary.

Both carry state along the sequence: a causal convolution of width ``k`` reads the ``k - 1`` tokens
before each one, the delta rule a ``[d_k, d_v]`` memory per head. In a packed micro-batch (documents
concatenated, ``position_ids`` restarting at 0 where each starts) HF's reference kernels would let
every document read the end of the one before it. ``packed_causal_conv1d`` and
``packed_gated_delta_rule`` run each document alone — the very kernels HF runs on an unpacked
sequence (``F.conv1d`` with left padding; the chunked delta rule with ``solve_triangular``), applied
per document — so a packed row equals its documents run one by one, and an unpacked row equals HF.

Both are ``torch.ops.hgraph.*`` custom ops (opaque to tracing and shape propagation; the backward op
recomputes the forward under autograd, like ``packed_attention``). Heads (the delta rule) and channels
(the convolution) are independent, so tp shards them freely; neither splits the sequence (cp).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from hgraph.runtime.kernels.custom_op_autograd import autograd_inside_op

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- documents
def documents(position_ids: Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each document of one row: a document starts where ``position_ids == 0``."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, [*starts[1:], len(position_ids)]))


def _per_document(fn: Any, tensors: list[Tensor], position_ids: Optional[Tensor], seq_dim: int) -> Tensor:
    """``fn(*tensors)`` run on every document of every row alone (rows that share one layout of
    documents run together), results put back in place along ``seq_dim``."""
    if position_ids is None:
        return fn(*tensors)
    batch = tensors[0].shape[0]
    layouts: dict[tuple, list[int]] = {}
    for row in range(batch):
        layouts.setdefault(tuple(documents(position_ids[row])), []).append(row)
    if len(layouts) == 1 and len(next(iter(layouts))) == 1:
        return fn(*tensors)  # one document per row: exactly the unpacked kernel
    out: Optional[Tensor] = None
    for layout, rows in layouts.items():
        index = torch.tensor(rows, device=tensors[0].device)
        for start, end in layout:
            result = fn(*(t.index_select(0, index).narrow(seq_dim, start, end - start) for t in tensors))
            if out is None:
                shape = list(result.shape)
                shape[0], shape[seq_dim] = batch, position_ids.shape[1]
                out = result.new_zeros(shape)
            out.narrow(seq_dim, start, end - start).index_copy_(0, index, result)
    assert out is not None
    return out


# ----------------------------------------------------------------------------- causal convolution
def _causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Depthwise causal convolution of ``x [b, c, s]`` with ``weight [c, 1, k]``, as HF's
    ``causal_conv1d_fn`` computes it (left padding ``k - 1``, the first ``s`` outputs)."""
    k = weight.shape[-1]
    return F.conv1d(x, weight, bias, padding=k - 1, groups=x.shape[1])[..., : x.shape[-1]]


def conv_per_document(x: Tensor, weight: Tensor, bias: Optional[Tensor], position_ids: Optional[Tensor]) -> Tensor:
    """``_causal_conv1d`` of every document alone (the kernel of both custom ops below)."""
    return _per_document(lambda t: _causal_conv1d(t, weight, bias), [x], position_ids, 2)


@torch.library.custom_op("hgraph::causal_conv1d", mutates_args=())
def _conv_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], position_ids: Optional[Tensor]) -> Tensor:
    with torch.no_grad():
        return conv_per_document(x, weight, bias, position_ids).contiguous()


@_conv_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor], position_ids: Optional[Tensor]) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("hgraph::causal_conv1d_backward", mutates_args=())
def _conv_backward_op(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], position_ids: Optional[Tensor]
) -> list[Tensor]:
    leaves = [t.detach().requires_grad_(True) for t in (x, weight)]
    b = bias.detach().requires_grad_(True) if bias is not None else None
    with autograd_inside_op():
        out = conv_per_document(leaves[0], leaves[1], b, position_ids)
        grads = torch.autograd.grad(out, [*leaves, *([b] if b is not None else [])], grad)
    return [g.contiguous() for g in grads]


@_conv_backward_op.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], position_ids: Optional[Tensor]) -> list[Tensor]:
    return [x.new_empty(x.shape), weight.new_empty(weight.shape)] + ([bias.new_empty(bias.shape)] if bias is not None else [])


def _conv_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*[t for t in inputs if t is not None])
    ctx.has_bias, ctx.has_positions = inputs[2] is not None, inputs[3] is not None


def _conv_backward(ctx: Any, grad: Tensor) -> tuple:
    saved = list(ctx.saved_tensors)
    x, weight = saved[:2]
    bias = saved[2] if ctx.has_bias else None
    positions = saved[-1] if ctx.has_positions else None
    grads = torch.ops.hgraph.causal_conv1d_backward(grad, x, weight, bias, positions)
    return grads[0], grads[1], (grads[2] if ctx.has_bias else None), None


_conv_op.register_autograd(_conv_backward, setup_context=_conv_setup)


def packed_causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], position_ids: Tensor) -> Tensor:
    """Depthwise causal convolution of ``x [b, c, s]`` (``weight [c, 1, k]``, ``bias [c]``) restarting
    at every document of ``position_ids [b, s]``: equal to convolving each document alone."""
    return torch.ops.hgraph.causal_conv1d(x, weight, bias, position_ids)


# ----------------------------------------------------------------------------- gated delta rule
def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int, l2norm: bool
) -> Tensor:
    """The gated delta rule of one sequence per row, chunked along it (HF's reference algorithm:
    ``q, k [b, s, hk, dk]``, ``v [b, s, hv, dv]``, ``g, beta [b, s, hv]`` -> ``[b, s, hv, dv]``), from a
    zero state. Each k head serves ``hv / hk`` consecutive v heads."""
    dtype = query.dtype
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]
    if l2norm:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    chunks = (length + pad) // chunk_size
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    state = torch.zeros(batch, v_heads, k_dim, v_dim, dtype=new_values.dtype, device=new_values.device)
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, v_heads, -1, v_dim)[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def rule_per_document(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, position_ids: Optional[Tensor],
                      chunk_size: int, l2norm: bool) -> Tensor:
    """``chunk_gated_delta_rule`` of every document alone (the kernel of both custom ops below)."""
    return _per_document(lambda *t: chunk_gated_delta_rule(*t, chunk_size, l2norm), [q, k, v, g, beta], position_ids, 1)


@torch.library.custom_op("hgraph::gated_delta_rule", mutates_args=())
def _rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, position_ids: Optional[Tensor],
             chunk_size: int, l2norm: bool) -> Tensor:
    with torch.no_grad():
        return rule_per_document(q, k, v, g, beta, position_ids, chunk_size, l2norm).contiguous()


@_rule_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, position_ids: Optional[Tensor],
      chunk_size: int, l2norm: bool) -> Tensor:
    return v.new_empty(v.shape)


@torch.library.custom_op("hgraph::gated_delta_rule_backward", mutates_args=())
def _rule_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                      position_ids: Optional[Tensor], chunk_size: int, l2norm: bool) -> list[Tensor]:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
    with autograd_inside_op():
        out = rule_per_document(*leaves, position_ids, chunk_size, l2norm)
        grads = torch.autograd.grad(out, leaves, grad)
    return [t.contiguous() for t in grads]


@_rule_backward_op.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, position_ids: Optional[Tensor],
      chunk_size: int, l2norm: bool) -> list[Tensor]:
    return [t.new_empty(t.shape) for t in (q, k, v, g, beta)]


def _rule_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*inputs[:5], *([inputs[5]] if inputs[5] is not None else []))
    ctx.options = inputs[6:]


def _rule_backward(ctx: Any, grad: Tensor) -> tuple:
    saved = list(ctx.saved_tensors)
    positions = saved[5] if len(saved) > 5 else None
    grads = torch.ops.hgraph.gated_delta_rule_backward(grad, *saved[:5], positions, *ctx.options)
    return (*grads, None, None, None)


_rule_op.register_autograd(_rule_backward, setup_context=_rule_setup)


def gated_delta_rule(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, position_ids: Optional[Tensor] = None,
    *, chunk_size: int = 64, l2norm: bool = False,
) -> Tensor:
    """The gated delta rule restarting at every document of ``position_ids [b, s]`` (``None``: one
    document per row), from a zero state; shapes as ``chunk_gated_delta_rule``."""
    return torch.ops.hgraph.gated_delta_rule(query, key, value, g, beta, position_ids, chunk_size, l2norm)


def packed_gated_delta_rule(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, position_ids: Tensor,
    *, chunk_size: int = 64, l2norm: bool = False,
) -> Tensor:
    """``gated_delta_rule`` over packed documents (what the frontend puts in traced graphs)."""
    return gated_delta_rule(query, key, value, g, beta, position_ids, chunk_size=chunk_size, l2norm=l2norm)


__all__ = ["chunk_gated_delta_rule", "documents", "gated_delta_rule", "packed_causal_conv1d", "packed_gated_delta_rule"]
