"""Substitutions keep the traced layout (``hgraph.frontend.traced_layout``): export drops the
``.contiguous()`` of ``y.transpose(1, 2).contiguous().view(B, T, C)`` because SDPA's output is already
laid out ``[b, s, h, d]``; packed attention, which replaces SDPA, must return those strides or the
recorded ``view`` fails at run time. Checked at a length other than the example's, through the graph and
through a compiled ``simulate`` on tp x dp and tp x pp; a planted substitution that drops the layout
fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.frontend import canonicalize as canonicalize_module
from hgraph.frontend.capture import trace
from hgraph.runtime.kernels.packed_attention import packed_attention


class SdpaThenView(nn.Module):
    """nanoGPT's attention: fused q/k/v, SDPA, ``transpose(1, 2).contiguous().view(B, T, C)``."""

    def __init__(self, heads: int = 4, dim: int = 32, vocab: int = 64, layers: int = 2):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, n_head=heads, n_embd=dim, n_layer=layers)
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Attention(heads, dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return SimpleNamespace(logits=self.head(x))


class Attention(nn.Module):
    def __init__(self, heads: int, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


def eager_loss(model, ids):
    logits = model(ids).logits
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, dims=1).flatten(), reduction="sum")


def test_packed_attention_returns_the_strides_sdpa_was_traced_with():
    torch.manual_seed(0)
    model = SdpaThenView().eval()
    traced = trace(model, torch.randint(0, 64, (2, 8)))
    assert any(n.target is packed_attention for n in traced.graph_module.graph.nodes)
    ids = torch.randint(0, 64, (3, 13))
    torch.testing.assert_close(traced.run(ids), eager_loss(model, ids))


def test_a_compiled_model_with_a_view_after_attention_simulates():
    torch.manual_seed(0)
    model = SdpaThenView().eval()
    compiled = hgraph.compile(model, ["tp2 + 2x tp1", "tp2,pp2"], example_inputs=torch.randint(0, 64, (2, 8)))
    documents = [torch.randint(0, 64, (n,)) for n in (5, 17, 9)]
    for index in range(2):
        loss, _ = compiled.simulate(index, documents)
        assert torch.isfinite(loss)


def test_a_planted_substitution_that_drops_the_layout_fails(monkeypatch):
    monkeypatch.setattr(canonicalize_module, "with_traced_layout", lambda graph, new, traced: new)
    traced = trace(SdpaThenView().eval(), torch.randint(0, 64, (2, 8)))
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        traced.run(torch.randint(0, 64, (2, 8)))
