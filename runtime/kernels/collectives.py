"""Collectives of compiled local programs: ``torch.library`` custom ops with exact adjoints.

A compiled per-rank program is an fx graph run under ordinary torch autograd; every communication
in it is a call to one of the Python functions below, which call the custom ops
``torch.ops.hgraph.<name>`` (schema args: the tensor, the logical mesh dim ``"tp"``/``"cp"``, dims and
flags). Each op finds the calling rank's group through ``hgraph.runtime.kernels.context.current()`` when it
runs, so one program serves every rank of a stage, on threads (``ThreadComm``) or processes
(``ProcessGroupComm``) alike. Every op has a fake (shape-only) implementation, which reads the group
*sizes* from the current context, and a registered backward that calls the adjoint custom op, so a
traced backward (``hgraph.passes.backward``) shows its communication as ``hgraph.*`` nodes.

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

A backward can run on another thread than its forward (autograd's device threads on GPU): the
context seen by the forward is saved and re-entered around the adjoint call.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from hgraph.errors import CommunicationError, ShardingRuleError
from hgraph.runtime.kernels.context import RankContext, current, rank_context

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


def active_context() -> Optional[RankContext]:
    """The current context, or None outside one (shape-only tracing of the global graph)."""
    try:
        return current()
    except CommunicationError:
        return None


@contextlib.contextmanager
def entered(rc: Optional[RankContext]) -> Iterator[None]:
    """Re-enter the forward's context for an adjoint, unless it is already current here."""
    if rc is None or active_context() is rc:
        yield
    else:
        with rank_context(rc):
            yield


def _resized(x: Tensor, dim: int, size: int) -> Tensor:
    """A contiguous tensor like ``x`` with ``size`` at ``dim`` (every real op returns contiguous
    tensors, so traced graphs' views hold at run time)."""
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


def group_size(mesh_dim: str) -> int:
    return current().size(mesh_dim)


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("hgraph::all_reduce", mutates_args=())
def _all_reduce(x: Tensor, mesh_dim: str) -> Tensor:
    rc = current()
    return rc.comm.all_reduce(x, rc.group(mesh_dim)).contiguous()


@torch.library.custom_op("hgraph::reduce_scatter", mutates_args=())
def _reduce_scatter(x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    return _scatter_sum(current(), x, mesh_dim, dim)


@torch.library.custom_op("hgraph::all_gather", mutates_args=())
def _all_gather(x: Tensor, mesh_dim: str, dim: int, grad_partial: bool) -> Tensor:
    return _gather(current(), x, mesh_dim, dim)


@torch.library.custom_op("hgraph::split", mutates_args=())
def _split(x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    return _own_chunk(current(), x, mesh_dim, dim)


@torch.library.custom_op("hgraph::all_to_all", mutates_args=())
def _all_to_all(x: Tensor, mesh_dim: str, split_dim: int, cat_dim: int) -> Tensor:
    return _exchange(current(), x, mesh_dim, split_dim, cat_dim)


@torch.library.custom_op("hgraph::all_reduce_max", mutates_args=())
def _all_reduce_max(x: Tensor, mesh_dim: str) -> Tensor:
    rc = current()
    return rc.comm.all_gather(x.contiguous(), rc.group(mesh_dim)).amax(dim=0)


@_all_reduce.register_fake
def _(x: Tensor, mesh_dim: str) -> Tensor:
    return x.new_empty(x.shape)


@_all_reduce_max.register_fake
def _(x: Tensor, mesh_dim: str) -> Tensor:
    return x.new_empty(x.shape)


@_reduce_scatter.register_fake
def _(x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    n = group_size(mesh_dim)
    _even_chunks(x, n, dim, f"reduce_scatter over '{mesh_dim}'")
    return _resized(x, dim, x.shape[dim] // n)


@_all_gather.register_fake
def _(x: Tensor, mesh_dim: str, dim: int, grad_partial: bool) -> Tensor:
    return _resized(x, dim, x.shape[dim] * group_size(mesh_dim))


@_split.register_fake
def _(x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    n = group_size(mesh_dim)
    _even_chunks(x, n, dim, f"split over '{mesh_dim}'")
    return _resized(x, dim, x.shape[dim] // n)


@_all_to_all.register_fake
def _(x: Tensor, mesh_dim: str, split_dim: int, cat_dim: int) -> Tensor:
    n = group_size(mesh_dim)
    _even_chunks(x, n, split_dim, f"all_to_all over '{mesh_dim}'")
    out = _resized(x, split_dim, x.shape[split_dim] // n)
    return _resized(out, cat_dim, out.shape[cat_dim] * n)


def _save_context(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = active_context()
    ctx.args = inputs[1:]


def _all_reduce_backward(ctx: Any, grad: Tensor) -> tuple:
    return grad, None


def _reduce_scatter_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim = ctx.args
    with entered(ctx.rc):
        return torch.ops.hgraph.all_gather(grad, mesh_dim, dim, False), None, None


def _all_gather_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim, grad_partial = ctx.args
    with entered(ctx.rc):
        if grad_partial:
            return torch.ops.hgraph.reduce_scatter(grad, mesh_dim, dim), None, None, None
        return torch.ops.hgraph.split(grad, mesh_dim, dim), None, None, None


def _split_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim = ctx.args
    with entered(ctx.rc):
        return torch.ops.hgraph.all_gather(grad, mesh_dim, dim, False), None, None


def _all_to_all_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, split_dim, cat_dim = ctx.args
    with entered(ctx.rc):
        return torch.ops.hgraph.all_to_all(grad, mesh_dim, cat_dim, split_dim), None, None, None


_all_reduce.register_autograd(_all_reduce_backward, setup_context=_save_context)
_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_save_context)
_all_gather.register_autograd(_all_gather_backward, setup_context=_save_context)
_split.register_autograd(_split_backward, setup_context=_save_context)
_all_to_all.register_autograd(_all_to_all_backward, setup_context=_save_context)


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh_dim: str) -> Tensor:
        ctx.rc, ctx.mesh_dim = active_context(), mesh_dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        with entered(ctx.rc):
            return torch.ops.hgraph.all_reduce(grad, ctx.mesh_dim), None


# ----------------------------------------------------------------------------- entry points
def all_reduce(x: Tensor, mesh_dim: str) -> Tensor:
    """P -> R: sum over the group; backward passes the (replicated) gradient through."""
    return torch.ops.hgraph.all_reduce(x, mesh_dim)


def reduce_scatter(x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    """P -> S(dim): sum over the group and keep this rank's chunk; backward all-gathers."""
    return torch.ops.hgraph.reduce_scatter(x, mesh_dim, dim)


def all_gather(x: Tensor, mesh_dim: str, dim: int, grad_partial: bool = False) -> Tensor:
    """S(dim) -> R: concatenate every rank's chunk along ``dim``.

    Backward keeps this rank's chunk of the gradient, or — when the consumers produce *partial*
    gradients (Megatron sequence parallelism: the gathered input feeds a column-parallel matmul) —
    reduce-scatters it.
    """
    return torch.ops.hgraph.all_gather(x, mesh_dim, dim, grad_partial)


def split(x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    """R -> S(dim): keep this rank's chunk; backward all-gathers."""
    return torch.ops.hgraph.split(x, mesh_dim, dim)


def all_to_all(x: Tensor, mesh_dim: str, split_dim: int, cat_dim: int) -> Tensor:
    """S(cat_dim) -> S(split_dim): send chunk i of ``split_dim`` to rank i, concatenate along ``cat_dim``."""
    return torch.ops.hgraph.all_to_all(x, mesh_dim, split_dim, cat_dim)


def grad_all_reduce(x: Tensor, mesh_dim: str) -> Tensor:
    """Identity forward, all-reduce backward: a replicated activation consumed by sharded ops."""
    return _GradAllReduce.apply(x, mesh_dim)


def all_reduce_max(x: Tensor, mesh_dim: str) -> Tensor:
    """Element-wise max over the group (no gradient: used for numerical stabilisers only)."""
    return torch.ops.hgraph.all_reduce_max(x.detach(), mesh_dim)
