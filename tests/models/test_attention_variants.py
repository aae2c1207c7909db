"""The attention variants of 2025-2026 families inside packed attention, each proved for every length the
way sliding windows are (the mask probed past every length constant of its computation):

* Llama 4's chunked attention (``attention_chunk_size``: a query sees the earlier keys of its own chunk
  of the document) on its chunked layers, plain causality on every fourth;
* gpt-oss's attention sinks (a learned logit per head in every softmax) with sliding and full layers
  alternating;
* GraniteMoE and gpt-oss build their masks from the sizes alone (HF's packed-sequence detection never
  sees their positions), so packed rows would mix documents: hgraph runs each document as the model
  runs it alone.

Each family's packed rows (documents of 1-70 tokens, longer than every window and chunk) equal the
unmodified model run on each document alone, loss and every gradient, on tp+dp, tp x pp and dp x pp
(all three are mixtures of experts, whose routing refuses cp; the kernels' cp case, local queries
against gathered keys, is ``tests/runtime/test_attention_kernels.py``). A planted bug (the sinks
dropped from the softmax) is caught."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hgraph
from hgraph.frontend.capture import trace
from hgraph.models.zoo import zoo_model
from hgraph.runtime.kernels import attention_kernels
from hgraph.runtime.kernels.packed_attention import packed_attention
from packed_documents import alone, documents, mismatch, packed

STRATEGIES = ["tp2 + 2x tp1", "tp2,pp2", "2x tp1,pp2"]  # all three are MoE: routing refuses cp


def variants(model) -> list[dict]:
    traced = trace(model, torch.randint(0, 256, (2, 8)))
    nodes = list(traced.graph_module.graph.nodes)
    assert not [n for n in nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    return [{k: getattr(v, "name", v) for k, v in n.kwargs.items() if k in ("window", "chunk", "sinks")}
            for n in nodes if n.target is packed_attention]


def test_llama4_chunks_are_found_on_its_chunked_layers():
    model = zoo_model("llama4").eval()
    assert model.config.attention_chunk_size == 8 and model.config.layer_types[3] == "full_attention"
    assert variants(model) == [{"chunk": 8}] * 3 + [{}]


def test_gpt_oss_sinks_and_alternating_windows_are_found():
    model = zoo_model("gpt_oss").eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert variants(model) == [{"window": 8, "sinks": "p_model_layers_0_self_attn_sinks"},
                               {"sinks": "p_model_layers_1_self_attn_sinks"}]


class ChunkedAttention(nn.Module):
    """One attention layer with a chunked mask from position ids, as HuggingFace builds Llama 4's."""

    def __init__(self, chunk: int):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.chunk = chunk

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        q, k, v = self.qkv(self.embed(input_ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        index = torch.arange(s)
        start = torch.where(position_ids == 0, index, torch.zeros_like(index)).cummax(-1).values
        inside = index - start
        mask = ((index[None, :] <= index[:, None]) & (start[:, :, None] == start[:, None, :])
                & (inside[:, :, None] // self.chunk == inside[:, None, :] // self.chunk))
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return out.transpose(1, 2).reshape(b, s, 16) @ self.embed.weight.T


@pytest.mark.parametrize("chunk", [3, 8, 20])
def test_chunk_is_read_from_the_mask_not_from_short_probes(chunk):
    """An example of 4 tokens cannot show a chunk of 8 or 20: the probe runs past the mask's constants."""
    torch.manual_seed(0)
    traced = trace(ChunkedAttention(chunk), torch.randint(0, 32, (2, 4)))
    (node,) = [n for n in traced.graph_module.graph.nodes if n.target is packed_attention]
    assert node.kwargs.get("chunk") == chunk


@pytest.fixture(scope="module", params=["llama4", "gpt_oss", "granitemoe"])
def family(request):
    model = zoo_model(request.param).eval()
    rows = documents(model.config.vocab_size)
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=torch.randint(0, 256, (2, 8)))
    return request.param, compiled, packed(rows), alone(model, rows)


@pytest.mark.parametrize("strategy", [s if s == "tp2,pp2" else pytest.param(s, marks=pytest.mark.slow) for s in STRATEGIES])
def test_packed_documents_equal_each_document_alone(family, strategy):
    name, compiled, batch, ref = family
    assert mismatch(compiled, strategy, batch, ref) == "", name


@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)
def test_sinks_dropped_from_the_softmax_are_caught(family, monkeypatch):
    name, compiled, batch, ref = family
    plain = attention_kernels.AttentionVariant.normalise
    monkeypatch.setattr(attention_kernels.AttentionVariant, "normalise",
                        lambda self, scores, head: plain(attention_kernels.AttentionVariant(), scores, head))
    assert mismatch(compiled, "tp2,pp2", batch, ref) != ""
