"""Heads cut on tp and then merged into rows (``[b, s, h, d] -> [b·s·h, d]``: Gated DeltaNet's per-head
norm) stay cut, as ``StridedShard`` rows, so the row-wise norm needs no communication; an op that needs
the rows whole gathers them in order (all-gather, then each rank's pieces moved back between the
``b·s`` leading rows). Both equal the model on one device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.core.batch import next_token_targets
from hgraph.core.placement import StridedShard
from hgraph.rules.base import TP

HEADS, DIM, VOCAB = 4, 8, 32


class PerHeadRows(nn.Module):
    def __init__(self, gather: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HEADS * DIM)
        self.proj = nn.Linear(HEADS * DIM, HEADS * DIM, bias=False)
        self.out = nn.Linear(HEADS * DIM, VOCAB, bias=False)
        self.gather = gather

    def forward(self, input_ids, position_ids=None):
        b, s = input_ids.shape
        heads = self.proj(self.embed(input_ids)).view(b, s, HEADS, DIM)
        rows = heads.reshape(-1, DIM)
        rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.gather:
            rows = rows + 0.1 * rows.cumsum(0)  # reads across the rows: needs them whole, in order (one sequence)
        return self.out(rows.reshape(b, s, HEADS, DIM).reshape(b, s, HEADS * DIM))


def run(model, ids):
    model.zero_grad()
    loss = F.cross_entropy(model(ids).flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_rows_of_cut_heads_stay_cut_and_gather_in_order():
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))  # one micro-batch
    for gather in (False, True):
        model = PerHeadRows(gather)
        compiled = hgraph.compile(model, ["tp2"], example_inputs=torch.randint(0, VOCAB, (2, 8)))
        program = compiled.local_program(1, 2)
        strided = [n for n in program.graph.nodes if isinstance((n.meta.get("hgraph_spec") or (None, None))[TP], StridedShard)]
        assert strided, "the merged rows stay cut"
        ops = [n.meta["hgraph_comm"]["op"] for n in program.graph.nodes if "hgraph_comm" in n.meta]
        assert ("all_gather" in ops) == gather
        want_loss, want = run(model, ids)
        loss, grads = compiled.simulate(0, ids)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        for name, g in want.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"gather={gather} {name}: {m}")
