"""The packed-attention kernels and their dispatch: every kernel computes every attention variant.

The oracle is dense attention over each document on its own, written out here (logits, soft-cap,
causal and window mask, softmax), never hgraph's kernels. On CPU the SDPA kernel runs forward and
backward and FlexAttention forward (its backward has no CPU implementation in this torch, which a test
pins); varlen is CUDA-only, so its arguments are checked against a stand-in that implements
``varlen_attn``'s documented contract, and the real kernel on CUDA (and in ``benchmarks/gpu_bench.py``).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from hgraph.core.batch import pack_micro_batch
from hgraph.errors import HGraphError
from hgraph.frontend import trace
from hgraph.runtime.kernels import attention_kernels as kernels
from hgraph.core.batch import load_balance_indices
from hgraph.runtime.kernels.packed_attention import packed_attention
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.kernels.context import RankContext
from hgraph.models.zoo import zoo_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
ENV = "HGRAPH_ATTENTION_KERNEL"
# ALiBi slopes of the 4 query heads (Bloom's for 4 heads)
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
# (window, softcap, alibi): plain causal, a window shorter than some documents and longer than others,
# a window of one token, soft-capping, both, ALiBi, and ALiBi with a window.
VARIANTS = [(None, None, None), (4, None, None), (1, None, None), (None, 2.0, None), (3, 1.5, None),
            (None, None, SLOPES), (4, None, SLOPES)]
VARIANT_IDS = ["causal", "window4", "window1", "softcap", "window3-softcap", "alibi", "window4-alibi"]
# Two rows packed differently (documents of 1 token, one longer than every window), and two rows
# packed alike (computed together).
PACKINGS = [[[5, 1, 9, 3], [7, 11]], [[6, 12], [6, 12]]]


def dense_per_document(q, k, v, packing, window, softcap, scale=None, alibi=None):
    """Attention of each document of each row on its own, as dense matrices (ALiBi: the score of
    query i and key j of the document gets -slope_h (i - j))."""
    repeat = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = []
    for b, lengths in enumerate(packing):
        outs, start = [], 0
        for n in lengths:
            doc = slice(start, start + n)
            qd = q[b, :, doc]
            kd, vd = k[b, :, doc].repeat_interleave(repeat, 0), v[b, :, doc].repeat_interleave(repeat, 0)
            logits = qd @ kd.transpose(-1, -2) * scale
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            i = torch.arange(n)
            if alibi is not None:
                logits = logits - alibi.to(logits.dtype)[:, None, None] * (i[:, None] - i[None, :])
            visible = i[None, :] <= i[:, None]
            if window is not None:
                visible &= i[:, None] - i[None, :] < window
            outs.append(logits.masked_fill(~visible, float("-inf")).softmax(-1) @ vd)
            start += n
        rows.append(torch.cat(outs, dim=1))
    return torch.stack(rows)


def positions_of(packing):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in packing])


def inputs(packing, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = sum(packing[0])
    return [torch.randn(len(packing), h, s, d, generator=g, dtype=dtype).requires_grad_(True)
            for h in (hq, hkv, hkv)]


def variant_kwargs(window, softcap, alibi=None):
    return {k: v for k, v in (("window", window), ("softcap", softcap), ("alibi", alibi)) if v is not None}


# ----------------------------------------------------------------------------- every kernel, every variant
@pytest.mark.parametrize("packing", PACKINGS, ids=str)
@pytest.mark.parametrize("window, softcap, alibi", VARIANTS, ids=VARIANT_IDS)
def test_sdpa_kernel_forward_and_backward_equal_dense_attention_per_document(monkeypatch, packing, window,
                                                                             softcap, alibi):
    monkeypatch.setenv(ENV, "sdpa")
    q, k, v = inputs(packing)
    out = packed_attention(q, k, v, positions_of(packing), enable_gqa=True, **variant_kwargs(window, softcap, alibi))
    want = dense_per_document(q, k, v, packing, window, softcap, alibi=alibi)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("packing", PACKINGS, ids=str)
@pytest.mark.parametrize("window, softcap, alibi", VARIANTS, ids=VARIANT_IDS)
def test_flex_kernel_forward_equals_dense_attention_per_document(monkeypatch, packing, window, softcap, alibi):
    monkeypatch.setenv(ENV, "flex")
    q, k, v = inputs(packing, dtype=torch.float32)
    out = packed_attention(q, k, v, positions_of(packing), enable_gqa=True, **variant_kwargs(window, softcap, alibi))
    torch.testing.assert_close(out, dense_per_document(q, k, v, packing, window, softcap, alibi=alibi),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(HGraphError, match="no backward on CPU"):  # the recompute inside the backward op
        out.sum().backward()


def test_flex_attention_has_no_backward_on_cpu_in_this_torch():
    """Why flex is tested forward-only on CPU; when torch adds the backward, this fails: test it then."""
    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    block = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, None, 16, 16, device="cpu")
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q, block_mask=block).sum().backward()


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("window, softcap, alibi", VARIANTS, ids=VARIANT_IDS)
def test_kernels_with_local_queries_against_gathered_keys(kernel, window, softcap, alibi):
    """The context-parallel case: the queries are a load-balanced subset of the stream."""
    packing = [[12, 20], [25, 7]]
    q, k, v = (t.detach().float() for t in inputs(packing))
    chosen = load_balance_indices(32, 2, 1)
    variant = kernels.AttentionVariant(window=window, softcap=softcap, alibi=alibi)
    with torch.no_grad():
        got = kernels.attend(kernel, q[:, :, chosen], k, v, positions_of(packing), chosen, None, True, variant)
    want = dense_per_document(q, k, v, packing, window, softcap, alibi=alibi)[:, :, chosen]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, softcap, alibi", [(4, None, None), (3, 1.5, None), (None, None, SLOPES)],
                         ids=["window4", "window3-softcap", "alibi"])
def test_context_parallel_attention_with_a_variant_on_two_ranks(window, softcap, alibi):
    """Forward and backward of ``packed_attention(cp=True)`` on two thread ranks against the oracle."""
    packing = [[5, 1, 7, 3], [16]]
    q, k, v = inputs(packing)
    want = dense_per_document(q, k, v, packing, window, softcap, alibi=alibi)
    grad = torch.randn_like(want)
    dq, dk, dv = torch.autograd.grad(want, (q, k, v), grad)
    positions = positions_of(packing)

    def body(comm):
        rc = RankContext(comm.rank, comm, {"cp": (0, 1)})
        idx = load_balance_indices(16, 2, comm.rank)
        lq, lk, lv = (t.detach()[:, :, idx].requires_grad_(True) for t in (q, k, v))
        out = packed_attention(lq, lk, lv, positions[:, idx], cp=True, enable_gqa=True, rank_context=rc,
                               **variant_kwargs(window, softcap, alibi))
        return (idx, out, *torch.autograd.grad(out, (lq, lk, lv), grad[:, :, idx]))

    for idx, out, gq, gk, gv in run_threads(body, 2, timeout=60):
        torch.testing.assert_close(out, want[:, :, idx])
        for got, expected in ((gq, dq), (gk, dk), (gv, dv)):
            torch.testing.assert_close(got, expected[:, :, idx])


# ----------------------------------------------------------------------------- varlen (CUDA only)
def varlen_contract(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False):
    """``varlen_attn`` as its docstring defines it: sequences ``cu[i]:cu[i+1]`` of ``[T, H, D]``
    tensors; query ``i`` sees keys ``i - left … i + right`` of its sequence (-1: unbounded)."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k
    assert cu_q.dtype == torch.int32 and int(cu_q[-1]) == query.shape[0]
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
    left, right = window_size
    outs = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (query, key, value))
        ks = ks.repeat_interleave(qs.shape[0] // ks.shape[0], 0) if enable_gqa else ks
        vs = vs.repeat_interleave(qs.shape[0] // vs.shape[0], 0) if enable_gqa else vs
        i = torch.arange(b - a)
        seen = torch.ones(b - a, b - a, dtype=torch.bool)
        if left >= 0:
            seen &= i[None, :] >= i[:, None] - left
        if right >= 0:
            seen &= i[None, :] <= i[:, None] + right
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 4, 1])
def test_varlen_receives_the_documents_and_the_window(monkeypatch, window):
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(kwargs)
        return varlen_contract(*args, **kwargs)

    monkeypatch.setattr(kernels.varlen_module, "varlen_attn", stand_in)
    packing = PACKINGS[0]
    q, k, v = (t.detach() for t in inputs(packing))
    got = kernels.varlen(q, k, v, positions_of(packing), 0.3, True, kernels.AttentionVariant(window=window))
    assert calls == [{"scale": 0.3, "window_size": (window - 1 if window else -1, 0), "enable_gqa": True}]
    torch.testing.assert_close(got, dense_per_document(q, k, v, packing, window, None, scale=0.3))


def test_varlen_refuses_what_it_cannot_compute_and_the_dispatch_avoids_it(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    softcap = kernels.AttentionVariant(softcap=2.0)
    alibi = kernels.AttentionVariant(alibi=SLOPES)
    assert kernels.choose_kernel(CUDA, torch.bfloat16, variant=kernels.AttentionVariant(window=8)) == "varlen"
    assert kernels.choose_kernel(CUDA, torch.bfloat16, variant=softcap) == "flex"
    assert kernels.choose_kernel(CUDA, torch.bfloat16, variant=alibi) == "flex"  # varlen has no score bias
    assert kernels.choose_kernel(CPU, torch.bfloat16, variant=softcap) == "sdpa"
    monkeypatch.setenv(ENV, "varlen")
    with pytest.raises(HGraphError, match="varlen cannot compute softcap .*use one of sdpa, flex"):
        kernels.choose_kernel(CUDA, torch.bfloat16, variant=softcap)
    with pytest.raises(HGraphError, match="varlen cannot compute alibi .*use one of sdpa, flex"):
        kernels.choose_kernel(CUDA, torch.bfloat16, variant=alibi)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(HGraphError, match="cannot compute softcap"):
        kernels.varlen(q, q, q, torch.arange(4)[None], None, False, softcap)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen_attn runs on CUDA only")
@pytest.mark.parametrize("window", [None, 4, 50])
def test_varlen_matches_dense_attention_per_document_on_cuda(window):
    packing = [[37, 100, 3, 116]]
    q, k, v = (t.detach().cuda().bfloat16() for t in inputs(packing, hq=8, hkv=2, d=64))
    got = kernels.varlen(q, k, v, positions_of(packing).cuda(), None, True, kernels.AttentionVariant(window=window))
    want = dense_per_document(q.double(), k.double(), v.double(), packing, window, None)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- dispatch
def test_choose_kernel_by_device_and_construct(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert kernels.choose_kernel(CPU, torch.float32) == "sdpa"
    assert kernels.choose_kernel(CPU, torch.bfloat16, cp=True) == "sdpa"
    assert kernels.choose_kernel(CUDA, torch.bfloat16) == "varlen"
    assert kernels.choose_kernel(CUDA, torch.float16) == "varlen"
    assert kernels.choose_kernel(CUDA, torch.float32) == "flex"  # varlen is flash: half precision only
    assert kernels.choose_kernel(CUDA, torch.bfloat16, cp=True) == "flex"  # gathered keys, local queries


def test_forcing_a_kernel(monkeypatch):
    monkeypatch.setenv(ENV, "flex")
    assert kernels.choose_kernel(CPU, torch.float32, needs_grad=False) == "flex"
    with pytest.raises(HGraphError, match="no backward on CPU"):
        kernels.choose_kernel(CPU, torch.float32, needs_grad=True)
    monkeypatch.setenv(ENV, "varlen")
    with pytest.raises(HGraphError, match="needs CUDA fp16/bf16"):
        kernels.choose_kernel(CPU, torch.bfloat16)
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(HGraphError, match="HGRAPH_ATTENTION_KERNEL='fast'"):
        kernels.choose_kernel(CPU, torch.float32)


def test_variant_values_and_names_are_checked():
    with pytest.raises(HGraphError, match="window=0"):
        kernels.AttentionVariant(window=0)
    with pytest.raises(HGraphError, match="softcap=-1"):
        kernels.AttentionVariant(softcap=-1.0)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(HGraphError, match="unknown attention variant ring; the variants are window, softcap, chunk, sinks, alibi"):
        packed_attention(q, q, q, torch.arange(4)[None], ring=q)
    with pytest.raises(HGraphError, match=r"attention sinks of shape \(1, 2, 4, 8\): one logit per query head"):
        packed_attention(q, q, q, torch.arange(4)[None], sinks=q)
    with pytest.raises(HGraphError, match="chunk=0"):
        kernels.AttentionVariant(chunk=0)
    with pytest.raises(HGraphError, match=r"ALiBi slopes for 2 query heads"):
        packed_attention(q, q, q, torch.arange(4)[None], alibi=SLOPES)
    assert str(kernels.AttentionVariant(window=4, softcap=2.0)) == "window=4, softcap=2.0"
    assert str(kernels.AttentionVariant(alibi=SLOPES)) == "alibi=[4 heads]"


def test_cu_seqlens_from_position_ids():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5, 6]])
    cu, longest = kernels.cu_seqlens(positions)
    assert cu.tolist() == [0, 3, 5, 9, 11, 18] and cu.dtype == torch.int32
    assert longest == 7
    assert kernels.cu_seqlens(positions)[0] is cu  # built once, shared by every layer


# ----------------------------------------------------------------------------- a model users load
@pytest.mark.parametrize("family", ["mistral", "gemma2", "bloom", "mpt"])
def test_windowed_and_softcapped_families_equal_the_model_per_document(monkeypatch, family):
    """The issue's case: Mistral (window 8) and Gemma 2 (window 8, soft-caps) on packed documents
    longer than the window, and the ALiBi families (Bloom, MPT), forward through the traced program
    with each CPU kernel, against the unmodified model run on each document alone."""
    model = zoo_model(family).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (23, 5, 12)]
    mb = pack_micro_batch(docs)
    traced = trace(model, docs[0][None, :4])
    with torch.no_grad():
        want = sum(F.cross_entropy(model(d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
        for kernel in ("sdpa", "flex"):
            monkeypatch.setenv(ENV, kernel)
            got = traced.run(mb["input_ids"], mb["position_ids"], mb["targets"])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=kernel)


# ----------------------------------------------------------------------------- chunked attention, sinks
def dense_chunk_sinks(q, k, v, packing, chunk, sinks, scale=None):
    """Each document alone, dense: Llama 4's chunks (a query sees the earlier keys of its chunk of the
    document) and gpt-oss's sinks (a per-head logit in every softmax that takes no value)."""
    repeat = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = []
    for b, lengths in enumerate(packing):
        outs, start = [], 0
        for n in lengths:
            doc = slice(start, start + n)
            kd, vd = k[b, :, doc].repeat_interleave(repeat, 0), v[b, :, doc].repeat_interleave(repeat, 0)
            logits = q[b, :, doc] @ kd.transpose(-1, -2) * scale
            i = torch.arange(n)
            visible = i[None, :] <= i[:, None]
            if chunk is not None:
                visible &= (i[:, None] // chunk) == (i[None, :] // chunk)
            logits = logits.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                column = sinks[:, None, None].expand(-1, n, 1)
                probs = torch.cat([logits, column], -1).softmax(-1)[..., :-1]
            else:
                probs = logits.softmax(-1)
            outs.append(probs @ vd)
            start += n
        rows.append(torch.cat(outs, dim=1))
    return torch.stack(rows)


@pytest.mark.parametrize("packing", PACKINGS, ids=str)
@pytest.mark.parametrize("chunk, with_sinks", [(4, False), (1, False), (None, True), (3, True)])
def test_sdpa_kernel_chunked_and_sink_attention_equal_dense_per_document(monkeypatch, packing, chunk, with_sinks):
    monkeypatch.setenv(ENV, "sdpa")
    q, k, v = inputs(packing)
    sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_(with_sinks)
    kwargs = {**({"chunk": chunk} if chunk else {}), **({"sinks": sinks} if with_sinks else {})}
    out = packed_attention(q, k, v, positions_of(packing), enable_gqa=True, **kwargs)
    want = dense_chunk_sinks(q, k, v, packing, chunk, sinks if with_sinks else None)
    torch.testing.assert_close(out, want)
    leaves = (q, k, v, sinks) if with_sinks else (q, k, v)
    grad = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("chunk", [4, 5])
def test_flex_kernel_chunked_attention_forward(monkeypatch, chunk):
    monkeypatch.setenv(ENV, "flex")
    packing = PACKINGS[0]
    q, k, v = inputs(packing, dtype=torch.float32)
    with torch.no_grad():
        out = packed_attention(q, k, v, positions_of(packing), enable_gqa=True, chunk=chunk)
    torch.testing.assert_close(out, dense_chunk_sinks(q, k, v, packing, chunk, None), rtol=1e-5, atol=1e-5)


def test_chunks_and_sinks_with_local_queries_against_gathered_keys():
    packing = [[12, 20], [25, 7]]
    q, k, v = (t.detach().float() for t in inputs(packing))
    sinks = torch.randn(4)
    chosen = load_balance_indices(32, 2, 1)
    variant = kernels.AttentionVariant(chunk=6, sinks=sinks)
    with torch.no_grad():
        got = kernels.attend("sdpa", q[:, :, chosen], k, v, positions_of(packing), chosen, None, True, variant)
    want = dense_chunk_sinks(q, k, v, packing, 6, sinks)[:, :, chosen]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch_sends_sinks_and_chunks_only_to_kernels_that_compute_them():
    sinks = kernels.AttentionVariant(sinks=torch.zeros(4))
    chunked = kernels.AttentionVariant(chunk=8)
    assert kernels.choose_kernel(CUDA, torch.float32, variant=sinks) == "sdpa"
    assert kernels.choose_kernel(CUDA, torch.bfloat16, variant=sinks) == "sdpa"
    assert kernels.choose_kernel(CUDA, torch.float32, variant=chunked) == "flex"
    assert kernels.choose_kernel(CUDA, torch.bfloat16, variant=chunked) == "flex"
    assert kernels.AttentionVariant(chunk=8).unsupported("varlen") == ("chunk",)
