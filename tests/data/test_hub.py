"""Hub ids (``"org/name"``, ``"name"``) resolve through a local HF cache built here, in the cache's own
layout (``models--org--name/snapshots/<hash>/``, ``refs/main``); an id the cache lacks is one
``InputError`` naming it and how to fetch it. Nothing is downloaded."""

import json

import pytest
import torch
import transformers

from hgraph.cli.model_spec import ModelSpec
from hgraph.data import load_tokenizer, stdlib_tokenizer
from hgraph.data.hub import is_hub_id, local_or_cached
from hgraph.errors import InputError
from hgraph.training.train_config import read_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY = dict(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty HF hub cache under ``tmp_path`` (``HF_HOME``), offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder shadows the ids
    return tmp_path / "hf" / "hub"


def snapshot(cache, repo_id):
    """The snapshot folder of ``repo_id`` at ``COMMIT``, with ``refs/main`` naming it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    folder = repo / "snapshots" / COMMIT
    folder.mkdir(parents=True)
    return folder


def test_a_cached_model_id_loads_from_the_cache(cache):
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    folder = snapshot(cache, "org/tiny")
    saved.save_pretrained(folder)
    assert local_or_cached("org/tiny", "model") == folder
    spec = ModelSpec("org/tiny")
    assert spec.weights == str(folder)  # what the Trainer reads by slices under hgraph train
    loaded = spec()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), saved.state_dict().values()))
    assert ModelSpec("org/tiny", meta=True)().model.embed_tokens.weight.is_meta


def test_a_cached_config_only_id_is_a_random_init(cache):
    (snapshot(cache, "gpt-tiny") / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    model = ModelSpec("gpt-tiny", seed=3)()
    assert model.config.hidden_size == 16


def test_a_cached_tokenizer_id_loads_from_the_cache(cache):
    tok = stdlib_tokenizer()
    transformers.PreTrainedTokenizerFast(tokenizer_file=tok.path, eos_token="<|endoftext|>").save_pretrained(
        snapshot(cache, "org/tok"))
    loaded = load_tokenizer("org/tok")
    assert (loaded.vocab_size, loaded.eos_id) == (tok.vocab_size, tok.eos_id)
    assert loaded.encode_batch(["def f(x):"]) == tok.encode_batch(["def f(x):"])


@pytest.mark.parametrize("load, what", [(lambda i: ModelSpec(i)(), "model"), (load_tokenizer, "tokenizer")])
def test_an_id_missing_from_the_cache_names_it_and_how_to_fetch_it(cache, load, what):
    snapshot(cache, "org/other")
    with pytest.raises(InputError) as info:
        load("org/missing")
    message = str(info.value)
    assert message.startswith(f"{what} 'org/missing': ") and "\n" not in message
    assert "hf download org/missing" in message and str(cache) in message


def test_hub_ids_against_paths():
    assert is_hub_id("gpt2") and is_hub_id("meta-llama/Llama-3.2-1B")
    assert not any(is_hub_id(t) for t in ("model.json", "my/config.json", "a/b/c", "mod:factory", "./x", "~/m"))


def test_the_config_keeps_a_hub_id_and_resolves_a_file_next_to_it(tmp_path, cache):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "tok.json").write_text("{}")
    config = {"model": "org/tiny", "strategies": ["tp1"], "world_size": 1,
              "data": {"paths": ["corpus"], "tokenizer": "org/tok"}}
    (tmp_path / "cfg" / "a.json").write_text(json.dumps(config))
    cfg = read_config(str(tmp_path / "cfg" / "a.json"))
    assert (cfg.model, cfg.data.tokenizer) == ("org/tiny", "org/tok")
    config["data"]["tokenizer"] = "tok.json"
    (tmp_path / "cfg" / "b.json").write_text(json.dumps(config))
    assert read_config(str(tmp_path / "cfg" / "b.json")).data.tokenizer == str(tmp_path / "cfg" / "tok.json")
