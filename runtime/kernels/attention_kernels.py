"""Packed causal attention kernels, the variants they implement, and the one dispatch that chooses.

``hgraph.packed_attention`` (``runtime/kernels/packed_attention.py``) computes causal attention inside each
packed document (a document starts where ``position_ids == 0``). What it computes beyond that is an
``AttentionVariant`` (sliding window, logit soft-cap, ALiBi); every kernel reads the variant's terms
from that one class, and ``choose_kernel`` picks a kernel that implements all of them:

* ``"sdpa"`` — one ``scaled_dot_product_attention`` per document run, with the variant's mask (or the
  scores written out when the variant changes them): every variant, every device; the CPU kernel
  (no fused CPU kernel trains);
* ``"varlen"`` — ``torch.nn.attention.varlen.varlen_attn`` on CUDA in fp16/bf16: one flash kernel for
  the whole packed micro-batch, GQA native, the window as ``window_size=(window - 1, 0)``; it cannot
  change scores (no soft-cap, no ALiBi), so such variants go to flex;
* ``"flex"`` — FlexAttention with a document-causal block mask plus the variant's ``mask_mod`` and
  ``score_mod``: every variant; where varlen cannot serve (context parallelism: local queries against
  gathered keys; fp32; a variant varlen lacks).

FlexAttention runs compiled on CUDA (``torch.compile(flex_attention, dynamic=True)`` and a compiled
``create_block_mask``, as torchtitan does): eager flex writes out the full score matrix and a dense
mask, on exactly the longest sequences (context parallelism always takes flex). Elsewhere it runs
eagerly (CPU: measured in ``benchmarks/flex_bench.py``, the decision is in docs/attention.md);
``HGRAPH_FLEX_COMPILE=1|0`` forces either. A compile that fails is logged once as a warning and
FlexAttention runs eagerly from then on in this process (``CompiledFlex``).

``HGRAPH_ATTENTION_KERNEL=sdpa|varlen|flex`` forces one; a kernel that cannot serve the case (varlen off
CUDA or with a soft-cap, FlexAttention's backward on CPU) is an ``HGraphError`` naming the fix. The
backward of ``hgraph.packed_attention`` recomputes its forward with the same kernel and differentiates it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention import varlen as varlen_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from hgraph.errors import HGraphError

Tensor = torch.Tensor
KERNELS = ("sdpa", "varlen", "flex")
_ENV = "HGRAPH_ATTENTION_KERNEL"
FLEX_COMPILE_ENV = "HGRAPH_FLEX_COMPILE"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionVariant:
    """What one attention computes beyond "a query sees the keys of its document up to itself".

    Positions are positions inside the document (0 at its first token). Every kernel takes its mask
    from ``allows``, its score change from ``score``, and declares what it lacks in ``unsupported``.
    To add a variant: a field (its ``torch.library`` schema type in ``metadata["schema"]``; the
    ``hgraph::packed_attention`` ops take every field as an argument of that name), its term in
    ``allows``/``earliest_key``/``score``, and the kernels that cannot compute it in ``unsupported``.
    """

    window: Optional[int] = field(default=None, metadata={"schema": "int?"})
    softcap: Optional[float] = field(default=None, metadata={"schema": "float?"})
    chunk: Optional[int] = field(default=None, metadata={"schema": "int?"})
    sinks: Optional[Tensor] = field(default=None, metadata={"schema": "Tensor?"})
    # ALiBi (Bloom, MPT): one slope per query head; the score of query i and key j of one document gets
    # -slope_h * (i - j). A constant of the model (no gradient: not learned), cut with the heads under tp.
    alibi: Optional[Tensor] = field(default=None, compare=False, metadata={"schema": "Tensor?", "learned": False})

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise HGraphError(f"attention window={self.window}: a query sees itself, so the window is >= 1")
        if self.softcap is not None and not self.softcap > 0:
            raise HGraphError(f"attention softcap={self.softcap}: the cap is a positive number of logits")
        if self.chunk is not None and self.chunk < 1:
            raise HGraphError(f"attention chunk={self.chunk}: a chunk holds at least one token")
        if self.sinks is not None and self.sinks.dim() != 1:
            raise HGraphError(f"attention sinks of shape {tuple(self.sinks.shape)}: one logit per query head")
        if self.alibi is not None and (self.alibi.dim() != 1 or not self.alibi.is_floating_point()):
            raise HGraphError(f"attention alibi: one float slope per query head, got {self.alibi.dtype} "
                              f"{tuple(self.alibi.shape)}")

    def __str__(self) -> str:
        def text(value: Any) -> str:
            return f"[{value.shape[0]} heads]" if isinstance(value, Tensor) else str(value)

        terms = [f"{f.name}={text(getattr(self, f.name))}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) is not None]
        return ", ".join(terms) or "causal"

    def tensors(self) -> list[str]:
        """Names of the learned tensor fields that are set (sinks: their gradients are returned; ALiBi's
        slopes are constants of the model)."""
        return [f.name for f in dataclasses.fields(self)
                if f.metadata.get("learned", True) and isinstance(getattr(self, f.name), Tensor)]

    def op_args(self) -> tuple:
        """The fields in declaration order: the trailing arguments of the ``hgraph::`` attention ops."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def allows(self, query: Tensor, key: Tensor) -> Tensor:
        """Whether the query at document position ``query`` sees the key at ``key`` (broadcasting)."""
        allowed = key <= query
        if self.window is not None:  # Mistral's sliding_window: itself and the window - 1 keys before
            allowed = allowed & (query - key < self.window)
        if self.chunk is not None:  # Llama 4's attention_chunk_size: the keys of its own chunk of the document
            allowed = allowed & (torch.div(query, self.chunk, rounding_mode="floor")
                                 == torch.div(key, self.chunk, rounding_mode="floor"))
        return allowed

    def earliest_key(self, query: int) -> int:
        """The first document position the query at ``query`` may see (keys before it are cut for a run
        of queries starting there; later queries of the run are masked by ``allows``)."""
        first = max(0, query - self.window + 1) if self.window is not None else 0
        return max(first, query // self.chunk * self.chunk) if self.chunk is not None else first

    def narrows(self, length: int) -> bool:
        """Whether, in a document of ``length`` tokens, some key causality shows is hidden."""
        return any(limit is not None and limit < length for limit in (self.window, self.chunk))

    @property
    def changes_scores(self) -> bool:
        """Whether the kernel must write the scores out: logits changed (soft-cap, ALiBi) or the softmax
        normalised with extra terms (sinks)."""
        return self.softcap is not None or self.sinks is not None or self.alibi is not None

    def normalise(self, scores: Tensor, head: Tensor) -> Tensor:
        """Softmax over the keys (last dim) of masked logits; with ``sinks`` (gpt-oss) every query head
        also spreads probability over its own learned sink logit, which then takes no value."""
        if self.sinks is None:
            return torch.softmax(scores, dim=-1)
        sink = self.sinks.to(scores.dtype)[head.flatten()].reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]

    def score(self, scores: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        """The logits ``q·kᵀ·scale`` after the variant (query ``head``, document positions as in ``allows``)."""
        if self.softcap is not None:  # Gemma 2: softcap · tanh(logits / softcap)
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if self.alibi is not None:  # positions inside the document: the bias never spans the packed row
            scores = scores - self.alibi.to(device=scores.device, dtype=scores.dtype)[head] * (query - key)
        return scores

    def unsupported(self, kernel: str) -> tuple[str, ...]:
        """The fields ``kernel`` cannot compute for this variant (empty: it serves it)."""
        if kernel == "varlen":  # flash's varlen entry point masks windows but never changes scores
            return tuple(name for name in ("softcap", "chunk", "sinks", "alibi") if getattr(self, name) is not None)
        if kernel == "flex":  # no extra softmax terms in FlexAttention's score/mask mods
            return ("sinks",) if self.sinks is not None else ()
        return ()


PLAIN = AttentionVariant()
VARIANT_SCHEMA = ", ".join(f"{f.metadata['schema']} {f.name}=None" for f in dataclasses.fields(AttentionVariant))


def varlen_available() -> bool:
    return hasattr(varlen_module, "varlen_attn")


def choose_kernel(device: torch.device, dtype: torch.dtype, *, cp: bool = False, needs_grad: bool = True,
                  variant: AttentionVariant = PLAIN) -> str:
    """The kernel for packed attention of ``dtype`` tensors on ``device`` (module docstring)."""
    forced = os.environ.get(_ENV)
    if forced:
        if forced not in KERNELS:
            raise HGraphError(f"{_ENV}={forced!r}; expected one of {', '.join(KERNELS)}")
        _check(forced, device, dtype, cp, needs_grad, variant)
        return forced
    if device.type != "cuda":
        return "sdpa"
    if not cp and dtype in (torch.float16, torch.bfloat16) and varlen_available() and not variant.unsupported("varlen"):
        return "varlen"
    return "sdpa" if variant.unsupported("flex") else "flex"


def _check(kernel: str, device: torch.device, dtype: torch.dtype, cp: bool, needs_grad: bool,
           variant: AttentionVariant) -> None:
    if kernel == "varlen" and (device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or cp):
        raise HGraphError(
            f"{_ENV}=varlen needs CUDA fp16/bf16 tensors without context parallelism, got {device.type} "
            f"{dtype}{' with cp' if cp else ''}; unset {_ENV} or use 'sdpa' / 'flex'"
        )
    if kernel == "flex" and device.type == "cpu" and needs_grad:
        raise HGraphError(
            f"{_ENV}=flex: FlexAttention has no backward on CPU in this torch; use 'sdpa' for training on CPU"
        )
    missing = variant.unsupported(kernel)
    if missing:
        raise HGraphError(
            f"{_ENV}={kernel} cannot compute {', '.join(missing)} (attention {variant}); unset {_ENV} "
            f"(the dispatch picks a kernel that can) or use one of "
            f"{', '.join(k for k in KERNELS if not variant.unsupported(k))}"
        )


def document_positions(positions: Tensor) -> Tensor:
    """Each stream slot's position inside its document (``[b, S]``; documents start where positions are 0)."""
    index = torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)
    starts = torch.where(positions == 0, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - starts


def attend(kernel: str, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, query_stream: Tensor,
           scale: Optional[float], enable_gqa: bool, variant: AttentionVariant) -> Tensor:
    """q ``[b, hq, s_q, d]`` (stream slots ``query_stream``) against the stream's k/v ``[b, hkv, S, d]``
    whose documents start where ``positions`` (``[b, S]``) is 0, with ``kernel``."""
    if kernel == "varlen":
        return varlen(q, k, v, positions, scale, enable_gqa, variant)
    if kernel == "flex":
        return flex(q, k, v, positions, query_stream, scale, enable_gqa, variant)
    return sdpa(q, k, v, positions, query_stream, scale, enable_gqa, variant)


# ----------------------------------------------------------------------------- sdpa: per document run
def _runs(stream: Tensor, positions: Tensor) -> list[tuple[int, int, int, int]]:
    """Maximal runs of local queries at consecutive stream slots of one document.

    ``stream[i]``: stream slot of local query i; ``positions``: the position ids of one row. Returns
    ``(local_start, local_end, document_start, key_end)``: the run's queries are the stream slots
    ``[key_end - (local_end - local_start), key_end)`` of the document starting at ``document_start``.
    """
    index = torch.arange(len(positions), device=positions.device)
    starts = torch.where(positions == 0, index, torch.zeros_like(index)).cummax(dim=0).values[stream]
    breaks = ((stream[1:] != stream[:-1] + 1) | (starts[1:] != starts[:-1])).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), len(stream)]
    return [(lo, hi, int(starts[lo]), int(stream[hi - 1]) + 1) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _attend_run(q: Tensor, k: Tensor, v: Tensor, first_query: int, first_key: int, scale: Optional[float],
                enable_gqa: bool, variant: AttentionVariant) -> Tensor:
    """Queries at document positions ``first_query…`` against keys at ``first_key…`` (both contiguous)."""
    queries, keys = q.shape[2], k.shape[2]
    if not variant.changes_scores and first_key == first_query and not variant.narrows(keys):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    query_pos = torch.arange(first_query, first_query + queries, device=q.device)[:, None]
    key_pos = torch.arange(first_key, first_key + keys, device=q.device)[None, :]
    allowed = variant.allows(query_pos, key_pos)
    if not variant.changes_scores:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    head = torch.arange(q.shape[1], device=q.device)[:, None, None]
    accumulate = torch.promote_types(q.dtype, torch.float32)  # logits and softmax in fp32, as fused kernels
    logits = q.to(accumulate) @ k.to(accumulate).transpose(-1, -2) * scale
    scores = variant.score(logits, head, query_pos, key_pos)
    return variant.normalise(scores.masked_fill(~allowed, float("-inf")), head).to(v.dtype) @ v


def _attend_row(q: Tensor, k: Tensor, v: Tensor, runs: list, scale: Optional[float], enable_gqa: bool,
                variant: AttentionVariant) -> Tensor:
    outputs = []
    for lo, hi, document_start, key_end in runs:
        first_query = key_end - (hi - lo) - document_start
        first_key = variant.earliest_key(first_query)
        keys = slice(document_start + first_key, key_end)
        outputs.append(_attend_run(q[:, :, lo:hi], k[:, :, keys], v[:, :, keys], first_query, first_key,
                                   scale, enable_gqa, variant))
    return torch.cat(outputs, dim=2)


def sdpa(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, query_stream: Tensor, scale: Optional[float],
         enable_gqa: bool, variant: AttentionVariant = PLAIN) -> Tensor:
    """One attention per run of a document's queries (cost Σ lᵢ², never a (Σ lᵢ)² mask); rows that
    share their packing are computed together."""
    rows = range(q.shape[0])
    if all(torch.equal(positions[0], positions[b]) for b in rows):
        return _attend_row(q, k, v, _runs(query_stream, positions[0]), scale, enable_gqa, variant)
    return torch.cat([
        _attend_row(q[b : b + 1], k[b : b + 1], v[b : b + 1], _runs(query_stream, positions[b]), scale,
                    enable_gqa, variant)
        for b in rows
    ], dim=0)


# ----------------------------------------------------------------------------- varlen and flex
def cu_seqlens(positions: Tensor) -> tuple[Tensor, int]:
    """Cumulative sequence starts (int32, ``[n + 1]``) and the longest sequence of a packed
    ``[batch, seq]`` position-id tensor, rows flattened; computed once per tensor (kept on it, keyed
    by its version, so every layer reuses it and an in-place change recomputes it)."""
    cached = getattr(positions, "_hgraph_cu_seqlens", None)
    if cached is not None and cached[0] == positions._version:
        return cached[1], cached[2]
    rows, seq = positions.shape
    starts = positions.reshape(-1) == 0
    starts[::seq] = True  # every row starts a sequence
    index = starts.nonzero().flatten()
    cu = torch.cat([index, index.new_tensor([rows * seq])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    positions._hgraph_cu_seqlens = (positions._version, cu, longest)
    return cu, longest


def varlen(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: Optional[float], enable_gqa: bool,
           variant: AttentionVariant = PLAIN) -> Tensor:
    """q ``[b, hq, s, d]``, k/v ``[b, hkv, s, d]``: all rows' documents in one varlen kernel."""
    missing = variant.unsupported("varlen")
    if missing:
        raise HGraphError(f"varlen attention cannot compute {', '.join(missing)} ({variant}); use flex or sdpa")
    b, hq, s, d = q.shape
    cu, longest = cu_seqlens(positions)
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3])  # noqa: E731
    left = variant.window - 1 if variant.window is not None else -1  # flash: keys i - left … i
    out = varlen_module.varlen_attn(flat(q), flat(k), flat(v), cu, cu, longest, longest, scale=scale,
                                    window_size=(left, 0), enable_gqa=enable_gqa)
    return out.reshape(b, s, hq, -1).transpose(1, 2)


def flex(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, query_stream: Tensor, scale: Optional[float],
         enable_gqa: bool, variant: AttentionVariant = PLAIN) -> Tensor:
    """FlexAttention: query ``i`` is stream slot ``query_stream[i]`` of the keys' stream; the block mask
    is document-causal and the variant's ``allows``, the score modification its ``score``."""
    document = (positions == 0).cumsum(-1)
    in_document = document_positions(positions)
    query_stream = query_stream.to(q.device)

    def mask(b, h, qi, ki):  # noqa: ANN001 - FlexAttention's mask_mod signature
        stream = query_stream[qi]
        same = document[b, stream] == document[b, ki]
        return same & variant.allows(in_document[b, stream], in_document[b, ki])

    def score(scores, b, h, qi, ki):  # noqa: ANN001 - FlexAttention's score_mod signature
        return variant.score(scores, h, in_document[b, query_stream[qi]], in_document[b, ki])

    make_mask, attention = FLEX.functions(q.device)
    block = make_mask(mask, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    if not torch.is_grad_enabled():  # no graph is recorded; FlexAttention on CPU refuses leaves needing grad
        q, k, v = q.detach(), k.detach(), v.detach()
    return attention(q, k, v, score_mod=score if variant.changes_scores else None, block_mask=block,
                     scale=scale, enable_gqa=enable_gqa)


class CompiledFlex:
    """``create_block_mask`` and ``flex_attention`` under ``torch.compile(dynamic=True)`` where they
    should be compiled (``compiles``), eager elsewhere. The compiled functions are made on first use;
    a call whose compile fails (no Triton, no C++ compiler, an unsupported mask) is logged once as a
    warning, runs eagerly, and so does every later call (``failure`` says why). One per process
    (``FLEX``): torch.compile's caches are the process's."""

    def __init__(self, backend: Union[str, Callable[..., Any]] = "inductor") -> None:
        self.backend = backend
        self.failure: Optional[str] = None
        self._compiled: dict[str, Callable[..., Any]] = {}

    def compiles(self, device: torch.device) -> bool:
        """Whether FlexAttention on ``device`` runs compiled: CUDA unless ``HGRAPH_FLEX_COMPILE`` says
        otherwise, and no compile has failed in this process."""
        forced = os.environ.get(FLEX_COMPILE_ENV)
        if forced not in (None, "", "0", "1"):
            raise HGraphError(f"{FLEX_COMPILE_ENV}={forced!r}; expected 1 (compile FlexAttention), 0 (run it "
                              "eagerly) or unset (compile on CUDA only)")
        wanted = device.type == "cuda" if forced in (None, "") else forced == "1"
        return wanted and self.failure is None

    def functions(self, device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``(create_block_mask, flex_attention)`` for tensors on ``device``."""
        if not self.compiles(device):
            return create_block_mask, flex_attention
        return (lambda *a, **kw: self._call(create_block_mask, a, kw),
                lambda *a, **kw: self._call(flex_attention, a, kw))

    def _call(self, eager: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.failure is None:
            name = eager.__name__
            try:
                if name not in self._compiled:
                    self._compiled[name] = torch.compile(eager, dynamic=True, backend=self.backend)
                return self._compiled[name](*args, **kwargs)
            except torch.OutOfMemoryError:
                raise  # eager flex needs more memory, not less
            except Exception as exc:  # noqa: BLE001 - any compile failure: fall back, said once
                self.failure = f"compiling {name} failed ({_cause(exc)})"
                log.warning("%s; FlexAttention runs eagerly from now on in this process, writing out the full "
                            "score matrix (set %s=0 to skip compiling, or fix the torch.compile backend)",
                            self.failure, FLEX_COMPILE_ENV)
        return eager(*args, **kwargs)


def _cause(exc: BaseException) -> str:
    """``Type: first line`` of the exception and of its root cause (torch.compile wraps the backend's
    error in ``BackendCompilerFailed.inner_exception``)."""
    root, seen = exc, {id(exc)}
    while True:
        inner = root.__cause__ or getattr(root, "inner_exception", None) or root.__context__
        if not isinstance(inner, BaseException) or id(inner) in seen:
            break
        root = inner
        seen.add(id(inner))
    text = [f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}" for e in dict.fromkeys((exc, root))]
    return " <- ".join(text)


FLEX = CompiledFlex()
