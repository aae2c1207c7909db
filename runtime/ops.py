"""Communication ops of compiled local programs: ``torch.library`` custom ops with exact adjoints.

A compiled per-rank program is an fx graph run under ordinary torch autograd; every communication
in it is a call to one of the Python functions below, which call the custom ops
``torch.ops.hgraph.<name>`` (schema args: the tensor, the logical mesh dim ``"tp"``/``"cp"``, dims and
flags). Each op finds the calling rank's group through ``hgraph.runtime.context.current()`` when it
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
``packed_attention`` is causal attention over packed sequences (``hgraph.packed_attention`` and its
``hgraph.packed_attention_backward``, which recomputes the forward; the kernel per device and construct
comes from ``runtime/attention_kernels.py``: per-sequence SDPA on CPU, varlen or FlexAttention on CUDA; with context parallelism the K/V
gathers are ``hgraph.all_gather`` calls outside it). The two ``vocab_parallel_*`` functions are
compositions of aten ops and the custom ops above (Megatron vocab-parallel embedding and cross entropy).

A backward can run on another thread than its forward (autograd's device threads on GPU): the
context seen by the forward is saved and re-entered around the adjoint call.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from hgraph.errors import CommunicationError, ShardingRuleError
from hgraph.runtime import attention_kernels
from hgraph.runtime.context import RankContext, current, rank_context

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


def _active() -> Optional[RankContext]:
    """The current context, or None outside one (shape-only tracing of the global graph)."""
    try:
        return current()
    except CommunicationError:
        return None


@contextlib.contextmanager
def _entered(rc: Optional[RankContext]) -> Iterator[None]:
    """Re-enter the forward's context for an adjoint, unless it is already current here."""
    if rc is None or _active() is rc:
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


def _group_size(mesh_dim: str) -> int:
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
    n = _group_size(mesh_dim)
    _even_chunks(x, n, dim, f"reduce_scatter over '{mesh_dim}'")
    return _resized(x, dim, x.shape[dim] // n)


@_all_gather.register_fake
def _(x: Tensor, mesh_dim: str, dim: int, grad_partial: bool) -> Tensor:
    return _resized(x, dim, x.shape[dim] * _group_size(mesh_dim))


@_split.register_fake
def _(x: Tensor, mesh_dim: str, dim: int) -> Tensor:
    n = _group_size(mesh_dim)
    _even_chunks(x, n, dim, f"split over '{mesh_dim}'")
    return _resized(x, dim, x.shape[dim] // n)


@_all_to_all.register_fake
def _(x: Tensor, mesh_dim: str, split_dim: int, cat_dim: int) -> Tensor:
    n = _group_size(mesh_dim)
    _even_chunks(x, n, split_dim, f"all_to_all over '{mesh_dim}'")
    out = _resized(x, split_dim, x.shape[split_dim] // n)
    return _resized(out, cat_dim, out.shape[cat_dim] * n)


def _save_context(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = _active()
    ctx.args = inputs[1:]


def _all_reduce_backward(ctx: Any, grad: Tensor) -> tuple:
    return grad, None


def _reduce_scatter_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim = ctx.args
    with _entered(ctx.rc):
        return torch.ops.hgraph.all_gather(grad, mesh_dim, dim, False), None, None


def _all_gather_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim, grad_partial = ctx.args
    with _entered(ctx.rc):
        if grad_partial:
            return torch.ops.hgraph.reduce_scatter(grad, mesh_dim, dim), None, None, None
        return torch.ops.hgraph.split(grad, mesh_dim, dim), None, None, None


def _split_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, dim = ctx.args
    with _entered(ctx.rc):
        return torch.ops.hgraph.all_gather(grad, mesh_dim, dim, False), None, None


def _all_to_all_backward(ctx: Any, grad: Tensor) -> tuple:
    mesh_dim, split_dim, cat_dim = ctx.args
    with _entered(ctx.rc):
        return torch.ops.hgraph.all_to_all(grad, mesh_dim, cat_dim, split_dim), None, None, None


_all_reduce.register_autograd(_all_reduce_backward, setup_context=_save_context)
_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_save_context)
_all_gather.register_autograd(_all_gather_backward, setup_context=_save_context)
_split.register_autograd(_split_backward, setup_context=_save_context)
_all_to_all.register_autograd(_all_to_all_backward, setup_context=_save_context)


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh_dim: str) -> Tensor:
        ctx.rc, ctx.mesh_dim = _active(), mesh_dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        with _entered(ctx.rc):
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


# ----------------------------------------------------------------------------- vocab parallel
def _vocab_range(rows: int, mesh_dim: str) -> tuple[int, int]:
    start = current().index(mesh_dim) * rows
    return start, start + rows


def vocab_parallel_embedding(
    ids: torch.Tensor, weight_shard: torch.Tensor, mesh_dim: str, padding_idx: int | None = None
) -> torch.Tensor:
    """Lookup in rows ``[index·rows, (index+1)·rows)`` of the vocabulary held here; zero elsewhere.

    Returns the *partial* embedding (the caller all-reduces or reduce-scatters it); the gradient flows
    to the rows of ``weight_shard`` that were looked up. ``padding_idx`` (a global row, as in
    ``nn.Embedding``) gets no gradient: only the rank holding that row masks it.
    """
    start, end = _vocab_range(weight_shard.shape[0], mesh_dim)
    inside = (ids >= start) & (ids < end)
    local = torch.where(inside, ids - start, torch.zeros_like(ids))
    local_padding = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None
    return F.embedding(local, weight_shard, padding_idx=local_padding).masked_fill(~inside.unsqueeze(-1), 0.0)


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


def own_kv_heads(kv: Tensor, mesh_dim: str) -> Tensor:
    """The key/value head (dim 1) the query heads of this rank read, when tp exceeds the kv heads.

    Query heads are split contiguously over ``mesh_dim``; with ``kv`` heads and ``tp`` ranks
    (``tp % kv == 0``) rank ``r`` reads head ``r·kv // tp``. ``kv`` is replicated, so the gradient
    of each rank is partial and summed by the caller's adjoint.
    """
    rc = current()
    size, index = rc.size(mesh_dim), rc.index(mesh_dim)
    return kv.narrow(1, index * kv.shape[1] // size, 1)


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list, scale: float | None, enable_gqa: bool,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q ``[b, hq, s_local, d]`` against the stream's k/v ``[b, hkv, S, d]``, run by run.

    A run's queries are the last ``hi - lo`` of its keys; with ``window`` a query at stream index i
    sees keys j with ``i - window < j <= i`` only, so keys before the first query's window are cut.
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
        if softcap is not None:
            outputs.append(_softcapped_attention(q_run, k_run, v_run, mask, scale, softcap))
            continue
        plain_causal = keys == queries and (window is None or window >= keys)
        outputs.append(F.scaled_dot_product_attention(
            q_run, k_run, v_run, attn_mask=None if plain_causal else mask, is_causal=plain_causal,
            scale=scale, enable_gqa=enable_gqa,
        ))
    return torch.cat(outputs, dim=2)


def _softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None, softcap: float
) -> Tensor:
    """Attention with Gemma-2 logit soft-capping: ``scores = softcap · tanh(q·kᵀ·scale / softcap)``."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def _packed_attention_local(
    q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool, enable_gqa: bool,
    window: Optional[int] = None, softcap: Optional[float] = None,
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
    kernel = attention_kernels.choose_kernel(q.device, q.dtype, cp=cp, needs_grad=torch.is_grad_enabled())
    if kernel == "varlen":
        return attention_kernels.varlen(q, k, v, stream_positions, scale, enable_gqa)
    if kernel == "flex":
        return attention_kernels.flex(q, k, v, stream_positions, local_stream, scale, enable_gqa)
    rows = range(q.shape[0])
    if all(torch.equal(stream_positions[0], stream_positions[b]) for b in rows):
        return _attend_row(q, k, v, _runs(local_stream, stream_positions[0]), scale, enable_gqa, window, softcap)
    return torch.cat(
        [
            _attend_row(q[b : b + 1], k[b : b + 1], v[b : b + 1], _runs(local_stream, stream_positions[b]),
                        scale, enable_gqa, window, softcap)
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
    window: Optional[int] = None, softcap: Optional[float] = None,
) -> Tensor:
    with torch.no_grad():
        return _packed_attention_local(q, k, v, position_ids, scale, cp, enable_gqa, window, softcap).contiguous()


@torch.library.custom_op("hgraph::packed_attention_backward", mutates_args=())
def _packed_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool,
    enable_gqa: bool, window: Optional[int] = None, softcap: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with _autograd_inside_op():
        out = _packed_attention_local(*leaves, position_ids, scale, cp, enable_gqa, window, softcap)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_packed_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool, enable_gqa: bool,
      window: Optional[int] = None, softcap: Optional[float] = None) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@_packed_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: Optional[float], cp: bool,
      enable_gqa: bool, window: Optional[int] = None, softcap: Optional[float] = None
      ) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_attention(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.rc = _active()
    ctx.save_for_backward(*inputs[:4])
    ctx.args = inputs[4:]


def _attention_backward(ctx: Any, grad: Tensor) -> tuple:
    with _entered(ctx.rc):
        dq, dk, dv = torch.ops.hgraph.packed_attention_backward(grad, *ctx.saved_tensors, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


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
) -> Tensor:
    """Causal attention inside each packed sequence; a sequence starts where ``position_ids == 0``.

    ``window``: sliding-window attention (a query sees itself and the ``window - 1`` keys before it,
    Mistral's ``sliding_window``); ``softcap``: logits capped as ``softcap · tanh(logits / softcap)``
    (Gemma 2).

    q ``[b, hq, s, d]``, k/v ``[b, hkv, s, d]``, position_ids ``[b, s]``. Attention never crosses a
    sequence boundary, and each sequence is computed on its own (cost Σ lᵢ², never a (Σ lᵢ)² mask).
    With ``cp=True`` the sequence dim is split over the ``"cp"`` group with the load-balanced layout
    of ``load_balance_indices``; K, V and positions are gathered here (``hgraph.all_gather``; dK, dV
    are reduce-scattered back by its adjoint). On fake tensors without a rank context (shape
    propagation of the global graph) only the output's shape and dtype are computed.
    """
    shape_only = is_fake(q) and _active() is None
    if not is_fake(q) and position_ids.shape != (q.shape[0], q.shape[2]):
        raise ShardingRuleError(
            f"packed_attention: position_ids {tuple(position_ids.shape)} do not match q {tuple(q.shape)} "
            "(need [batch, seq])"
        )
    if cp and not shape_only:
        k = all_gather(k, "cp", 2, grad_partial=True)
        v = all_gather(v, "cp", 2, grad_partial=True)
        position_ids = torch.ops.hgraph.all_gather(position_ids.detach(), "cp", 1, False)
    return torch.ops.hgraph.packed_attention(
        q, k, v, position_ids, scale, cp and not shape_only, enable_gqa, window, softcap
    )
