"""The packing proof: a model is packed only once hgraph has proved that packing leaves every document's
loss as it is — from the graph, or by probing — and is otherwise trained one document per micro-batch
(warned, with the module, the construct and the measured cost) or refused. Never packed silently.

The leaky models here carry information along the sequence outside attention, each the way real
models do: a token shift (RWKV's, a causal convolution of width 2), positions from the row's length
(a model that takes no ``position_ids``), a mean over the sequence, bidirectional attention, the
sequence length as a value. If the
proof were switched off, they would be packed and ``test_unproved_models_train_each_document_alone``
would fail."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.errors import PackingError
from hgraph.frontend import trace
from hgraph.compiler.packing_proof import PackingWarning, graph_proof, prove_packing
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig, RunConfig

VOCAB, WIDTH = 32, 16


class Leaky(nn.Module):
    """Embedding, causal attention, and one construct that reads other tokens (``kind``)."""

    def __init__(self, kind: str | None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.kind = kind
        self.config = type("Config", (), {"vocab_size": VOCAB})()

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        x = self.embed(input_ids)
        if self.kind == "shift":  # x_t + W x_{t-1}: reads the previous token, across a document start
            x = x + self.mix(torch.cat([x.new_zeros(b, 1, WIDTH), x], dim=1)[:, :-1])
        elif self.kind == "mean":  # every token reads a mean over the row
            x = x + self.mix(x.sum(dim=1, keepdim=True) / 16)
        elif self.kind == "length":  # the row's length as a value (a length-dependent scale)
            x = x / s
        q, k, v = self.qkv(x).view(b, s, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.kind != "bidirectional")
        return out.transpose(1, 2).reshape(b, s, WIDTH) @ self.embed.weight.T


class RowPositions(nn.Module):
    """Learned absolute positions from ``arange`` over the row: no ``position_ids`` argument, so
    positions never restart at a document."""

    def __init__(self, table: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(table, WIDTH)
        self.config = type("Config", (), {"vocab_size": VOCAB})()

    def forward(self, input_ids):
        return (self.embed(input_ids) + self.positions(torch.arange(input_ids.shape[1]))) @ self.embed.weight.T


def leaky(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return RowPositions() if kind == "positions" else Leaky(kind)


LEAKS = {  # kind -> what the graph proof names
    "shift": r"slice|cat",
    "mean": r"all_reduce|mean",
    "bidirectional": r"scaled_dot_product_attention",
    "positions": r"arange",
    "length": r"sequence length .* as a value",
}
EXAMPLE = torch.randint(0, VOCAB, (2, 8))
DOCUMENTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 3, 12)]


def each_document_alone(model, documents):
    """The oracle: loss and gradients of the model run on each document alone (no hgraph code)."""
    model.zero_grad()
    tokens = sum(len(d) - 1 for d in documents)
    total = 0.0
    for d in documents:
        out = model(d[None], torch.arange(len(d))[None]) if isinstance(model, Leaky) else model(d[None])
        logits = getattr(out, "logits", out)  # an HF model's output, or the logits
        loss = F.cross_entropy(logits[0, :-1], d[1:], reduction="sum") / tokens
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_clean_model_is_proved_from_the_graph():
    proof = prove_packing(trace(Leaky(None), EXAMPLE))
    assert proof.exact and proof.method == "graph" and proof.packs


def test_mixture_of_experts_is_proved_by_probing():
    """Routing sorts the micro-batch's tokens: token-local, but not op by op. The probe shows it."""
    from hgraph.models.zoo import zoo_model

    proof = prove_packing(trace(zoo_model("mixtral").eval(), torch.randint(0, 256, (2, 8))))
    assert proof.exact and proof.method == "probe", str(proof)
    assert "MixtralExperts" in proof.construct
    assert max(max(p) for p in proof.probe_lengths) > 64  # past the graph's length constants


@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_a_leak_is_found_named_and_priced(kind):
    traced = trace(leaky(kind), EXAMPLE)
    construct = graph_proof(traced)
    assert construct is not None and __import__("re").search(LEAKS[kind], construct), construct
    with pytest.warns(PackingWarning, match="one document per micro-batch") as caught:
        proof = prove_packing(traced)
    assert not proof.exact and not proof.packs and proof.method == "unproved"
    assert "packed" in proof.finding and "alone" in proof.finding  # the probe saw it too
    assert proof.cost is not None and proof.cost > 0
    assert f"{proof.cost:.2f}x" in str(caught[0].message)


def test_a_probe_the_program_cannot_run_proves_nothing():
    """Positions past the model's table: the probe's packed row cannot run; that is no proof, and
    the error becomes the finding, not a traceback."""
    with pytest.warns(PackingWarning, match="cannot run documents"):
        proof = prove_packing(trace(RowPositions(table=12), EXAMPLE))
    assert not proof.exact and ("IndexError" in proof.finding or "RuntimeError" in proof.finding), proof.finding


def test_required_packing_refuses_an_unproved_model():
    with pytest.raises(PackingError, match=r"Leaky.*not proved exact.*packing='require'"):
        hgraph.compile(leaky("shift"), ["2x tp1"], example_inputs=EXAMPLE,
                       options=hgraph.CompileOptions(packing="require"))


def test_padding_strategies_are_refused_for_an_unproved_model():
    """cp pads every micro-batch: padding would share the one document's micro-batch. (The mean over
    the sequence compiles for cp, its rules summing over the chunks; a shift is refused by them.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        with pytest.raises(PackingError, match=r"cp2.*pads every micro-batch.*without cp"):
            hgraph.compile(leaky("mean"), ["2x tp1", "cp2"], example_inputs=EXAMPLE)


@pytest.mark.parametrize("kind", ["shift", "positions"])
def test_unproved_models_train_each_document_alone(kind):
    """The oracle and the Trainer both run one document per micro-batch: every document's own loss."""
    model = leaky(kind)
    with pytest.warns(PackingWarning):
        compiled = hgraph.compile(model, ["2x tp1", "tp2"], example_inputs=EXAMPLE)
    ref_loss, ref_grads = each_document_alone(model, DOCUMENTS)
    for index in range(2):
        loss, grads = compiled.simulate(index, DOCUMENTS)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, want in ref_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=name)

    def body(comm):
        trainer = Trainer(compiled, comm=comm, optimizer=AdamWConfig(lr=0.0))
        return trainer.step(DOCUMENTS, strategy=0), trainer.history[-1]["dispatch"]

    (loss, dispatch), _ = run_threads(body, 2)
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    assert all(len(mb) == 1 for pipeline in dispatch for mb in pipeline)


def test_packing_off_trains_one_document_per_micro_batch():
    compiled = hgraph.compile(Leaky(None), ["2x tp1"], example_inputs=EXAMPLE,
                              options=hgraph.CompileOptions(packing="off"))
    assert compiled.packing.exact and not compiled.packing.packs
    assert str(compiled.packing) == "packing off: one document per micro-batch"

    def body(comm):
        trainer = Trainer(compiled, comm=comm, optimizer=AdamWConfig(lr=0.0))
        trainer.step(DOCUMENTS)
        return trainer.history[-1]["dispatch"]

    dispatch = run_threads(body, 2)[0]
    assert all(len(mb) == 1 for pipeline in dispatch for mb in pipeline)


def test_a_model_on_the_meta_device_is_probed_with_stand_in_weights():
    """A model compiled before its weights load (meta device): the probe runs on seeded stand-ins, so a
    mixture of experts is still proved and a leak still found (without them the probe cannot run)."""
    from hgraph.models.zoo import zoo_model

    with torch.device("meta"):
        moe = zoo_model("mixtral").eval()
        shift = Leaky("shift")
    proof = prove_packing(trace(moe, torch.randint(0, 256, (2, 8))))
    assert proof.exact and proof.method == "probe", str(proof)
    with pytest.warns(PackingWarning, match=r"probe: document \d+ of lengths .* packed together"):
        assert not prove_packing(trace(shift, EXAMPLE)).exact


def test_llama4_rows_past_its_row_position_scale_are_refused_not_trained_wrong():
    """Llama 4's NoPE layers scale queries by a function of the position in the *row* (1 below 8192
    tokens). A micro-batch budget past it packs later documents at other scales: training must refuse
    that (or equal each document alone), never train on a silently different loss. The default
    budget (4096) still packs."""
    from hgraph.models.zoo import zoo_model

    model = zoo_model("llama4")
    compiled = hgraph.compile(model, ["tp1"], example_inputs=torch.randint(0, 256, (2, 8)))
    assert compiled.packing.packs and compiled.packing.checked_tokens == 8191, str(compiled.packing)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, 256, (500,), generator=generator) for _ in range(20)]  # one row: 10000 tokens
    budget = 10240

    def body(comm):
        Trainer(compiled, comm=comm, optimizer=AdamWConfig(lr=0.0))  # the default micro_batch_tokens packs
        with pytest.raises(PackingError, match=r"10240 tokens.*up to 8191 tokens.*layers\.3\.self_attn.*packing='off'"):
            Trainer(compiled, comm=comm, optimizer=AdamWConfig(lr=0.0),
                    run=RunConfig(micro_batch_tokens=budget))

    run_threads(body, 1)
    try:  # the Trainer's packing (default_dispatch, one row), run with gradients
        loss, grads = compiled.simulate(0, documents, micro_batch_tokens=budget)
    except PackingError as exc:
        assert "a packed micro-batch of 10000 tokens" in str(exc)
        return
    ref_loss, ref_grads = each_document_alone(model, documents)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, want in ref_grads.items():  # freshly initialised: layer 3's query grads are ~1e-5, so relative
        torch.testing.assert_close(grads[name], want, rtol=1e-3, atol=1e-3 * float(want.abs().max()), msg=name)
