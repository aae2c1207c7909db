"""In-place writes into fresh tensors and export's no-grad / autocast regions become plain functional
graphs (``hgraph.frontend.functionalize``, ``hgraph.frontend.grad_regions``), equal to the model in loss and gradients,
and compile to programs equal to the model on tp and cp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.errors import TraceError
from hgraph.frontend import trace

VOCAB, HIDDEN = 32, 16


class _Tiny(nn.Module):
    """Embedding -> ``mix`` -> lm head; subclasses write ``mix`` in place the way HF models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(input_ids)))


class SliceCopies(_Tiny):
    """MLA's keys: a fresh buffer filled by ``copy_`` into two slices, one of them broadcast."""

    def mix(self, h: torch.Tensor) -> torch.Tensor:
        a = self.proj(h)
        out = a.new_empty(*a.shape[:-1], HIDDEN + 4)
        out[..., :HIDDEN].copy_(a)
        out[..., HIDDEN:].copy_(a[..., :1].tanh())
        return out[..., 2 : HIDDEN + 2] * 2


class ReadBeforeAndAfter(_Tiny):
    """A router's mask: ``zeros_like`` + ``scatter_``; one reader before the write, a view taken before
    the write and read after it."""

    def mix(self, h: torch.Tensor) -> torch.Tensor:
        scores = self.proj(h)
        mask = torch.zeros_like(scores)
        before = mask.sum(-1, keepdim=True)  # all zeros: must not see the write
        head = mask[..., :4]  # a view read after the write: must see it
        mask.scatter_(-1, scores.topk(4, dim=-1).indices, 1.0)
        mask[..., 0].add_(scores[..., 0])
        return scores * mask + before + head.sum(-1, keepdim=True)


class Regions(_Tiny):
    """A no-grad block (its result carries no gradient) and an autocast-off block."""

    def mix(self, h: torch.Tensor) -> torch.Tensor:
        a = self.proj(h)
        with torch.no_grad():
            gate = torch.sigmoid(a) * 2
            choice = gate.argmax(-1, keepdim=True)
        with torch.autocast("cpu", enabled=False):
            b = a.float() * 3
        return a * gate + b + choice


MODELS = [SliceCopies, ReadBeforeAndAfter, Regions]


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = run(ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_graph_is_functional_and_equals_the_model(cls):
    model = cls()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    traced = trace(model, ids)
    targets = ids.roll(-1, 1)
    nodes = list(traced.graph_module.graph.nodes)
    mutating = [n for n in nodes if isinstance(n.target, torch._ops.OpOverload)
                and any(a.alias_info is not None and a.alias_info.is_write for a in n.target._schema.arguments)]
    assert not mutating, f"in-place ops left: {mutating}"
    assert not [n for n in nodes if "higher_order" in str(n.target)]

    def eager(x):
        return F.cross_entropy(model(x).flatten(0, 1), targets.flatten(), reduction="sum")

    want = _loss_and_grads(model, ids, eager)
    got = _loss_and_grads(model, ids, lambda x: traced.run(x, targets=targets))
    torch.testing.assert_close(got[0], want[0])
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_compiled_on_tp_and_cp_equals_the_model(cls):
    model = cls()
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(2))
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    model.zero_grad()
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    for strategy in ["tp2 + 2x tp1", "2x cp2"]:
        compiled = hgraph.compile(model, [strategy], example_inputs=ids[:2])
        got_loss, grads = compiled.simulate(0, ids)
        torch.testing.assert_close(got_loss, loss.detach())
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{strategy} {name}: {m}")


def test_enabled_autocast_region_is_refused_naming_the_module():
    class Autocast(_Tiny):
        def mix(self, h: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.proj(h).float()

    with pytest.raises(TraceError, match=r"autocast region.*hgraph programs do not run under autocast.*compute_dtype"):
        trace(Autocast(), torch.randint(0, VOCAB, (2, 8)))
