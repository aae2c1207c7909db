"""The packed-attention dispatch: which kernel serves which case, and the kernels against each other
(FlexAttention's forward runs on CPU; varlen only on CUDA, checked there)."""

import pytest
import torch
import torch.nn.functional as F

from hgraph.errors import HGraphError
from hgraph.runtime import attention_kernels as kernels
from hgraph.runtime import ops
from hgraph.runtime import packed_attention as packed_attention_module

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_choose_kernel_by_device_and_construct(monkeypatch):
    monkeypatch.delenv("HGRAPH_ATTENTION_KERNEL", raising=False)
    assert kernels.choose_kernel(CPU, torch.float32) == "sdpa"
    assert kernels.choose_kernel(CPU, torch.bfloat16, cp=True) == "sdpa"
    assert kernels.choose_kernel(CUDA, torch.bfloat16) == "varlen"
    assert kernels.choose_kernel(CUDA, torch.float16) == "varlen"
    assert kernels.choose_kernel(CUDA, torch.float32) == "flex"  # varlen is flash: half precision only
    assert kernels.choose_kernel(CUDA, torch.bfloat16, cp=True) == "flex"  # gathered keys, local queries


def test_alibi_never_takes_varlen(monkeypatch):
    """varlen_attn has no score bias: ALiBi falls back to FlexAttention, forcing varlen is refused."""
    monkeypatch.delenv("HGRAPH_ATTENTION_KERNEL", raising=False)
    assert kernels.choose_kernel(CUDA, torch.bfloat16, alibi=True) == "flex"
    assert kernels.choose_kernel(CPU, torch.float32, alibi=True) == "sdpa"
    monkeypatch.setenv("HGRAPH_ATTENTION_KERNEL", "varlen")
    with pytest.raises(HGraphError, match="ALiBi"):
        kernels.choose_kernel(CUDA, torch.bfloat16, alibi=True)


def test_forcing_a_kernel(monkeypatch):
    monkeypatch.setenv("HGRAPH_ATTENTION_KERNEL", "flex")
    assert kernels.choose_kernel(CPU, torch.float32, needs_grad=False) == "flex"
    with pytest.raises(HGraphError, match="no backward on CPU"):
        kernels.choose_kernel(CPU, torch.float32, needs_grad=True)
    monkeypatch.setenv("HGRAPH_ATTENTION_KERNEL", "varlen")
    with pytest.raises(HGraphError, match="needs CUDA fp16/bf16"):
        kernels.choose_kernel(CPU, torch.bfloat16)
    monkeypatch.setenv("HGRAPH_ATTENTION_KERNEL", "fast")
    with pytest.raises(HGraphError, match="HGRAPH_ATTENTION_KERNEL='fast'"):
        kernels.choose_kernel(CPU, torch.float32)


def test_cu_seqlens_from_position_ids():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5, 6]])
    cu, longest = kernels.cu_seqlens(positions)
    assert cu.tolist() == [0, 3, 5, 9, 11, 18] and cu.dtype == torch.int32
    assert longest == 7
    assert kernels.cu_seqlens(positions)[0] is cu  # built once, shared by every layer


def _packed(lengths, batch=1):
    return torch.cat([torch.arange(n) for n in lengths]).expand(batch, -1)


def _by_hand(q, k, v, lengths):
    """Per-sequence causal SDPA, written out independently of hgraph."""
    out, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        out.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                  enable_gqa=True))
        start += n
    return torch.cat(out, dim=2)


def _alibi_by_hand(q, k, v, lengths, slopes):
    """Per-sequence causal attention with ALiBi ``-slope_h (i - j)``, i and j counted inside the
    sequence, written out independently of hgraph."""
    out, start = [], 0
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    for n in lengths:
        sl = slice(start, start + n)
        i = torch.arange(n)
        bias = -slopes[:, None, None] * (i[:, None] - i[None, :])
        scores = q[:, :, sl] @ k[:, :, sl].transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
        scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
        out.append(torch.softmax(scores, -1) @ v[:, :, sl])
        start += n
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("cp_rank", [None, 0, 1])
def test_alibi_stays_inside_each_sequence(monkeypatch, cp_rank):
    """The bias depends on i - j within a sequence only, and no query sees another sequence's keys:
    sdpa (the CPU kernel), with local queries of a cp rank against the gathered stream too, and flex."""
    torch.manual_seed(0)
    lengths = (7, 20, 1, 12)
    s = sum(lengths)
    q, k, v = torch.randn(1, 4, s, 8), torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    want = _alibi_by_hand(q, k, v, lengths, slopes)
    chosen = torch.arange(s) if cp_rank is None else ops.load_balance_indices(s, 2, cp_rank)
    runs = packed_attention_module._runs(chosen, _packed(lengths)[0])
    monkeypatch.delenv("HGRAPH_ATTENTION_KERNEL", raising=False)
    with torch.no_grad():
        sdpa = packed_attention_module._attend_row(q[:, :, chosen], k, v, runs, None, True, alibi=slopes)
        flex = kernels.flex(q[:, :, chosen], k, v, _packed(lengths), chosen, None, True, slopes)
    torch.testing.assert_close(sdpa, want[:, :, chosen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex, want[:, :, chosen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [(5, 11, 16), (32,), (1, 2, 29)])
def test_flex_document_mask_matches_per_sequence_sdpa_on_cpu(monkeypatch, lengths):
    torch.manual_seed(0)
    s = sum(lengths)
    q, k, v = torch.randn(1, 4, s, 8), torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8)
    positions = _packed(lengths)
    want = _by_hand(q, k, v, lengths)
    monkeypatch.delenv("HGRAPH_ATTENTION_KERNEL", raising=False)
    with torch.no_grad():
        sdpa = packed_attention_module._packed_attention_local(q, k, v, positions, None, False, True)
        monkeypatch.setenv("HGRAPH_ATTENTION_KERNEL", "flex")
        flex = packed_attention_module._packed_attention_local(q, k, v, positions, None, False, True)
    torch.testing.assert_close(sdpa, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flex, want, rtol=1e-5, atol=1e-5)


def test_flex_with_local_queries_against_gathered_keys_on_cpu():
    """The context-parallel case: queries are a subset of the stream (load-balanced chunks)."""
    torch.manual_seed(0)
    lengths = (12, 20)
    s = sum(lengths)
    q, k, v = torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8)
    chosen = ops.load_balance_indices(s, 2, 1)
    with torch.no_grad():
        got = kernels.flex(q[:, :, chosen], k, v, _packed(lengths), chosen, None, False)
    torch.testing.assert_close(got, _by_hand(q, k, v, lengths)[:, :, chosen], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen_attn runs on CUDA only")
def test_varlen_matches_per_sequence_sdpa_on_cuda():
    torch.manual_seed(0)
    lengths = (37, 100, 3, 116)
    s = sum(lengths)
    q, k, v = (torch.randn(1, h, s, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    got = kernels.varlen(q, k, v, _packed(lengths).cuda(), None, True)
    torch.testing.assert_close(got.float(), _by_hand(q.float(), k.float(), v.float(), lengths),
                               rtol=2e-2, atol=2e-2)
