"""Collectives of compiled local programs: ``torch.library`` custom ops with exact adjoints.

A compiled per-rank program is an fx graph run under ordinary torch autograd; every communication
in it is a call to one of the Python functions below, which call the custom ops
``torch.ops.hgraph.<name>`` (schema args: the tensor, the logical mesh dim ``"tp"``/``"cp"``, dims and
flags, and last the calling rank's ``RankContext``, which the entry points take as ``rank_context=``).
The context names the rank's group of each mesh dim, so one program serves every rank of a stage,
on threads (``ThreadComm``) or processes (``ProcessGroupComm``) alike. Every op has a fake (shape-only)
implementation, which reads the group *sizes* from the context, and a registered backward that calls
the adjoint custom op, so a traced backward (``hgraph.passes.backward``) shows its communication as
``hgraph.*`` nodes.

Placements in the names: P partial (pending sum), R replicated, S(d) sharded along dim d in equal,
rank-ordered chunks. The adjoint of a placement change swaps the roles::

    all_reduce      P -> R      backward: identity (R grad is the P grad of every rank)
    reduce_scatter  P -> S(d)   backward: all_gather
    all_gather      S(d) -> R   backward: split (own chunk), or reduce_scatter when grads are partial
    split           R -> S(d)   backward: all_gather
    all_to_all      S(c) -> S(s) backward: all_to_all S(s) -> S(c)
    grad_all_reduce R -> R      backward: all_reduce (Megatron's "f")

``grad_all_reduce`` is an identity forward and stays an ``autograd.Function`` (a custom op may not
return its input, so it would cost a copy); its backward calls ``hgraph.all_reduce``.
Packed attention (``runtime/kernels/packed_attention.py``) and the vocab-parallel embedding and cross entropy
(``runtime/kernels/vocab_parallel.py``) are built on these ops.

A backward can run on another thread than its forward (autograd's device threads on GPU): each
adjoint calls its op with the context its forward was given.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hgraph.errors import ShardingRuleError
from hgraph.runtime.kernels.context import RankContext, required

Tensor = torch.Tensor


def _even_chunks(x: Tensor, parts: int, dim: int, what: str) -> tuple[Tensor, ...]:
    size = x.shape[dim]
    if size % parts:
        raise ShardingRuleError(
            f"{what}: dim {dim} of size {size} (shape {tuple(x.shape)}) does not split evenly "
            f"into {parts} parts"
        )
    return x.chunk(parts, dim)


def _gather(rc: RankContext, x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    stacked = rc.comm.all_gather(x.contiguous(), rc.group(mesh_dim))
    return torch.cat(stacked.unbind(0), dim=dim)


def _scatter_sum(rc: RankContext, x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    pieces = _even_chunks(x, rc.size(mesh_dim), dim, f"reduce_scatter over '{mesh_dim}'")
    return rc.comm.reduce_scatter(torch.stack(pieces), rc.group(mesh_dim))


def _own_chunk(rc: RankContext, x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    pieces = _even_chunks(x, rc.size(mesh_dim), dim, f"split over '{mesh_dim}'")
    return pieces[rc.index(mesh_dim)].clone(memory_format=torch.contiguous_format)  # never a view of x


def _exchange(rc: RankContext, x: Tensor, mesh_dim: str, split_dim: int, cat_dim: int) -> Tensor:
    chunks = _even_chunks(x, rc.size(mesh_dim), split_dim, f"all_to_all over '{mesh_dim}'")
    pieces = [p.contiguous() for p in chunks]
    shapes = [tuple(pieces[0].shape)] * len(pieces)
    received = rc.comm.all_to_all(pieces, rc.group(mesh_dim), shapes)
    return torch.cat(received, dim=cat_dim)


def _resized(x: Tensor, dim: int, size: int) -> Tensor:
    """A contiguous tensor like ``x`` with ``size`` at ``dim`` (every real op returns contiguous
    tensors, so traced graphs' views hold at run time)."""
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("hgraph::all_reduce", mutates_args=())
def _all_reduce(x: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
    return rc.comm.all_reduce(x, rc.group(mesh_dim)).contiguous()


@torch.library.custom_op("hgraph::reduce_scatter", mutates_args=())
def _reduce_scatter(x: Tensor, mesh_dim: str, dim: int, rc: RankContext) -> Tensor:
    return _scatter_sum(rc, x, mesh_dim, dim)


@torch.library.custom_op("hgraph::all_gather", mutates_args=())
def _all_gather(x: Tensor, mesh_dim: str, dim: int, grad_partial: bool, rc: RankContext) -> Tensor:
    return _gather(rc, x, mesh_dim, dim)


@torch.library.custom_op("hgraph::split", mutates_args=())
def _split(x: Tensor, mesh_dim: str, dim: int, rc: RankContext) -> Tensor:
    return _own_chunk(rc, x, mesh_dim, dim)


@torch.library.custom_op("hgraph::all_to_all", mutates_args=())
def _all_to_all(x: Tensor, mesh_dim: str, split_dim: int, cat_dim: int, rc: RankContext) -> Tensor:
    return _exchange(rc, x, mesh_dim, split_dim, cat_dim)


@torch.library.custom_op("hgraph::all_reduce_max", mutates_args=())
def _all_reduce_max(x: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
    return rc.comm.all_gather(x.contiguous(), rc.group(mesh_dim)).amax(dim=0)


@_all_reduce.register_fake
def _(x: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
    return x.new_empty(x.shape)


@_all_reduce_max.register_fake
def _(x: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
    return x.new_empty(x.shape)


@_reduce_scatter.register_fake
def _(x: Tensor, mesh_dim: str, dim: int, rc: RankContext) -> Tensor:
    n = rc.size(mesh_dim)
    _even_chunks(x, n, dim, f"reduce_scatter over '{mesh_dim}'")
    return _resized(x, dim, x.shape[dim] // n)


@_all_gather.register_fake
def _(x: Tensor, mesh_dim: str, dim: int, grad_partial: bool, rc: RankContext) -> Tensor:
    return _resized(x, dim, x.shape[dim] * rc.size(mesh_dim))


@_split.register_fake
def _(x: Tensor, mesh_dim: str, dim: int, rc: RankContext) -> Tensor:
    n = rc.size(mesh_dim)
    _even_chunks(x, n, dim, f"split over '{mesh_dim}'")
    return _resized(x, dim, x.shape[dim] // n)


@_all_to_all.register_fake
def _(x: Tensor, mesh_dim: str, split_dim: int, cat_dim: int, rc: RankContext) -> Tensor:
    n = rc.size(mesh_dim)
    _even_chunks(x, n, split_dim, f"all_to_all over '{mesh_dim}'")
    out = _resized(x, split_dim, x.shape[split_dim] // n)
    return _resized(out, cat_dim, out.shape[cat_dim] * n)


def _save_context(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.args = inputs[1:]  # the mesh dim, dims and flags, then the rank context


def _all_reduce_backward(ctx: Any, grad: Tensor) -> tuple:
    return grad, None, None


def _reduce_scatter_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim, rc = ctx.args
    return torch.ops.hgraph.all_gather(grad, mesh_dim, dim, False, rc), None, None, None


def _all_gather_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim, grad_partial, rc = ctx.args
    if grad_partial:
        return torch.ops.hgraph.reduce_scatter(grad, mesh_dim, dim, rc), None, None, None, None
    return torch.ops.hgraph.split(grad, mesh_dim, dim, rc), None, None, None, None


def _split_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim, rc = ctx.args
    return torch.ops.hgraph.all_gather(grad, mesh_dim, dim, False, rc), None, None, None


def _all_to_all_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, split_dim, cat_dim, rc = ctx.args
    return torch.ops.hgraph.all_to_all(grad, mesh_dim, cat_dim, split_dim, rc), None, None, None, None


_all_reduce.register_autograd(_all_reduce_backward, setup_context=_save_context)
_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_save_context)
_all_gather.register_autograd(_all_gather_backward, setup_context=_save_context)
_split.register_autograd(_split_backward, setup_context=_save_context)
_all_to_all.register_autograd(_all_to_all_backward, setup_context=_save_context)


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh_dim: str, rc: RankContext) -> Tensor:
        ctx.rc, ctx.mesh_dim = rc, mesh_dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return torch.ops.hgraph.all_reduce(grad, ctx.mesh_dim, ctx.rc), None, None


# ----------------------------------------------------------------------------- entry points
# ``rank_context``: the calling rank's ``RankContext`` (a bound program passes its last argument).
def all_reduce(x: Tensor, mesh_dim: str, *, rank_context: Optional[RankContext] = None) -> Tensor:
    """P -> R: sum over the group; backward passes the (replicated) gradient through."""
    return torch.ops.hgraph.all_reduce(x, mesh_dim, required(rank_context, "all_reduce"))


def reduce_scatter(x: Tensor, mesh_dim: str, dim: int, *, rank_context: Optional[RankContext] = None) -> Tensor:
    """P -> S(dim): sum over the group and keep this rank's chunk; backward all-gathers."""
    return torch.ops.hgraph.reduce_scatter(x, mesh_dim, dim, required(rank_context, "reduce_scatter"))


def all_gather(x: Tensor, mesh_dim: str, dim: int, grad_partial: bool = False, *,
               rank_context: Optional[RankContext] = None) -> Tensor:
    """S(dim) -> R: concatenate every rank's chunk along ``dim``.

    Backward keeps this rank's chunk of the gradient, or — when the consumers produce *partial*
    gradients (Megatron sequence parallelism: the gathered input feeds a column-parallel matmul) —
    reduce-scatters it.
    """
    return torch.ops.hgraph.all_gather(x, mesh_dim, dim, grad_partial, required(rank_context, "all_gather"))


def split(x: Tensor, mesh_dim: str, dim: int, *, rank_context: Optional[RankContext] = None) -> Tensor:
    """R -> S(dim): keep this rank's chunk; backward all-gathers."""
    return torch.ops.hgraph.split(x, mesh_dim, dim, required(rank_context, "split"))


def all_to_all(x: Tensor, mesh_dim: str, split_dim: int, cat_dim: int, *,
               rank_context: Optional[RankContext] = None) -> Tensor:
    """S(cat_dim) -> S(split_dim): send chunk i of ``split_dim`` to rank i, concatenate along ``cat_dim``."""
    return torch.ops.hgraph.all_to_all(x, mesh_dim, split_dim, cat_dim, required(rank_context, "all_to_all"))


def grad_all_reduce(x: Tensor, mesh_dim: str, *, rank_context: Optional[RankContext] = None) -> Tensor:
    """Identity forward, all-reduce backward: a replicated activation consumed by sharded ops."""
    return _GradAllReduce.apply(x, mesh_dim, required(rank_context, "grad_all_reduce"))


def all_reduce_max(x: Tensor, mesh_dim: str, *, rank_context: Optional[RankContext] = None) -> Tensor:
    """Element-wise max over the group (no gradient: used for numerical stabilisers only)."""
    return torch.ops.hgraph.all_reduce_max(x.detach(), mesh_dim, required(rank_context, "all_reduce_max"))
