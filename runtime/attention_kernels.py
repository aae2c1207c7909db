"""Packed causal attention kernels and the one dispatch point that chooses among them.

``hgraph.packed_attention`` (``runtime/ops.py``) computes causal attention inside each packed sequence
(a sequence starts where ``position_ids == 0``). ``choose_kernel`` picks how, by device and construct:

* ``"sdpa"`` — one ``scaled_dot_product_attention`` per sequence run (``ops._attend_row``): the CPU
  kernel (no fused CPU kernel trains), and the reference the others are tested against;
* ``"varlen"`` — ``torch.nn.attention.varlen.varlen_attn`` on CUDA in fp16/bf16: one kernel for the
  whole packed micro-batch, causal through ``window_size=(-1, 0)``, GQA native; ``cu_seqlens`` are
  built from ``position_ids`` once per micro-batch (cached on the tensor, which every layer shares);
* ``"flex"`` — FlexAttention with a document-causal block mask, where varlen cannot serve: context
  parallelism (local queries against gathered keys), fp32 on CUDA, ALiBi (a ``score_mod``; varlen
  has no bias).

``HGRAPH_ATTENTION_KERNEL=sdpa|varlen|flex`` forces one; a kernel that cannot serve the case (varlen
off CUDA, FlexAttention's backward on CPU) is an ``HGraphError`` naming the fix. The backward of
``hgraph.packed_attention`` recomputes its forward with the same kernel and differentiates it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from hgraph.errors import HGraphError

KERNELS = ("sdpa", "varlen", "flex")
_ENV = "HGRAPH_ATTENTION_KERNEL"


def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def choose_kernel(
    device: torch.device, dtype: torch.dtype, *, cp: bool = False, needs_grad: bool = True, alibi: bool = False
) -> str:
    """The kernel for packed attention of ``dtype`` tensors on ``device`` (module docstring)."""
    forced = os.environ.get(_ENV)
    if forced:
        if forced not in KERNELS:
            raise HGraphError(f"{_ENV}={forced!r}; expected one of {', '.join(KERNELS)}")
        _check(forced, device, dtype, cp, needs_grad, alibi)
        return forced
    if device.type != "cuda":
        return "sdpa"
    if not cp and not alibi and dtype in (torch.float16, torch.bfloat16) and varlen_available():
        return "varlen"
    return "flex"


def _check(kernel: str, device: torch.device, dtype: torch.dtype, cp: bool, needs_grad: bool, alibi: bool) -> None:
    if kernel == "varlen" and (device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or cp or alibi):
        raise HGraphError(
            f"{_ENV}=varlen needs CUDA fp16/bf16 tensors without context parallelism or ALiBi, got {device.type} "
            f"{dtype}{' with cp' if cp else ''}{' with ALiBi' if alibi else ''}; unset {_ENV} or use 'sdpa' / 'flex'"
        )
    if kernel == "flex" and device.type == "cpu" and needs_grad:
        raise HGraphError(
            f"{_ENV}=flex: FlexAttention has no backward on CPU in this torch; use 'sdpa' for training on CPU"
        )


def cu_seqlens(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
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


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
           scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
    """q ``[b, hq, s, d]``, k/v ``[b, hkv, s, d]``: all rows' sequences in one varlen kernel."""
    from torch.nn.attention.varlen import varlen_attn

    b, hq, s, d = q.shape
    cu, longest = cu_seqlens(positions)
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3])  # noqa: E731
    out = varlen_attn(flat(q), flat(k), flat(v), cu, cu, longest, longest, scale=scale,
                      window_size=(-1, 0), enable_gqa=enable_gqa)
    return out.reshape(b, s, hq, -1).transpose(1, 2)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, query_stream: torch.Tensor,
         scale: Optional[float], enable_gqa: bool, alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FlexAttention with a document-causal mask: query ``i`` is stream position ``query_stream[i]``
    of the keys' stream, whose sequences start where ``positions`` (``[b, S]``) is 0; ``alibi``
    (``[hq]`` slopes) as a ``score_mod``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    document = (positions == 0).cumsum(-1)
    query_stream = query_stream.to(q.device)

    def document_causal(b, h, qi, ki):  # noqa: ANN001 - FlexAttention's mask_mod signature
        stream = query_stream[qi]
        return (document[b, stream] == document[b, ki]) & (stream >= ki)

    score_mod = None
    if alibi is not None:
        slopes = alibi.to(device=q.device, dtype=torch.float32)

        def score_mod(score, b, h, qi, ki):  # noqa: ANN001 - FlexAttention's score_mod signature
            return score - slopes[h] * (query_stream[qi] - ki)

    block = create_block_mask(document_causal, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block, scale=scale, enable_gqa=enable_gqa)
