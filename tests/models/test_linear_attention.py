"""Gated DeltaNet (Qwen3-Next, Qwen3.5) in packed micro-batches: the causal convolution and the delta rule
restart at every document, so a packed row equals its documents run alone through the unmodified model
— loss and every gradient, fp32, on tp+dp, tp x pp and dp x pp; context parallelism of the recurrence
is refused naming it. A planted bug (the convolution not restarted at a boundary) is caught.

Documents are packed as training packs them (``hgraph.core.batch.pack_micro_batch``: positions restart at 0,
each document's last token predicts nothing), several per row, one longer than the delta rule's
64-token chunks and all longer than the 4-token convolution."""

from __future__ import annotations

import pytest
import torch

import hgraph
from packed_documents import alone, documents, mismatch, packed
from hgraph.errors import ShardingRuleError
from hgraph.runtime.kernels import linear_attention
from hgraph.models.zoo import zoo_model

STRATEGIES = ["tp2 + 2x tp1", "tp2,pp2", "2x tp1,pp2"]


@pytest.fixture(scope="module", params=["qwen3_next", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def family(request):
    model = zoo_model(request.param).eval()
    rows = documents(model.config.vocab_size)
    batch = packed(rows)
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=torch.randint(0, 256, (2, 8)))
    return request.param, compiled, batch, alone(model, rows)


@pytest.mark.parametrize("strategy", [s if s == "tp2,pp2" else pytest.param(s, marks=pytest.mark.slow) for s in STRATEGIES])
def test_packed_documents_equal_each_document_alone(family, strategy):
    name, compiled, batch, ref = family
    assert mismatch(compiled, strategy, batch, ref) == "", name


def test_a_convolution_not_restarted_at_boundaries_is_caught(family, monkeypatch):
    """Planted bug: the causal convolution reads across documents (its state carried over)."""
    name, compiled, batch, ref = family
    original = linear_attention.conv_per_document
    monkeypatch.setattr(linear_attention, "conv_per_document", lambda x, w, b, positions: original(x, w, b, None))
    assert mismatch(compiled, "tp2,pp2", batch, ref) != "", name


def test_a_delta_rule_not_restarted_at_boundaries_is_caught(family, monkeypatch):
    """Planted bug: the delta rule's memory carried from one document into the next."""
    name, compiled, batch, ref = family
    original = linear_attention.rule_per_document
    monkeypatch.setattr(linear_attention, "rule_per_document", lambda *a: original(*a[:5], None, *a[6:]))
    assert mismatch(compiled, "tp2 + 2x tp1", batch, ref) != "", name


def test_context_parallelism_of_the_recurrence_is_refused_clearly():
    model = zoo_model("qwen3_next").eval()
    with pytest.raises(ShardingRuleError, match=r"Qwen3NextGatedDeltaNet.*carries a state along the sequence.*"
                                                r"context parallelism.*without cp"):
        hgraph.compile(model, ["2x cp2"], example_inputs=torch.randint(0, 256, (2, 8)))


def test_kernels_equal_hf_reference_on_each_document():
    """The kernels alone against HF's own reference functions (``__wrapped__``: the torch code), each
    document run separately; documents longer and shorter than a 64-token chunk."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    g = torch.Generator().manual_seed(0)
    lengths = [30, 70, 3]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(2, -1)
    q, k = (torch.randn(2, sum(lengths), 2, 8, generator=g) for _ in range(2))
    v = torch.randn(2, sum(lengths), 4, 8, generator=g)
    decay, beta = -torch.rand(2, sum(lengths), 4, generator=g), torch.rand(2, sum(lengths), 4, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, decay, beta)]
    out = linear_attention.packed_gated_delta_rule(*leaves, positions, l2norm=True)
    out.square().sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, decay, beta)]
    pieces, start = [], 0
    for n in lengths:
        part = [t[:, start : start + n] for t in ref_leaves]
        pieces.append(hf.torch_chunk_gated_delta_rule.__wrapped__(*part[:3], g=part[3], beta=part[4],
                                                                   use_qk_l2norm_in_kernel=True)[0])
        start += n
    reference = torch.cat(pieces, 1)
    reference.square().sum().backward()
    torch.testing.assert_close(out, reference)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad)
    x, w, bias = torch.randn(2, 6, sum(lengths), generator=g), torch.randn(6, 1, 4, generator=g), torch.randn(6, generator=g)
    conv = linear_attention.packed_causal_conv1d(x, w, bias, positions)
    start, pieces = 0, []
    for n in lengths:
        pieces.append(hf.causal_conv1d_fn.__wrapped__(x[..., start : start + n], w.squeeze(1), bias))
        start += n
    torch.testing.assert_close(conv, torch.cat(pieces, -1))
