"""``nn.Embedding(padding_idx=...)`` under vocab parallelism: the padding row gets no gradient, as on one
device, whichever tp rank holds it; the KV cache a HuggingFace model defaults to is off in traces."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.core.batch import next_token_targets


class PaddedLM(nn.Module):
    def __init__(self, padding_idx: int):
        super().__init__()
        self.embed = nn.Embedding(32, 16, padding_idx=padding_idx)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.proj(self.embed(input_ids))))


@pytest.mark.parametrize("padding_idx", [3, 20, -1])  # held by tp rank 0, by rank 1; -1 is row 31
def test_padding_row_gets_no_gradient_on_the_rank_holding_it(padding_idx):
    torch.manual_seed(0)
    model = PaddedLM(padding_idx)
    with torch.no_grad():
        model.embed.weight[model.embed.padding_idx].normal_()  # a non-zero row: its lookup must still count
    ids = torch.randint(0, 32, (2, 12))
    ids[:, ::3] = model.embed.padding_idx
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    model.zero_grad()
    loss.backward()
    assert not model.embed.weight.grad[model.embed.padding_idx].any()
    compiled = hgraph.compile(model, ["tp2", "2x tp1"], example_inputs=ids[:, :6].clone())
    for index in range(2):
        got_loss, grads = compiled.simulate(index, ids)
        torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-5, atol=1e-6)
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_hf_model_traces_with_its_default_kv_cache_on():
    from hgraph.models import tiny_hf_llama

    model = tiny_hf_llama()
    assert model.config.use_cache
    traced = hgraph.frontend.trace(model, torch.randint(0, 256, (2, 8)))
    ops = {str(n.target) for n in traced.graph_module.graph.nodes if n.op == "call_function"}
    assert not any("detach_" in op or "copy_" in op for op in ops)
