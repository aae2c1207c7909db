"""The one typed config of ``hgraph train``: every key of the dataclasses is read from TOML, is a
``--section.key`` flag listed by ``--help`` with its docstring, and is written to the run folder's
``config.toml``, which reads back to the same config. Oracles: ``tomllib`` (a reader other than the
code that writes), the values as written in the test, argparse's own help text."""

import re
import tomllib

import pytest
import torch

from hgraph.cli.command import build_parser, main
from hgraph.cli.train_cli import configured
from hgraph.errors import InputError
from hgraph.program.options import OverlapConfig
from hgraph.training.config_toml import to_toml
from hgraph.training.train_config import read_config, train_keys

# Every key, with a value other than its default but for the keys of VARIANT (layers and every, a cost
# table and planner = "none", overlap and zb1p or coalesce exclude each other). Paths are absolute, so
# they are written back as they are.
FULL = """
model = "hgraph.cli.demo:tiny_model"
strategies = ["tp2", "2x tp1"]
world_size = 2
iterations = 7
seed = 3
out = "{tmp}/run"
backend = "gloo"
device = "cpu"

[data]
paths = ["{tmp}/corpus", "{tmp}/more/*.txt"]
tokenizer = "hgraph:stdlib"
format = "jsonl"
text_field = "body"
context = 96
tokens_per_iteration = 384
long_documents = "cut"
seed = 5
window = 4
lengths = "{tmp}/lengths.txt"
max_len = 64
length_scale = 2

[eval]
paths = ["{tmp}/held"]
interval = 3
batches = 2

[checkpoint]
dir = "{tmp}/ckpt"
interval = 3
resume = true
keep = 0
async = false

[export]
dir = "{tmp}/export"

[planner]
mode = "auto"
cost_table = "llama7b_a800"
memory_gb = 0.5

[metrics]
dir = "{tmp}/metrics"
jsonl = false
tensorboard = false
console = false
wandb = true
peak_tflops = 0.5

[optimizer]
lr = 0.0003
weight_decay = 0.01
betas = [0.8, 0.95]
eps = 1e-06
grad_clip = 0.5

[lr_schedule]
kind = "cosine"
warmup = 2
min_lr_ratio = 0.2

[compile]
compute_dtype = "bfloat16"
reduce_dtype = "bfloat16"
sequence_parallel = true
vocab_parallel = false
packing = "off"
max_seq_len = 128

[compile.recompute]
mode = "selective"
layers = [0, 2]
keep_communication = false

[compile.schedule]
pipeline = "1f1b"
coalesce = false

[compile.schedule.overlap]
prefetch_layers = 2
bucket_bytes = 4096
max_inflight_bytes = 65536

[compile.build]
verify = false
cache_dir = "{tmp}/plans"
trust_shared_cache = true

[run]
micro_batch_tokens = 1024
"""
VARIANT = {  # FULL with these replacements: the keys FULL leaves at their defaults or out
    "layers = [0, 2]": "every = 2",
    'mode = "auto"\ncost_table = "llama7b_a800"\nmemory_gb = 0.5': 'mode = "none"',
    'pipeline = "1f1b"\ncoalesce = false': 'pipeline = "zb1p"\ncoalesce = true',
    "[compile.schedule.overlap]\nprefetch_layers = 2\nbucket_bytes = 4096\nmax_inflight_bytes = 65536\n": "",
}
VARIED = {"compile.recompute.every", "planner.mode", "compile.schedule.pipeline", "compile.schedule.coalesce"}


def _value(cfg, name):
    """The value of the dotted key ``name`` in ``cfg`` (``checkpoint.async`` is the field ``async_``)."""
    for part in name.split("."):
        cfg = getattr(cfg, part if hasattr(cfg, part) else part + "_")
    return cfg


def _as_toml(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, frozenset):
        return sorted(value)
    return list(value) if isinstance(value, tuple) else value


def _flatten(table, prefix=""):
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_every_key_is_read_written_and_read_back(tmp_path):
    text = FULL.format(tmp=tmp_path)
    (tmp_path / "full.toml").write_text(text)
    written = _flatten(tomllib.loads(text))
    keys = {k.name for k in train_keys()}
    assert set(written) | VARIED == keys, "FULL must give every key a value"
    variant = text
    for old, new in VARIANT.items():
        assert old in variant, old
        variant = variant.replace(old, new)
    (tmp_path / "variant.toml").write_text(variant)
    varied = _flatten(tomllib.loads(variant))
    for path, values in (("full.toml", written), ("variant.toml", varied)):
        cfg = read_config(str(tmp_path / path))
        for k in train_keys():
            if k.name in values:
                assert _as_toml(_value(cfg, k.name)) == values[k.name], (path, k.name)
                if (path == "full.toml") != (k.name in VARIED):
                    assert values[k.name] != _as_toml(k.default), f"{path} gives {k.name} its default"
        again = to_toml(cfg)
        assert _flatten(tomllib.loads(again)) == values  # the written file, read by tomllib, says the same
        (tmp_path / "again.toml").write_text(again)
        assert read_config(str(tmp_path / "again.toml")) == cfg
    assert VARIED <= set(varied)
    cfg = read_config(str(tmp_path / "full.toml"))
    assert cfg.compile.schedule.overlap == OverlapConfig(prefetch_layers=2, bucket_bytes=4096, max_inflight_bytes=65536)


def test_defaults_and_shorthands_write_back_to_the_same_config(tmp_path):
    (tmp_path / "c.toml").write_text('model = "m:f"\nstrategies = "auto"\nplanner = "none"\n[data]\n'
                                     'paths = "corpus"\ntokenizer = "tok.json"\n')
    cfg = read_config(str(tmp_path / "c.toml"))
    assert cfg.strategies == ("auto",) and cfg.planner.mode == "none"
    assert cfg.data.paths == (str(tmp_path / "corpus"),) and cfg.data.tokenizer == str(tmp_path / "tok.json")
    assert cfg.data.tokens_per_iteration is None and cfg.data.batch_tokens == 4096
    (tmp_path / "out.toml").write_text(to_toml(cfg))
    assert read_config(str(tmp_path / "out.toml")) == cfg
    assert "[compile.schedule.overlap]" not in to_toml(cfg)  # a switch table that is off is left out


def test_help_lists_every_key_with_its_docstring(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for k in train_keys():
        assert f"--{k.name}" in text, k.name
        words = " ".join(k.doc.replace("``", "").split()[:6])
        assert words in text, (k.name, words)
    assert "--compile.schedule.overlap" in text and "--no-checkpoint.resume" in text


def test_flags_override_the_config(tmp_path, monkeypatch):
    """``hgraph train cfg.toml --optimizer.lr 3e-4 ...``: each flag replaces its key; paths are relative
    to the working directory; the earlier flags set the same keys."""
    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "c.toml"
    path.write_text('model = "m:f"\nstrategies = ["tp2"]\n[data]\npaths = ["corpus"]\ntokenizer = "hgraph:stdlib"\n'
                    "[compile.schedule.overlap]\nprefetch_layers = 2\n")
    monkeypatch.chdir(tmp_path)
    argv = ["train", str(path), "--optimizer.lr", "3e-4", "--iterations", "100", "--out", "runs/b",
            "--optimizer.betas", "0.8", "0.9", "--no-checkpoint.async", "--data.paths", "other", "extra",
            "--world-size", "2", "--compute-dtype", "bfloat16", "--recompute", "full", "--planner", "none",
            "--strategies", "tp2", "2x tp1", "--compile.recompute.layers", "1", "3", "--metrics.peak_tflops", "9"]
    cfg = configured(build_parser().parse_args(argv))
    assert cfg.optimizer.lr == 3e-4 and cfg.iterations == 100 and cfg.out == "runs/b"
    assert cfg.optimizer.betas == (0.8, 0.9) and cfg.checkpoint.async_ is False
    assert cfg.data.paths == (str(tmp_path / "other"), str(tmp_path / "extra"))  # flags: the working directory
    assert cfg.world_size == 2 and cfg.compile.compute_dtype is torch.bfloat16
    assert cfg.compile.recompute.mode == "full" and cfg.compile.recompute.layers == frozenset({1, 3})
    assert cfg.planner.mode == "none" and cfg.strategies == ("tp2", "2x tp1") and cfg.metrics.peak_tflops == 9.0
    assert cfg.compile.schedule.overlap == OverlapConfig(prefetch_layers=2)  # untouched keys keep the file's
    off = configured(build_parser().parse_args(["train", str(path), "--schedule", "none"]))
    assert off.compile.schedule.overlap is None
    on = configured(build_parser().parse_args(["train", str(path), "--no-compile.schedule.overlap",
                                               "--compile.schedule.overlap.bucket_bytes", "8"]))
    assert on.compile.schedule.overlap == OverlapConfig(bucket_bytes=8)  # a key of the table switches it on


@pytest.mark.parametrize("text, match", [
    ('model = "m:f"\nstrategies = ["tp2"]\niteration = 3\n', "iteration: unknown key; did you mean 'iterations'"),
    ('model = "m:f"\nstrategies = ["tp2"]\n[optimizer]\nweight_decy = 0.1\n',
     "optimizer.weight_decy: unknown key; did you mean 'optimizer.weight_decay'"),
    ('model = "m:f"\nstrategies = ["tp2"]\n[compile.schedule.overlap]\nprefetch = 2\n',
     "compile.schedule.overlap.prefetch: unknown key; did you mean 'compile.schedule.overlap.prefetch_layers'"),
    ('model = "m:f"\nstrategies = ["tp2"]\n[metrics]\nmlflow = true\n', r"metrics.mlflow: unknown key; valid: console, "),
    ('model = "m:f"\nstrategies = ["tp2"]\n[optimizer]\nlr_scheduler = "x"\n', "optimizer.lr_scheduler: unknown key"),
    ('strategies = ["tp2"]\n', "model: missing \\(required\\)"),
])
def test_unknown_keys_name_the_closest_valid_one(tmp_path, text, match):
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(InputError, match=match) as err:
        read_config(str(tmp_path / "c.toml"))
    assert re.match(r"config .*c\.toml: ", str(err.value)) and "\n" not in str(err.value)
