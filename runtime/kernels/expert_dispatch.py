"""Expert parallelism's token movement: permute, dispatch, combine, unpermute, with exact adjoints.

A mixture-of-experts layer as HuggingFace writes it (``grouped_mm_experts_forward``) sorts its
``(token, k)`` pairs by expert, runs every expert on its rows with grouped matmuls and sums each
token's ``k`` weighted results. Under expert parallelism (``Pipeline(ep=...)``) the experts are split
into ``ep`` groups over the stage's ranks, each group cut ``etp`` ways (``hgraph.core.strategy``), and
rows travel to the ranks of their expert (dispatch) and back (combine)::

    x [N, h], top_k_index [N, k]
      -> permute_tokens   rows [N·k, h] sorted by expert, counts [E] per expert, order [N·k]
      -> dispatch         all-to-all over "ep" (split sizes agreed per micro-batch), all-gather
                          over "etp": rows_e [R, h] of this rank's E/ep experts, expert-major;
                          offsets [E/ep] (cumulative rows per local expert), layout [etp, ep, E/ep]
      -> the experts      the traced grouped matmuls on rows_e with the local experts' weights
      -> combine          this rank's own rows of the results (reduce-scattered over etp, where
                          the experts are cut row-parallel), all-to-all back
      -> unpermute_tokens weighted sum of each token's k results: [N, h]

Every row goes exactly where its expert is and comes back to where it came from, so the layer equals
the unmodified one on any split of the tokens. Split sizes differ per rank and per micro-batch: the
all-to-all is uneven (gloo and NCCL support it); ``layout[t, j, e]`` holds how many rows etp member
``t``'s ep peer ``j`` sent for local expert ``e``, so combine and the adjoints need no second exchange.
Adjoints: dispatch <-> combine (an all-gather's adjoint keeps this rank's own rows, a gather of
exact gradients as everywhere in hgraph), and ``token_chunk`` <-> ``token_gather`` over tp, which take
and restore this rank's share of tokens replicated on tp (``torch.tensor_split`` shares: any count).

The functions without a rank context (``permute_tokens``, ``unpermute_tokens`` and the global forms
``dispatch``/``combine``, identities on one device) are what the global graph computes; the custom
ops (``torch.ops.hgraph.expert_*``, ``token_*``, whose last argument is the calling rank's
``RankContext``) are what local programs call.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from hgraph.runtime.kernels.context import RankContext, required

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- token-local steps
def permute_tokens(x: Tensor, top_k_index: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows, counts, order)``: the ``(token, k)`` pairs sorted by expert (stable), each pair's token
    row, the number of pairs per expert and, per sorted row, its pair's position ``token·k + j``."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // top_k_index.shape[-1]]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int64))
    return rows, counts, order


def unpermute_tokens(rows: Tensor, order: Tensor, top_k_weights: Tensor) -> Tensor:
    """Each token's ``k`` results (rows in expert order, ``order`` from ``permute_tokens``) weighted by
    ``top_k_weights`` and summed, returned in the dtype of ``rows`` (HuggingFace's order of operations:
    a bf16 model weights and sums in the router's fp32)."""
    n, k = top_k_weights.shape[0], top_k_weights.shape[-1]
    weighted = rows * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    return weighted[inverse].view(n, k, rows.shape[-1]).sum(dim=1).to(rows.dtype)


def dispatch(rows: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Global form (one device, every expert local): ``(rows, offsets, layout)``."""
    return rows, torch.cumsum(counts, 0, dtype=torch.int32), counts.view(1, 1, -1)


def combine(rows: Tensor, order: Tensor, counts: Tensor, layout: Tensor) -> Tensor:
    """Global form (one device): the rows themselves."""
    return rows


# ----------------------------------------------------------------------------- movement
def _sizes(rc: RankContext, counts: Tensor, layout: Tensor) -> tuple[list[int], list[int], list[int], int]:
    """Rows this rank sends to each ep peer, receives from each, gathers from each etp member, and
    its own etp index."""
    ep = rc.size("ep")
    t = rc.index("etp")
    send = counts.view(ep, -1).sum(1).tolist()
    recv = layout[t].sum(1).tolist()
    gathered = layout.sum((1, 2)).tolist()
    return send, recv, gathered, t


def _expert_major(layout: Tensor) -> Tensor:
    """Row indices that reorder blocks ``(etp member, ep peer, local expert)`` into local-expert order."""
    sizes = layout.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    block = torch.arange(sizes.numel(), device=layout.device).view(layout.shape).permute(2, 0, 1).reshape(-1)
    lengths = sizes[block]
    first = torch.repeat_interleave(starts[block] - (torch.cumsum(lengths, 0) - lengths), lengths)
    return first + torch.arange(int(lengths.sum()), device=layout.device)


def _gather_uneven(rc: RankContext, x: Tensor, mesh_dim: str, sizes: Sequence[int]) -> Tensor:
    """Concatenate every member's rows (``sizes[i]`` of member ``i``), padding to the largest."""
    most = max(sizes)
    padded = x.new_zeros((most,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    stacked = rc.comm.all_gather(padded.contiguous(), rc.group(mesh_dim))
    return torch.cat([stacked[i, :n] for i, n in enumerate(sizes)])


def _to_experts(rc: RankContext, rows: Tensor, counts: Tensor, layout: Tensor) -> Tensor:
    send, recv, gathered, _ = _sizes(rc, counts, layout)
    width = tuple(rows.shape[1:])
    pieces = [p.contiguous() for p in rows.split(send)]
    received = torch.cat(rc.comm.all_to_all(pieces, rc.group("ep"), [(n,) + width for n in recv]))
    if rc.size("etp") > 1:
        received = _gather_uneven(rc, received, "etp", gathered)
    return received[_expert_major(layout)]


def _scatter_sum_uneven(rc: RankContext, x: Tensor, mesh_dim: str, sizes: Sequence[int]) -> Tensor:
    """Member ``i`` gets the sum over members of rows ``sizes[:i].sum() : +sizes[i]`` (padded to the largest)."""
    most = max(sizes)
    stacked = x.new_zeros((len(sizes), most) + tuple(x.shape[1:]))
    for i, part in enumerate(x.split(list(sizes))):
        stacked[i, : part.shape[0]] = part
    return rc.comm.reduce_scatter(stacked, rc.group(mesh_dim))[: sizes[rc.index(mesh_dim)]]


def _from_experts(rc: RankContext, rows_e: Tensor, counts: Tensor, layout: Tensor, partial: bool) -> Tensor:
    send, recv, gathered, t = _sizes(rc, counts, layout)
    width = tuple(rows_e.shape[1:])
    order = _expert_major(layout)
    blocks = torch.empty_like(rows_e)
    blocks[order] = rows_e
    if partial and rc.size("etp") > 1:  # etp members hold partial sums (row-parallel experts): reduce-scatter
        mine = _scatter_sum_uneven(rc, blocks, "etp", gathered)
    else:
        start = sum(gathered[:t])
        mine = blocks[start : start + gathered[t]]
    pieces = [p.contiguous() for p in mine.split(recv)]
    return torch.cat(rc.comm.all_to_all(pieces, rc.group("ep"), [(n,) + width for n in send]))


def _agree_layout(rc: RankContext, counts: Tensor) -> Tensor:
    """``layout [etp, ep, E/ep]``: every ep peer's count for each of this group's experts, from every
    etp member (one small all-to-all of the counts, and an all-gather over etp)."""
    ep = rc.size("ep")
    mine = counts.to(torch.int64).view(ep, -1)
    width = mine.shape[1]
    received = torch.stack(rc.comm.all_to_all([mine[j].contiguous() for j in range(ep)], rc.group("ep"), [(width,)] * ep))
    if rc.size("etp") > 1:
        return rc.comm.all_gather(received, rc.group("etp"))
    return received.unsqueeze(0)


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("hgraph::expert_dispatch", mutates_args=())
def _expert_dispatch(rows: Tensor, counts: Tensor, rc: RankContext) -> tuple[Tensor, Tensor, Tensor]:
    layout = _agree_layout(rc, counts)
    rows_e = _to_experts(rc, rows, counts, layout)
    return rows_e, torch.cumsum(layout.sum((0, 1)), 0, dtype=torch.int32), layout


@torch.library.custom_op("hgraph::expert_scatter", mutates_args=())
def _expert_scatter(rows: Tensor, counts: Tensor, layout: Tensor, rc: RankContext) -> Tensor:
    return _to_experts(rc, rows, counts, layout)


@torch.library.custom_op("hgraph::expert_combine", mutates_args=())
def _expert_combine(rows_e: Tensor, order: Tensor, counts: Tensor, layout: Tensor, partial: bool,
                    rc: RankContext) -> Tensor:
    return _from_experts(rc, rows_e, counts, layout, partial)


@torch.library.custom_op("hgraph::token_chunk", mutates_args=())
def _token_chunk(x: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
    return x.tensor_split(rc.size(mesh_dim))[rc.index(mesh_dim)].clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("hgraph::token_gather", mutates_args=())
def _token_gather(x: Tensor, like: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
    sizes = [len(part) for part in torch.arange(like.shape[0]).tensor_split(rc.size(mesh_dim))]
    return _gather_uneven(rc, x, mesh_dim, sizes)


def _dynamic_rows(like: Tensor, balanced: Any) -> Tensor:
    """Rows received from the experts' peers: a data-dependent size where the tracer keeps symbolic
    shapes, else (inspection graphs at example shapes) ``balanced``, the count under even routing."""
    ctx = torch.library.get_ctx()
    shape_env = getattr(ctx, "_shape_env", None)
    if shape_env is not None and shape_env.allow_dynamic_output_shape_ops:
        balanced = ctx.new_dynamic_size()
    return like.new_empty((balanced,) + tuple(like.shape[1:]))


@_expert_dispatch.register_fake
def _(rows: Tensor, counts: Tensor, rc: RankContext) -> tuple[Tensor, Tensor, Tensor]:
    ep, etp = rc.size("ep"), rc.size("etp")
    local = counts.shape[0] // ep
    rows_e = _dynamic_rows(rows, rows.shape[0] * etp)
    return rows_e, counts.new_empty((local,), dtype=torch.int32), counts.new_empty((etp, ep, local), dtype=torch.int64)


@_expert_scatter.register_fake
def _(rows: Tensor, counts: Tensor, layout: Tensor, rc: RankContext) -> Tensor:
    return _dynamic_rows(rows, rows.shape[0] * layout.shape[0])


@_expert_combine.register_fake
def _(rows_e: Tensor, order: Tensor, counts: Tensor, layout: Tensor, partial: bool, rc: RankContext) -> Tensor:
    return rows_e.new_empty((order.shape[0],) + tuple(rows_e.shape[1:]))


@_token_chunk.register_fake
def _(x: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
    n, i = rc.size(mesh_dim), rc.index(mesh_dim)
    size = x.shape[0] // n + (1 if i < x.shape[0] % n else 0)
    return x.new_empty((size,) + tuple(x.shape[1:]))


@_token_gather.register_fake
def _(x: Tensor, like: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
    return x.new_empty((like.shape[0],) + tuple(x.shape[1:]))


def _save_dispatch(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = inputs[-1]
    ctx.save_for_backward(inputs[1], output[2])
    ctx.rows = inputs[0].shape[0]


def _dispatch_backward(ctx: Any, grad_rows: Tensor, grad_offsets: Any, grad_layout: Any) -> tuple:
    counts, layout = ctx.saved_tensors
    order = grad_rows.new_empty((ctx.rows,), dtype=torch.int64)
    return torch.ops.hgraph.expert_combine(grad_rows, order, counts, layout, False, ctx.rc), None, None


def _save_scatter(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = inputs[-1]
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.rows = inputs[0].shape[0]


def _scatter_backward(ctx: Any, grad: Tensor) -> tuple:
    counts, layout = ctx.saved_tensors
    order = grad.new_empty((ctx.rows,), dtype=torch.int64)
    return torch.ops.hgraph.expert_combine(grad, order, counts, layout, False, ctx.rc), None, None, None


def _save_combine(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = inputs[-1]
    ctx.save_for_backward(inputs[2], inputs[3])


def _combine_backward(ctx: Any, grad: Tensor) -> tuple:
    counts, layout = ctx.saved_tensors
    return torch.ops.hgraph.expert_scatter(grad, counts, layout, ctx.rc), None, None, None, None, None


def _save_chunk(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = inputs[-1]
    ctx.like, ctx.mesh_dim = inputs[0].new_empty((inputs[0].shape[0], 0)), inputs[1]


def _chunk_backward(ctx: Any, grad: Tensor) -> tuple:
    return torch.ops.hgraph.token_gather(grad, ctx.like, ctx.mesh_dim, ctx.rc), None, None


def _save_gather(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = inputs[-1]
    ctx.mesh_dim = inputs[2]


def _gather_backward(ctx: Any, grad: Tensor) -> tuple:
    return torch.ops.hgraph.token_chunk(grad, ctx.mesh_dim, ctx.rc), None, None, None


_expert_dispatch.register_autograd(_dispatch_backward, setup_context=_save_dispatch)
_expert_scatter.register_autograd(_scatter_backward, setup_context=_save_scatter)
_expert_combine.register_autograd(_combine_backward, setup_context=_save_combine)
_token_chunk.register_autograd(_chunk_backward, setup_context=_save_chunk)
_token_gather.register_autograd(_gather_backward, setup_context=_save_gather)


# ----------------------------------------------------------------------------- entry points
# ``rank_context``: the calling rank's ``RankContext`` (a bound program passes its last argument).
def expert_dispatch(rows: Tensor, counts: Tensor, *,
                    rank_context: Optional[RankContext] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Rows (sorted by expert) to the ranks of their experts: ``(rows_e, offsets, layout)``."""
    return torch.ops.hgraph.expert_dispatch(rows, counts, required(rank_context, "expert_dispatch"))


def expert_combine(rows_e: Tensor, order: Tensor, counts: Tensor, layout: Tensor, partial: bool = False, *,
                   rank_context: Optional[RankContext] = None) -> Tensor:
    """The experts' results back to the ranks their rows came from, in the order ``dispatch`` took
    them (``order`` gives the row count). ``rows_e`` is replicated over etp, or with ``partial`` a
    pending sum there (row-parallel experts), reduce-scattered to each member's own rows."""
    return torch.ops.hgraph.expert_combine(rows_e, order, counts, layout, partial,
                                           required(rank_context, "expert_combine"))


def token_chunk(x: Tensor, mesh_dim: str, *, rank_context: Optional[RankContext] = None) -> Tensor:
    """This rank's share of rows replicated over ``mesh_dim`` (``tensor_split``); backward gathers."""
    return torch.ops.hgraph.token_chunk(x, mesh_dim, required(rank_context, "token_chunk"))


def token_gather(x: Tensor, like: Tensor, mesh_dim: str, *, rank_context: Optional[RankContext] = None) -> Tensor:
    """Every member's share (``token_chunk`` of ``like``'s rows) concatenated; backward keeps this
    rank's share."""
    return torch.ops.hgraph.token_gather(x, like, mesh_dim, required(rank_context, "token_gather"))


__all__ = [
    "combine", "dispatch", "expert_combine", "expert_dispatch", "permute_tokens", "token_chunk",
    "token_gather", "unpermute_tokens",
]
