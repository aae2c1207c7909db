"""Sliding-window attention survives canonicalisation: the window is found by probing past every length
constant of the mask (a probe no longer than the window cannot tell it from causal attention), moved
into ``packed_attention(window=...)``, and the traced graph equals the model on sequences longer than
both the example and the window."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.frontend import default_loss, trace
from hgraph.runtime.kernels.packed_attention import packed_attention
from hgraph.core.batch import next_token_targets


class WindowAttention(nn.Module):
    """One attention layer with a mask built from position ids the way HuggingFace builds it."""

    def __init__(self, window: int | None):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.window = window

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        q, k, v = self.qkv(self.embed(input_ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        sequence = torch.cumsum(position_ids.diff(dim=-1, prepend=position_ids[:, :1] - 1) != 1, dim=-1)
        index = torch.arange(s)
        mask = (index[None, :] <= index[:, None]) & (sequence[:, :, None] == sequence[:, None, :])
        if self.window is not None:
            mask = mask & (index[None, :] > index[:, None] - self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return out.transpose(1, 2).reshape(b, s, 16) @ self.embed.weight.T


def packed_nodes(traced):
    return [n for n in traced.graph_module.graph.nodes if n.target is packed_attention]


@pytest.mark.parametrize("window", [None, 3, 8, 20])
def test_window_is_read_from_the_mask_not_from_short_probes(window):
    torch.manual_seed(0)
    model = WindowAttention(window)
    traced = trace(model, torch.randint(0, 32, (2, 4)))  # 4 tokens: shorter than every window here
    assert traced.dynamic
    (node,) = packed_nodes(traced)
    assert node.kwargs.get("window") == window
    ids = torch.randint(0, 32, (2, 32))
    positions = torch.cat([torch.arange(25), torch.arange(7)]).expand(2, 32).contiguous()
    targets = next_token_targets(ids)
    expected = default_loss(model(ids, positions), targets)
    torch.testing.assert_close(traced.run(ids, positions, targets), expected, rtol=1e-5, atol=1e-6)


def test_hf_mistral_window_shorter_than_the_sequence_equals_the_model():
    """The issue's case: example of 4 tokens, sliding_window=8, 32-token batch, tp and data parallel."""
    from hgraph.models.zoo import zoo_model

    model = zoo_model("mistral").eval()
    assert model.config.sliding_window == 8
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    logits = model(ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    loss.backward()
    compiled = hgraph.compile(model, ["2x tp1", "tp2"], example_inputs=ids[:, :4])
    for index in range(2):
        got, grads = compiled.simulate(index, ids)
        torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


class EagerSoftcapAttention(nn.Module):
    """Attention written out by hand as HuggingFace's eager path does, with Gemma 2's soft-capping."""

    def __init__(self, window: int | None, softcap: float | None):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.window, self.softcap = window, softcap

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        q, k, v = self.qkv(self.embed(input_ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        sequence = torch.cumsum(position_ids.diff(dim=-1, prepend=position_ids[:, :1] - 1) != 1, dim=-1)
        index = torch.arange(s)
        allowed = (index[None, :] <= index[:, None]) & (sequence[:, :, None] == sequence[:, None, :])
        if self.window is not None:
            allowed = allowed & (index[None, :] > index[:, None] - self.window)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]
        scores = q @ k.transpose(2, 3) * 8**-0.5
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        out = torch.softmax(scores + mask, dim=-1, dtype=torch.float32) @ v
        return out.transpose(1, 2).reshape(b, s, 16) @ self.embed.weight.T


@pytest.mark.parametrize("window, softcap", [(None, None), (6, 2.0), (None, 2.0)])
def test_eager_attention_becomes_packed_attention_with_its_softcap(window, softcap):
    torch.manual_seed(0)
    model = EagerSoftcapAttention(window, softcap)
    traced = trace(model, torch.randint(0, 32, (2, 4)))
    (node,) = packed_nodes(traced)
    assert node.kwargs.get("window") == window and node.kwargs.get("softcap") == softcap
    assert torch.ops.aten.softmax.int not in {n.target for n in traced.graph_module.graph.nodes}
    ids = torch.randint(0, 32, (2, 20))
    positions = torch.cat([torch.arange(13), torch.arange(7)]).expand(2, 20).contiguous()
    targets = next_token_targets(ids)
    expected = default_loss(model(ids, positions), targets)
    torch.testing.assert_close(traced.run(ids, positions, targets), expected, rtol=1e-5, atol=1e-6)
