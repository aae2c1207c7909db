"""Models written the way research code is (not by this team, not HuggingFace): compiled with 8-token
examples for tp x dp and tp x pp and ``simulate``-d on the zoo's documents (up to 30 tokens) against the
unmodified model, loss and every gradient (``hgraph.cli.zoo_check.check_model``). nanoGPT's style
(``nanogpt_style.py``): the ``block_size`` assert and the sliced ``tril`` buffer need the sequence bound
export finds; SDPA followed by ``transpose(1, 2).contiguous().view`` needs the traced layout kept.
``torch.nn``'s parts (``torch_nn_style.py``): ``nn.MultiheadAttention``'s packed q/k/v unflattened
``(3, E)`` is cut block by block; einsum attention and its ``triu`` mask have rules from the equation.
x-transformers (from PyPI, a test dependency, used as installed): its Decoder with several options; the
options that branch on the length in Python are refused naming the line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hgraph
from hgraph.cli.zoo_check import check_model
from hgraph.frontend.loss_module import output_logits
from hgraph.training.configs import AdamWConfig, RunConfig
from hgraph.training.trainer import Trainer
from nanogpt_style import GPT, GPTConfig
from test_zoo_training import OPT, PACKED_TOKENS, STEP_ATOL, documents
from torch_nn_style import EinsumLM, EncoderLM, MHALM

STRATEGIES = ("tp2 + 2x tp1", "tp2,pp2")


@pytest.mark.parametrize("flash", [False, True], ids=["masked-softmax", "sdpa"])
def test_nanogpt_style_trains_equal(flash):
    torch.manual_seed(0)
    results = check_model(GPT(GPTConfig(flash=flash)).eval(), STRATEGIES, name=f"nanogpt-{flash}")
    assert [r.status for r in results] == ["equal", "equal"], "\n".join(map(str, results))


@pytest.mark.parametrize("model", [EncoderLM, MHALM, EinsumLM], ids=lambda m: m.__name__)
def test_torch_nn_style_trains_equal(model):
    torch.manual_seed(0)
    results = check_model(model().eval(), STRATEGIES)
    assert [r.status for r in results] == ["equal", "equal"], "\n".join(map(str, results))


# x-transformers (lucidrains), as installed from PyPI: TransformerWrapper over a Decoder, several options
X_EQUAL = {
    "plain": {},
    "rotary": {"rotary_pos_emb": True},
    "gqa": {"attn_kv_heads": 2},
    "glu-rotary": {"ff_glu": True, "rotary_pos_emb": True},
    "flash-rotary": {"attn_flash": True, "rotary_pos_emb": True},
}
# options whose code branches on the sequence length in Python: refused, naming the line
X_REFUSED = {
    "alibi": ({"alibi_pos_bias": True, "alibi_num_heads": 4}, "x_transformers.py"),  # a cached bias reused while long enough
    "rel-pos": ({"rel_pos_bias": True}, "einx"),  # einx reads the shape as Python ints
}


def _x_transformer(options: dict):
    x_transformers = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    decoder = x_transformers.Decoder(dim=64, depth=2, heads=4, **options)
    return x_transformers.TransformerWrapper(num_tokens=128, max_seq_len=64, attn_layers=decoder).eval()


@pytest.mark.parametrize("options", list(X_EQUAL.values()), ids=list(X_EQUAL))
def test_x_transformers_decoder_trains_equal(options):
    results = check_model(_x_transformer(options), STRATEGIES)
    assert [r.status for r in results] == ["equal", "equal"], "\n".join(map(str, results))


@pytest.mark.parametrize("options, where", list(X_REFUSED.values()), ids=list(X_REFUSED))
def test_x_transformers_length_branches_are_refused_naming_the_line(options, where):
    results = check_model(_x_transformer(options), STRATEGIES[:1])
    assert [r.status for r in results] == ["error"], "\n".join(map(str, results))
    assert "TraceError" in results[0].detail and where in results[0].detail and ".py:" in results[0].detail


# ----------------------------------------------------------------------------- the path training takes
TRAINED = ("MHALM", "x-transformers-flash-rotary")


def _build(name: str) -> torch.nn.Module:
    if name == "MHALM":
        torch.manual_seed(0)
        return MHALM().eval()
    return _x_transformer(X_EQUAL["flash-rotary"])


def train_one_step(names: tuple[str, ...]) -> dict[str, object]:
    """On every rank: one tp2 Trainer step per model on packed documents; loss, parameters and the
    micro-batch sizes (module level: spawned ranks import it)."""
    out: dict[str, object] = {}
    for name in names:
        model = _build(name)
        compiled = hgraph.compile(model, ["tp2"], example_inputs=torch.randint(0, 128, (1, 8)))
        trainer = Trainer(compiled, optimizer=AdamWConfig(**OPT), run=RunConfig(micro_batch_tokens=PACKED_TOKENS))
        batch = documents(128)
        packing = [len(mb) for mb in trainer.dispatch([len(d) for d in batch]).micro_batches[0]]
        out[name] = (trainer.step(batch), trainer.full_parameters(), packing)
    return out


def test_trainer_step_on_two_gloo_ranks_equals_adamw():
    results = hgraph.launch(train_one_step, 2, args=(TRAINED,), timeout=600)
    for name in TRAINED:
        model = _build(name)
        opt = torch.optim.AdamW(model.parameters(), **OPT)
        batch = documents(128)
        tokens = sum(len(d) - 1 for d in batch)
        want_loss = 0.0
        for d in batch:
            loss = F.cross_entropy(output_logits(model(d[None]))[0, :-1], d[1:], reduction="sum") / tokens
            loss.backward()
            want_loss += loss.item()
        opt.step()
        for rank, (loss, params, _packing) in enumerate(r[name] for r in results):
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} rank {rank} loss: {m}")
            for pname, value in model.named_parameters():
                torch.testing.assert_close(params[pname], value.detach(), rtol=1e-5, atol=STEP_ATOL,
                                           msg=lambda m: f"{name} rank {rank} {pname}: {m}")
    packed = {name: max(results[0][name][2]) > 1 for name in TRAINED}
    assert packed == {"MHALM": False, "x-transformers-flash-rotary": True}, packed  # see docs/models.md
