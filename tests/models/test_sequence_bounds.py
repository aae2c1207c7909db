"""Sequence bounds from what the model says (``hgraph.frontend.seq_bounds``): a model whose only size
dependence is a maximum length traces with a dynamic sequence, whatever the bound is called and however
it is written — a config attribute of any name slicing a position table, a ``tril`` buffer sliced to
the length, an ``assert``, an ``if`` that only raises — and the graph equals the model at other lengths. ``CompileOptions(max_seq_len=...)``
bounds it by hand. A real Python branch on the length is refused naming the module and the source line.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.errors import TraceError
from hgraph.frontend.capture import trace


def eager_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits
    targets = torch.roll(ids, -1, dims=1)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


class Tiny(nn.Module):
    """Embedding and head; subclasses add the one size dependence under test."""

    def __init__(self, limit: int = 32):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=64, context_window=limit)  # no HF name for the bound
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.body(self.embed(input_ids))))


class SlicedTable(Tiny):
    """A learned position table of ``config.context_window`` rows, sliced to the length."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(self.config.context_window, 16))

    def body(self, h):
        return h + self.positions[: h.shape[1]]


class SlicedBuffer(Tiny):
    """A ``tril`` mask buffer of the maximum length, sliced to ``[:t, :t]`` (nanoGPT's mask)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(32, 32)))

    def body(self, h):
        t = h.shape[1]
        scores = (h @ h.transpose(1, 2)).masked_fill(self.mask[:t, :t] == 0, float("-inf"))
        return scores.softmax(-1) @ h


class Asserted(Tiny):
    """``assert t <= self.max_len`` (nanoGPT's ``block_size`` check) and nothing else."""

    max_len = 32

    def body(self, h):
        assert h.shape[1] <= self.max_len, f"sequence of {h.shape[1]} is longer than {self.max_len}"
        return h


class RaisedOnLength(Tiny):
    """``if t > self.max_len: raise ValueError(...)`` (litgpt's check): an ``if`` that only raises is a bound."""

    max_len = 32

    def body(self, h):
        if self.max_len < h.shape[1]:
            raise ValueError(f"sequence of {h.shape[1]} is longer than {self.max_len}")
        return h


class EvenOnly(Tiny):
    """An ``if`` that only raises but states no maximum (even lengths only): refused, naming the line."""

    def body(self, h):
        if h.shape[1] % 2:
            raise ValueError("even lengths only")
        return h


class Branching(Tiny):
    """A real Python branch on the length: one graph cannot serve every length."""

    def __init__(self):
        super().__init__()
        self.block = nn.ModuleDict({"mixer": Halving()})

    def body(self, h):
        return self.block["mixer"](h)


class Halving(nn.Module):
    def forward(self, h):
        if h.shape[1] > 8:
            h = h * 0.5
        return h


@pytest.mark.parametrize("model_type", [SlicedTable, SlicedBuffer, Asserted, RaisedOnLength])
def test_a_maximum_length_traces_with_a_dynamic_sequence(model_type):
    torch.manual_seed(0)
    model = model_type().eval()
    traced = trace(model, torch.randint(0, 64, (2, 8)))
    assert traced.dynamic, traced.static_reason
    for length in (3, 20, 31):
        ids = torch.randint(0, 64, (2, length))
        torch.testing.assert_close(traced.run(ids), eager_loss(model, ids))


def test_a_python_branch_on_the_length_is_refused_naming_module_and_line():
    with pytest.raises(TraceError) as info:
        hgraph.compile(Branching(), ["tp1"], example_inputs=torch.randint(0, 64, (2, 6)))
    message = str(info.value)
    assert "branches on the sequence length in Python" in message
    assert "module 'block.mixer' (Halving)" in message
    assert "test_sequence_bounds.py" in message and "`if h.shape[1] > 8:`" in message
    assert "max_seq_len" in message and "Traceback" not in message


def test_a_raise_on_a_condition_that_is_no_bound_is_refused_naming_the_line():
    with pytest.raises(TraceError) as info:
        hgraph.compile(EvenOnly(), ["tp1"], example_inputs=torch.randint(0, 64, (2, 8)))
    message = str(info.value)
    assert "module '<root>' (EvenOnly)" in message and "`if h.shape[1] % 2:`" in message
    assert "test_sequence_bounds.py" in message


def test_max_seq_len_bounds_the_sequence_by_hand():
    """Below its branch the branching model is one graph: ``max_seq_len=8`` says lengths stay there."""
    model = Branching().eval()
    compiled = hgraph.compile(model, ["tp1"], example_inputs=torch.randint(0, 64, (2, 6)),
                              options=hgraph.CompileOptions(max_seq_len=8))
    assert compiled.traced.dynamic
    ids = torch.randint(0, 64, (2, 5))
    torch.testing.assert_close(compiled.traced.run(ids), eager_loss(model, ids))


def test_max_seq_len_is_checked():
    with pytest.raises(hgraph.HGraphError, match=r"max_seq_len=1; expected None or an int of at least 2"):
        hgraph.CompileOptions(max_seq_len=1)
