"""Attention whose mask and bias a model computes itself becomes packed attention only once the probes
have proved what they are, for every length the model may see: the causal mask of one document
computed from sizes alone (OPT, GraniteMoE), ALiBi (Bloom, MPT: per-head slopes, applied inside each
document by ``packed_attention(alibi=...)``). Anything else keeps its computation (and the packing
proof then finds the leak)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hgraph.core.batch import next_token_targets
from hgraph.frontend import default_loss, trace
from hgraph.runtime.kernels.packed_attention import packed_attention

HEADS, DIM = 4, 8


class SizeMaskedAttention(nn.Module):
    """One attention layer whose mask and bias come from the row's length, never from positions:
    ``bias`` ``"alibi"`` (Bloom's ``slope·j``), ``"quadratic"`` (not ALiBi) or ``None``;
    ``causal`` False gives a full (encoder) mask."""

    def __init__(self, bias: str | None = "alibi", causal: bool = True, eager: bool = True):
        super().__init__()
        self.embed = nn.Embedding(32, HEADS * DIM)
        self.qkv = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125, 0.0625]), persistent=False)
        self.bias, self.causal, self.eager = bias, causal, eager

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        q, k, v = self.qkv(self.embed(input_ids)).view(b, s, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        j = torch.arange(s)
        allowed = (j[None, :] <= j[:, None]) if self.causal else torch.ones(s, s, dtype=torch.bool)
        if not self.eager:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None].expand(b, 1, s, s))
            return out.transpose(1, 2).reshape(b, s, -1) @ self.embed.weight.T
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM)
        if self.bias == "alibi":
            scores = scores + self.slopes[:, None, None] * j
        elif self.bias == "quadratic":
            scores = scores + self.slopes[:, None, None] * (j * j) / 16
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, s, -1) @ self.embed.weight.T


def packed_nodes(traced):
    return [n for n in traced.graph_module.graph.nodes if n.target is packed_attention]


def loss_of_each_document_alone(model, ids, lengths):
    """The summed loss of the model run on each document of the packed row alone."""
    total, start = 0.0, 0
    for n in lengths:
        doc = ids[:, start : start + n]
        total = total + default_loss(model(doc, torch.arange(n)[None]), next_token_targets(doc))
        start += n
    return total


def packed_run(traced, lengths, seed=0):
    ids = torch.randint(0, 32, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    targets = torch.cat([next_token_targets(ids[:, sum(lengths[:i]) : sum(lengths[: i + 1])])
                         for i in range(len(lengths))], dim=1)
    return ids, traced.run(ids, positions, targets)


LENGTHS = (5, 13, 2, 20)


@pytest.mark.parametrize("eager", [True, False])
def test_causal_mask_from_sizes_is_one_documents_mask(eager):
    """OPT's case: the mask spans the row (it never reads positions); proved causal on one document,
    it becomes packed attention, and each packed document equals the model run on it alone."""
    model = SizeMaskedAttention(bias=None, eager=eager)
    traced = trace(model, torch.randint(0, 32, (2, 8)))
    (node,) = packed_nodes(traced)
    assert "alibi" not in node.kwargs and "window" not in node.kwargs
    ids, loss = packed_run(traced, LENGTHS)
    torch.testing.assert_close(loss, loss_of_each_document_alone(model, ids, LENGTHS), rtol=1e-5, atol=1e-5)


def test_alibi_becomes_packed_attention_with_the_models_slopes():
    model = SizeMaskedAttention("alibi")
    traced = trace(model, torch.randint(0, 32, (2, 8)))
    (node,) = packed_nodes(traced)
    slopes = getattr(traced.graph_module, node.kwargs["alibi"].target)
    assert torch.equal(slopes, model.slopes)
    assert node.kwargs["scale"] == pytest.approx(1 / math.sqrt(DIM))
    ids, loss = packed_run(traced, LENGTHS)
    torch.testing.assert_close(loss, loss_of_each_document_alone(model, ids, LENGTHS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [dict(bias="quadratic"), dict(bias=None, causal=False)])
def test_other_terms_keep_their_computation(kind):
    """A bias that is not linear in i - j, or a mask that is not causal, is no packed attention."""
    traced = trace(SizeMaskedAttention(**kind), torch.randint(0, 32, (2, 8)))
    assert not packed_nodes(traced)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_families_get_their_own_slopes(family):
    """Bloom's and MPT's slopes, read by the probes from their own bias computation (MPT's up to the
    511 tokens its trace allows: its table holds 512)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from hgraph.models.zoo import zoo_model

    model = zoo_model(family).eval()
    traced = trace(model, torch.randint(0, 256, (2, 8)))
    nodes = packed_nodes(traced)
    assert len(nodes) == model.config.num_hidden_layers == 2
    heads = 4
    if family == "bloom":
        want = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]
    else:
        want = build_mpt_alibi_tensor(heads, 2)[:, 0, -1] - build_mpt_alibi_tensor(heads, 2)[:, 0, -2]
    for node in nodes:
        got = getattr(traced.graph_module, node.kwargs["alibi"].target)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
