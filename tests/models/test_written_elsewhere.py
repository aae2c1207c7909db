"""Models written the way research code is (not by this team, not HuggingFace): compiled with 8-token
examples for tp x dp and tp x pp and ``simulate``-d on the zoo's documents (up to 30 tokens) against the
unmodified model, loss and every gradient (``hgraph.cli.zoo_check.check_model``). nanoGPT's style
(``nanogpt_style.py``): the ``block_size`` assert and the sliced ``tril`` buffer need the sequence bound
export finds; SDPA followed by ``transpose(1, 2).contiguous().view`` needs the traced layout kept.
``torch.nn``'s parts (``torch_nn_style.py``): ``nn.MultiheadAttention``'s packed q/k/v unflattened
``(3, E)`` is cut block by block; einsum attention and its ``triu`` mask have rules from the equation.
x-transformers (from PyPI, a test dependency, used as installed): its Decoder with several options; the
options that branch on the length in Python are refused naming the line. Training libraries' model code,
as installed: litgpt's ``GPT`` (its ``if max_seq_length < T: raise`` is a bound; Mixtral-style routing by
``torch.where(mask)`` has data-dependent sizes), torchtune's component builders, OLMo-core's
``Transformer`` (below its RoPE cache, ``max_seq_len``)."""

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


# ----------------------------------------------------------------------------- training libraries' model code
# Each library's own model class, as installed (test extra / Makefile), at one tiny size: 2 layers, dim 64,
# 4 heads (2 key/value heads where grouped), vocab 128, fp32, no dropout, at most 64 tokens. Their
# ``forward(input_ids)`` returns the logits, so no adapter is needed. The fast tier keeps one model per
# thing hgraph had to learn; the others are slow.

# litgpt 0.5.13: GPT with the config of a named checkpoint, sizes shrunk (its options kept)
LITGPT_SIZE = dict(n_layer=2, n_embd=64, n_head=4, head_size=16, intermediate_size=128, block_size=64,
                   vocab_size=128, padded_vocab_size=128)
LITGPT_FAST = {
    "pythia": ("pythia-14m", {}),  # LayerNorm, parallel residual, a quarter of each head rotary, biases
    "llama-3.2": ("Llama-3.2-1B", {"n_query_groups": 2}),  # RMSNorm, SwiGLU, GQA, llama3 rope scaling
    "mixtral": ("Mixtral-8x7B-v0.1", {"n_query_groups": 2, "n_expert": 4, "n_expert_per_token": 2}),  # torch.where routing
}
LITGPT_SLOW = {
    "gemma": ("Gemma-2b", {"n_query_groups": 2}),  # GeGLU, scaled embeddings
    "phi-2": ("phi-2", {}),  # shared attention norm, partial rotary, head bias
    "qwen3": ("Qwen3-0.6B", {"n_query_groups": 2}),  # q/k norm
    "olmo-2": ("OLMo-2-1124-7B", {"n_query_groups": 4}),  # olmo2 q/k norm, post-attention/post-mlp norms
    "falcon": ("falcon-7b", {"n_query_groups": 1}),  # multi-query attention: 1 kv head on tp2
    "qwen2.5": ("Qwen2.5-0.5B", {"n_query_groups": 2}),  # q/k/v biases
}


def _litgpt(name: str, options: dict) -> torch.nn.Module:
    pytest.importorskip("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    torch.manual_seed(0)
    return GPT(Config.from_name(name, **{**LITGPT_SIZE, **options})).eval()


@pytest.mark.parametrize("name, options", list(LITGPT_FAST.values()), ids=list(LITGPT_FAST))
def test_litgpt_trains_equal(name, options):
    results = check_model(_litgpt(name, options), STRATEGIES)
    assert [r.status for r in results] == ["equal", "equal"], "\n".join(map(str, results))


@pytest.mark.slow
@pytest.mark.parametrize("name, options", list(LITGPT_SLOW.values()), ids=list(LITGPT_SLOW))
def test_litgpt_more_configs_train_equal(name, options):
    test_litgpt_trains_equal(name, options)


def test_litgpt_sliding_window_mask_built_in_a_loop_is_refused_naming_the_line():
    """Gemma 2's sliding window: litgpt fills the mask row by row, ``for i in range(T)``."""
    model = _litgpt("Gemma-2-2b", {"n_query_groups": 2, "sliding_window_size": 8})
    results = check_model(model, STRATEGIES[:1])
    assert [r.status for r in results] == ["error"], "\n".join(map(str, results))
    detail = results[0].detail
    assert "TraceError" in detail and "litgpt/model.py:" in detail and "for i in range(T)" in detail
    assert "module 'transformer.h.0.attn' (CausalSelfAttention)" in detail


# torchtune 0.6.1: the TransformerDecoder of each family's component builder
TORCHTUNE_SIZE = dict(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=64,
                      intermediate_dim=128)
TORCHTUNE_FAST = {
    "llama3_2": ("llama3_2", {}),  # tied embeddings, scaled rope
    "qwen2": ("qwen2", {}),  # q/k/v biases
}
TORCHTUNE_SLOW = {
    "llama2": ("llama2", {}),
    "llama3": ("llama3", {}),
    "llama3_1": ("llama3_1", {}),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {"num_kv_heads": 4}),  # fused qkv
    "gemma": ("gemma", {"head_dim": 16}),  # GeGLU, scaled embeddings, tied
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window_size": 8}),  # soft-capping, sliding window
}


def _torchtune(family: str, options: dict) -> torch.nn.Module:
    pytest.importorskip("torchtune")
    import importlib

    builder = getattr(importlib.import_module(f"torchtune.models.{family}._component_builders"), family)
    torch.manual_seed(0)
    return builder(**{**TORCHTUNE_SIZE, **options}).eval()


@pytest.mark.parametrize("family, options", list(TORCHTUNE_FAST.values()), ids=list(TORCHTUNE_FAST))
def test_torchtune_trains_equal(family, options):
    results = check_model(_torchtune(family, options), STRATEGIES)
    assert [r.status for r in results] == ["equal", "equal"], "\n".join(map(str, results))


@pytest.mark.slow
@pytest.mark.parametrize("family, options", list(TORCHTUNE_SLOW.values()), ids=list(TORCHTUNE_SLOW))
def test_torchtune_more_families_train_equal(family, options):
    test_torchtune_trains_equal(family, options)


# OLMo-core 2.6.0: TransformerConfig.llama_like with its block types. Its RoPE reuses a sin/cos cache
# while ``cache.shape[-2] >= seq_len`` (a branch on the length); ``init_weights(max_seq_len=64)`` fills
# the cache as OLMo-core's trainer does, and ``CompileOptions(max_seq_len=64)``, which the refusal
# names, says lengths stay there, so the branch is always the cache's.
OLMO_FAST = {"llama": {"n_kv_heads": 2}}
OLMO_SLOW = {"olmo2": {"qk_norm": True, "block_name": "reordered_norm"}, "peri-norm": {"block_name": "peri_norm"}}
OLMO_MAX_LEN = hgraph.CompileOptions(max_seq_len=64)


def _olmo(options: dict) -> torch.nn.Module:
    pytest.importorskip("olmo_core")
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    if "block_name" in options:
        options = {**options, "block_name": TransformerBlockType(options["block_name"])}
    torch.manual_seed(0)
    config = TransformerConfig.llama_like(d_model=64, vocab_size=128, n_layers=2, n_heads=4,
                                          hidden_size_multiple_of=64, **options)
    model = config.build(init_device="cpu")
    model.init_weights(max_seq_len=64, device=torch.device("cpu"))
    return model.eval()


@pytest.mark.parametrize("options", list(OLMO_FAST.values()), ids=list(OLMO_FAST))
def test_olmo_core_trains_equal_below_its_rope_cache(options):
    results = check_model(_olmo(options), STRATEGIES, options=OLMO_MAX_LEN)
    assert [r.status for r in results] == ["equal", "equal"], "\n".join(map(str, results))


@pytest.mark.slow
@pytest.mark.parametrize("options", list(OLMO_SLOW.values()), ids=list(OLMO_SLOW))
def test_olmo_core_more_blocks_train_equal(options):
    test_olmo_core_trains_equal_below_its_rope_cache(options)


def test_olmo_core_rope_cache_branch_is_refused_naming_the_line_without_max_seq_len():
    results = check_model(_olmo(OLMO_FAST["llama"]), STRATEGIES[:1])
    assert [r.status for r in results] == ["error"], "\n".join(map(str, results))
    detail = results[0].detail
    assert "TraceError" in detail and "olmo_core/nn/rope.py:" in detail and "pos_sin.shape[-2] >= seq_len" in detail
    assert "module 'blocks.0.attention.rope' (RotaryEmbedding)" in detail and "max_seq_len" in detail


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
