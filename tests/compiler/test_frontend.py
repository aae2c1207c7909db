"""hgraph.frontend.trace: one graph of forward + loss that reproduces the eager model exactly."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.errors import InputError, TraceError
from hgraph.frontend import default_loss, trace
from hgraph.models import Llama, LlamaConfig, tiny_hf_gpt2, tiny_hf_llama
from hgraph.runtime.kernels.packed_attention import packed_attention

FACTORIES = {
    "llama": lambda: Llama(seed=1),
    "llama_tied": lambda: Llama(LlamaConfig(tie_embeddings=True), seed=1),
    "hf_llama": tiny_hf_llama,
    "hf_gpt2": tiny_hf_gpt2,
}


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def traced(request):
    model = FACTORIES[request.param]()
    return request.param, model, trace(model, torch.randint(0, 256, (2, 16)))


def batch(shape, seed=0, lengths=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, shape, generator=g)
    targets = torch.randint(0, 256, shape, generator=g)
    targets[0, -1] = -100
    if lengths is None:
        positions = torch.arange(shape[1]).expand(shape).contiguous()
    else:
        positions = torch.cat([torch.arange(n) for n in lengths]).expand(shape).contiguous()
    return ids, positions, targets


def eager_loss(model, ids, positions, targets):
    return default_loss(model(input_ids=ids, position_ids=positions), targets)


@pytest.mark.parametrize("shape", [(2, 16), (1, 24), (3, 7)])
def test_graph_reproduces_eager_loss_and_gradients(traced, shape):
    _, model, tm = traced
    ids, positions, targets = batch(shape)
    model.zero_grad()
    expected = eager_loss(model, ids, positions, targets)
    expected.backward()
    params = {name: p.detach().clone().requires_grad_(True) for name, p in tm.params().items()}
    loss = tm.run(ids, positions, targets, params=params)
    loss.backward()
    assert torch.equal(loss, expected)
    named = dict(model.named_parameters())
    for name, p in params.items():
        torch.testing.assert_close(p.grad, named[name].grad, rtol=1e-6, atol=1e-7)


def test_packed_batch_matches_sequences_run_one_by_one(traced):
    """A packed micro-batch: attention stays inside each sequence, positions restart."""
    _, model, tm = traced
    lengths = [5, 1, 7, 3]
    ids, positions, targets = batch((1, 16), seed=4, lengths=lengths)
    separate, start = 0.0, 0
    for n in lengths:
        sl = slice(start, start + n)
        separate = separate + eager_loss(model, ids[:, sl], positions[:, sl], targets[:, sl])
        start += n
    torch.testing.assert_close(tm.run(ids, positions, targets), separate, rtol=1e-6, atol=1e-5)


def test_names_match_named_parameters(traced):
    name, model, tm = traced
    assert list(tm.param_names.values()) == [n for n, _ in model.named_parameters()]
    assert list(tm.buffer_names.values()) == [n for n, _ in model.named_buffers()]
    assert tm.input_names == ("input_ids", "position_ids", "targets")
    placeholders = [n.name for n in tm.graph_module.graph.nodes if n.op == "placeholder"]
    assert placeholders == [*tm.param_names, *tm.buffer_names, *tm.input_names]
    expected_tied = {
        "llama_tied": {"lm_head.weight": "embed.weight"},
        "hf_gpt2": {"lm_head.weight": "transformer.wte.weight"},
    }.get(name, {})
    assert tm.tied == expected_tied


def test_canonical_graph_has_packed_attention_and_no_dense_mask(traced):
    _, _, tm = traced
    targets = [n.target for n in tm.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count(packed_attention) == 2
    banned = {torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.index.Tensor,
              torch.ops.aten.cumsum.default, torch.ops.aten._assert_tensor_metadata.default,
              torch.ops.aten.dropout.default}
    assert not banned & set(targets)
    assert "packed_attention×2" in str(tm)


def test_layer_of_parses_layer_index(traced):
    name, _, tm = traced
    per_layer = {fqn: tm.layer_of(fqn) for fqn in tm.param_names.values()}
    assert {v for v in per_layer.values() if v is not None} == {0, 1}
    outside = {fqn for fqn, layer in per_layer.items() if layer is None}
    assert outside == {
        "llama": {"embed.weight", "norm.weight", "lm_head.weight"},
        "llama_tied": {"embed.weight", "norm.weight"},
        "hf_llama": {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"},
        "hf_gpt2": {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                    "transformer.ln_f.bias"},
    }[name]
    assert tm.layer_of("transformer.h.11.mlp.c_fc.weight") == 11


def test_user_loss_function_is_traced():
    model = Llama(seed=2)

    def z_loss(logits, targets):
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return ce + logits.logsumexp(-1).pow(2).sum()

    tm = trace(model, {"input_ids": torch.randint(0, 256, (1, 8))}, loss_fn=z_loss)
    assert tm.dynamic  # a batch of 1 in the example does not pin the batch size
    ids, positions, targets = batch((2, 12))
    targets[0, -1] = 3
    assert torch.equal(tm.run(ids, positions, targets), z_loss(model(ids, positions), targets))


class ShapeSpecific(nn.Module):
    """Depends on the sequence length: export cannot keep the length symbolic."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, input_ids, position_ids=None):
        h = self.embed(input_ids)
        if input_ids.shape[1] > 8:
            h = h * 2
        return self.head(h)


def test_shape_specialising_model_falls_back_to_static_graph_per_shape(caplog):
    """The fallback is said on the ``hgraph.frontend.capture`` logger: a warning with the reason, and
    each shape traced again."""
    caplog.set_level(logging.INFO, logger="hgraph.frontend.capture")
    model = ShapeSpecific()
    tm = trace(model, torch.randint(0, 32, (2, 6)))
    assert not tm.dynamic
    [fallback] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert fallback.name == "hgraph.frontend.capture" and fallback.getMessage() == (
        f"ShapeSpecific: traced with static shapes, one graph per [batch, seq] shape, because {tm.static_reason}")
    assert "branches on the sequence length in Python" in tm.static_reason
    for shape in [(2, 6), (2, 12)]:
        ids, positions, targets = (t % 32 for t in batch(shape))
        targets[0, -1] = -100
        assert torch.equal(tm.run(ids, positions, targets), eager_loss(model, ids, positions, targets))
    assert tm.graph_for(2, 6) is tm.graph_module and tm.graph_for(2, 12) is not tm.graph_module
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "ShapeSpecific: tracing again for shape [2, 12] (static shapes: one graph per shape)"]


def test_compiling_a_shape_specialising_model_is_refused():
    """Compiled programs serve every micro-batch shape from one graph; a model traced per shape would run
    a graph of the wrong shape (a traceback from inside torch), so compile refuses it, saying why."""
    with pytest.raises(TraceError, match=r"cannot compile ShapeSpecific: one traced graph must serve every "
                                         r"micro-batch length, and it branches on the sequence length in Python: "
                                         r"module '<root>' \(ShapeSpecific\) at .*test_frontend.py:\d+: "
                                         r"`if input_ids.shape\[1\] > 8:`"):
        hgraph.compile(ShapeSpecific(), ["tp1"], example_inputs=torch.randint(0, 32, (2, 6)))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.ModuleDict({"gate": Gate()})

    def forward(self, input_ids, position_ids=None):
        return self.block["gate"](input_ids)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 32)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if h.sum() > 0:
            return h
        return -h


class NumpyCall(Gate):
    def forward(self, input_ids, position_ids=None):
        return torch.from_numpy(self.embed(input_ids).detach().numpy())


def test_data_dependent_control_flow_names_module_and_line():
    with pytest.raises(TraceError) as info:
        trace(DataDependent(), torch.randint(0, 32, (2, 8)))
    message = str(info.value)
    assert "data-dependent control flow" in message
    assert "module 'block.gate' (Gate)" in message
    assert "test_frontend.py" in message and "if h.sum() > 0:" in message
    assert "Traceback" not in message and len(message) < 600


def test_unsupported_op_names_it():
    with pytest.raises(TraceError, match=r"\.numpy\(\).*torch.from_numpy\(self.embed"):
        trace(NumpyCall(), torch.randint(0, 32, (2, 8)))


def long_zeros(*shape):
    return torch.zeros(*shape, dtype=torch.long)


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"input_ids": long_zeros(2, 4), "labels": long_zeros(2, 4)}, "keys"),
        (torch.zeros(2, 4), "int64 tensor"),
        ((long_zeros(2, 4), long_zeros(2, 5)), "position_ids has shape"),
    ],
)
def test_bad_example_inputs(inputs, message):
    with pytest.raises(InputError, match=message):
        trace(Llama(), inputs)


class TinyAttention(nn.Module):
    """One attention layer whose mask and dropout are configurable, for canonicalisation checks."""

    def __init__(self, mask_kind: str, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.drop = nn.Dropout(dropout)
        self.mask_kind = mask_kind

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        q, k, v = self.qkv(self.drop(self.embed(input_ids))).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.mask_kind == "causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mask_kind == "sliding":  # from position_ids, but not the block-causal mask
            mask = (position_ids[:, None, :, None] - position_ids[:, None, None, :]).abs() < 3
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # padding mask from the token values
            mask = (input_ids != 0)[:, None, None, :].expand(b, 1, s, s)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, 16) @ self.embed.weight.T


@pytest.mark.parametrize("kind, packed", [("causal", True), ("sliding", False), ("padding", False)])
def test_only_block_causal_attention_becomes_packed_attention(kind, packed):
    model = TinyAttention(kind)
    tm = trace(model, torch.randint(1, 32, (2, 10)))
    targets = {n.target for n in tm.graph_module.graph.nodes if n.op == "call_function"}
    assert (packed_attention in targets) == packed
    assert (torch.ops.aten.scaled_dot_product_attention.default in targets) == (not packed)
    ids, positions, tgt = (t % 32 for t in batch((2, 10)))
    assert torch.equal(tm.run(ids, positions, tgt), eager_loss(model, ids, positions, tgt))


def test_training_mode_dropout_is_kept():
    model = TinyAttention("causal", dropout=0.5).train()
    tm = trace(model, torch.randint(1, 32, (2, 10)))
    targets = [n.target for n in tm.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.dropout.default in targets


def test_a_sliced_example_does_not_pin_the_shapes():
    """``ids[:, :8]`` is a view with the parent's row stride; the graph must still serve every length."""
    model = tiny_hf_llama()
    ids = torch.randint(0, 256, (2, 24))
    tm = trace(model, ids[:, :8])
    assert tm.dynamic
    _, positions, targets = batch((2, 24))
    torch.testing.assert_close(tm.run(ids, positions, targets), eager_loss(model, ids, positions, targets))
