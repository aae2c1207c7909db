"""``hgraph train`` builds HF models on the meta device: a ``config.json`` is initialised layer by layer,
a local checkpoint directory is read by slices; a run from a checkpoint starts from its weights."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from hgraph.cli.command import main
from hgraph.cli.model_spec import ModelSpec
from hgraph.cli.train_cli import length_batches
from hgraph.cli.train_run import synthetic_sequence
from hgraph.training.train_config import read_config

MODEL = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


@pytest.fixture
def checkpoint(tmp_path):
    config = transformers.AutoConfig.for_model(**MODEL)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    return tmp_path / "ckpt"


def test_model_spec_builds_hf_models_on_meta(tmp_path, checkpoint):
    (tmp_path / "model.json").write_text(json.dumps(MODEL))
    from_config = ModelSpec(str(tmp_path / "model.json"), meta=True)
    assert from_config.weights is None
    assert all(p.is_meta for p in from_config().parameters())
    from_dir = ModelSpec(str(checkpoint), meta=True)
    assert from_dir.weights == str(checkpoint)
    assert all(p.is_meta for p in from_dir().parameters())
    eager = ModelSpec(str(checkpoint))()  # meta=False: from_pretrained, as profiling needs
    want = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), want.state_dict().values()))


@pytest.mark.slow  # gloo ranks
@pytest.mark.timeout(900)
def test_train_from_a_checkpoint_directory_starts_from_its_weights(tmp_path, checkpoint):
    cfg = {"model": str(checkpoint), "strategies": ["tp2", "tp1,pp2"], "world_size": 2, "iterations": 1,
           "data": {"lengths": "wikipedia", "tokens_per_iteration": 256, "max_len": 64},
           "export": {"dir": str(tmp_path / "export")}, "out": str(tmp_path / "run")}
    path = tmp_path / "train.json"
    path.write_text(json.dumps(cfg))
    assert main(["train", str(path)]) == 0
    first = json.loads((tmp_path / "run" / "history.json").read_text())[0]
    # the oracle: the unmodified model from_pretrained on the run's first batch
    config = read_config(str(path))
    g = torch.Generator().manual_seed(config.seed * 100_003)
    batch = [synthetic_sequence(n, 256, g) for n in length_batches(config)[0]]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for seq in batch:
            logits = model(seq[None]).logits[0, :-1].double()
            total += float(F.cross_entropy(logits, seq[1:], reduction="sum"))
            tokens += len(seq) - 1
    assert first["loss"] == pytest.approx(total / tokens, rel=1e-5)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert all(torch.isfinite(p).all() for p in exported.parameters())
