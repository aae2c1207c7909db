"""A fused projection split into parts (Phi-3 ``gate_up_proj.chunk``, GPT-BigCode ``c_attn.split``) under
tp: the gradient through the multi-output split is summed where a sharded consumer makes it partial.
Before the fix the annotate pass treated multi-output nodes as not needing gradients and the fused
weight's gradient was 96 % off."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.core.batch import next_token_targets


class FusedGateUp(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(32, 16)
        self.gate_up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        fused = self.gate_up(x)
        if self.how == "chunk":
            gate, up = fused.chunk(2, dim=-1)
        elif self.how == "split":
            gate, up = fused.split(16, dim=-1)
        else:
            gate, up = fused.split([16, 16], dim=-1)
        return self.head(x + self.down(F.silu(gate) * up))


@pytest.mark.parametrize("how", ["chunk", "split", "split_with_sizes"])
def test_fused_projection_split_under_tp_has_exact_gradients(how):
    torch.manual_seed(0)
    model = FusedGateUp(how)
    ids = torch.randint(0, 32, (2, 8))
    model.zero_grad()
    loss = F.cross_entropy(model(ids).flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    loss.backward()
    compiled = hgraph.compile(model, ["tp2"], example_inputs=ids)
    got, grads = compiled.simulate(0, ids)
    torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
