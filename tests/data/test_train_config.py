"""``hgraph train CONFIG`` on a local corpus: one-line errors for bad configs and data, and a run
that checkpoints, resumes and exports a model ``from_pretrained`` loads."""

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from hgraph.cli.command import main
from hgraph.data import stdlib_tokenizer

MODEL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "tie_word_embeddings": False}


def setup_run(tmp_path, **over):
    """A corpus (the stdlib's json package), a held-out file, an HF model config, a TOML config."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    shutil.copytree(stdlib / "json", tmp_path / "corpus", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "held").mkdir()
    shutil.copy(stdlib / "csv.py", tmp_path / "held" / "csv.py")
    (tmp_path / "model.json").write_text(json.dumps({**MODEL, **over.pop("model", {})}))
    cfg = {"model": "model.json", "strategies": ["2x tp1", "tp2"], "world_size": 2, "iterations": 3,
           "optimizer": {"lr": 3e-3}, "lr_schedule": {"kind": "cosine", "warmup": 1}, "out": str(tmp_path / "out"),
           "data": {"paths": ["corpus"], "tokenizer": stdlib_tokenizer().path, "context": 96,
                    "tokens_per_iteration": 384, "window": 4},
           "eval": {"paths": ["held"], "interval": 3, "batches": 1},
           "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 3, "resume": True},
           "export": {"dir": str(tmp_path / "export")}}
    for key, value in over.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg.get(key, {}), **value}
        else:
            cfg[key] = value
    path = tmp_path / "train.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("over, message", [
    ({"data": {"context": "long"}}, "data.context: expected int, got 'long'"),
    ({"data": {"contxt": 5}}, r"data.contxt: unknown key; did you mean 'data.context'\?"),
    ({"data": {"frobnicate": 5}}, r"data.frobnicate: unknown key; valid: context, .*window"),
    ({"strategies": "best"}, "strategies\\[0\\] = 'best': cannot parse 'best'"),
    ({"strategies": []}, "strategies: expected \"auto\" or a non-empty list"),
    ({"data": {"paths": ["missing_dir"]}}, "missing_dir'?: no such file or directory"),
    ({"data": {"tokenizer": "nope.json"}}, "tokenizer .*nope.json'?: no such file"),
    ({"model": {"vocab_size": 256}}, "data.tokenizer: .* has 512 tokens but the model's vocabulary is 256"),
    ({"lr_schedule": {"kind": "linear"}}, "lr_schedule: lr_schedule.kind='linear'; expected one of 'constant', 'cosine'"),
    ({"compile": {"compute_dtype": "fp8"}}, "compile.compute_dtype: 'fp8'; expected one of 'float32', 'bfloat16', 'float16'"),
    ({"compile": {"schedule": {"pipelin": "zb1p"}}}, r"compile.schedule.pipelin: unknown key; did you mean 'compile.schedule.pipeline'\?"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr: expected float, got 'fast'"),
    ({"optimizer": {"betas": [0.9, 1.5]}}, r"optimizer: invalid AdamW settings .*betas=\(0.9, 1.5\)"),
    ({"lr": 3e-3}, r"lr: now optimizer.lr \(the \[optimizer\] table\)"),
    ({"schedule": "overlap"}, r"schedule: now the \[compile.schedule.overlap\] table"),
    ({"planner": "greedy"}, "planner.mode: 'greedy'; expected one of 'auto', 'none'"),
    ({"compile": {"schedule": {"pipeline": "zb1p", "overlap": {}}}},
     r"compile.schedule: schedule.pipeline='zb1p' with schedule.overlap is not supported yet"),
    ({"backend": "nccl", "device": "cpu"}, "NCCL runs on GPUs"),
])
def test_bad_configs_get_one_line_errors(tmp_path, capsys, over, message):
    import re

    assert main(["train", setup_run(tmp_path, **over)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_bad_data_gets_one_line_errors(tmp_path, capsys):
    path = setup_run(tmp_path)
    for f in (tmp_path / "corpus").iterdir():
        f.write_text("")
    assert main(["train", path]) == 1
    err = capsys.readouterr().err.strip()
    assert "data.paths:" in err and "corpus is empty" in err and len(err.splitlines()) == 1
    (tmp_path / "corpus" / "decoder.py").write_bytes(b"x = 1\n\xff\n")
    assert main(["train", path]) == 1
    err = capsys.readouterr().err.strip()
    assert "decoder.py: byte 6 (0xff) is not valid UTF-8" in err and len(err.splitlines()) == 1


@pytest.mark.slow  # make test-all / CI; the default run covers the feature elsewhere
@pytest.mark.timeout(600)
def test_train_checkpoint_resume_export(tmp_path, capsys, monkeypatch):
    import torch
    import transformers

    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))  # the default planner profiles once, here
    path = setup_run(tmp_path)
    assert main(["train", path]) == 0
    first = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert first["iterations"] == 3 and (tmp_path / "ckpt" / "step-00000003" / "manifest.json").is_file()
    first_history = json.loads((tmp_path / "out" / "history.json").read_text())
    cfg = json.loads(Path(path).read_text())
    cfg["iterations"] = 5
    Path(path).write_text(json.dumps(cfg))
    assert main(["train", path]) == 0
    out = capsys.readouterr().out
    assert "held-out loss" in out and "tokens/s" in out
    resumed = json.loads((tmp_path / "out" / "summary.json").read_text())
    history = json.loads((tmp_path / "out" / "history.json").read_text())
    assert resumed["iterations"] == 2 and resumed["first_iteration"] == 3
    assert [h["iteration"] for h in history] == [0, 1, 2, 3, 4] and history[:3] == first_history  # over the resume
    evals = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert [e["iteration"] for e in evals] == [0, 3, 5]  # the first run's evaluation before the resume, then ours
    assert evals[1]["loss"] == pytest.approx(first["heldout_last"], rel=1e-6)
    assert (tmp_path / "out" / "loss.png").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert model.config.vocab_size == 512
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the exported directory as the model of a new run: it starts from the trained weights
    cfg.update(model=str(tmp_path / "export"), iterations=1, checkpoint={}, export={}, out=str(tmp_path / "out2"))
    Path(path).write_text(json.dumps(cfg))
    assert main(["train", path]) == 0
    again = json.loads((tmp_path / "out2" / "eval.json").read_text())
    assert again[0]["iteration"] == 0 and again[0]["loss"] == pytest.approx(resumed["heldout_last"], rel=1e-5)


def test_example_config_names_the_embedded_corpus():
    from hgraph.cli.train_cli import precheck
    from hgraph.cli.train_run import loaders
    from hgraph.training.train_config import read_config

    example = Path(__file__).parents[2] / "examples" / "configs" / "stdlib.toml"
    cfg = read_config(str(example))
    assert cfg.data.paths == ("hgraph:stdlib",) and cfg.model.endswith("configs/tiny_llama.json")
    precheck(cfg)
    train, held = loaders(cfg)
    assert len(train.source.files) > 1000 and not set(train.source.files) & set(held.source.files)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_auto_strategies_profile_and_propose(tmp_path, monkeypatch):
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    path = setup_run(tmp_path, strategies="auto", iterations=2, eval={"interval": 0},
                     checkpoint={"interval": 0, "resume": False}, export={"dir": str(tmp_path / "export")})
    assert main(["train", path]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["strategies"]
    history = json.loads((tmp_path / "out" / "history.json").read_text())
    assert all(h["predicted_ms"] is not None for h in history)  # the planner chose each iteration
