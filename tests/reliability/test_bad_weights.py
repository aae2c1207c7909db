"""``Trainer(weights=...)`` on bad checkpoints: a ``CheckpointError`` naming the tensor and the file, on
every rank, before any step, with nothing half-loaded (the model still holds no parameter values and
its buffers are untouched)."""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hgraph
from hgraph.errors import CheckpointError
from hgraph.runtime.kernels.thread_comm import run_threads

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def compiled():
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    return hgraph.compile(model, ["tp2", "tp1,pp2"], example_inputs=torch.randint(0, 256, (1, 8)))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """An HF checkpoint of the same model, sharded into several files."""
    path = tmp_path_factory.mktemp("good")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(path, max_shard_size="100KB")
    return path


def single_file(tmp_path, good, edit):
    """All of ``good``'s tensors in one model.safetensors, after ``edit(tensors)``."""
    tensors = {}
    for name in sorted(os.listdir(good)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(good / name))
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def errors(compiled, paths):
    """Every thread rank's CheckpointError message (rank r reads ``paths[r]``)."""
    before = {name: b.clone() for name, b in compiled.traced.buffers().items()}

    def rank(comm):
        try:
            hgraph.Trainer(compiled, comm=comm, run=hgraph.RunConfig(weights=paths[comm.rank]))
        except CheckpointError as exc:
            return str(exc)
        return None

    messages = run_threads(rank, len(paths), timeout=120)
    assert all(p.is_meta for p in compiled.model.parameters())  # nothing loaded into the model
    for name, value in compiled.traced.buffers().items():
        assert torch.equal(value, before[name]), name
    return messages


Q = "model.layers.1.self_attn.q_proj.weight"


def test_missing_tensor(compiled, good, tmp_path):
    path = single_file(tmp_path, good, lambda t: t.pop(Q))
    for message in errors(compiled, [path, path]):
        assert f"lacks tensor '{Q}'" in message and str(path) in message


def test_wrong_shape(compiled, good, tmp_path):
    path = single_file(tmp_path, good, lambda t: t.update({Q: torch.zeros(64, 32)}))
    for message in errors(compiled, [path, path]):
        assert f"model.safetensors: tensor '{Q}' has shape [64, 32]" in message and "has [64, 64]" in message


@pytest.mark.parametrize("dtype, code", [(torch.int64, "I64"), (torch.float64, "F64")])
def test_wrong_dtype(compiled, good, tmp_path, dtype, code):
    path = single_file(tmp_path, good, lambda t: t.update({Q: t[Q].to(dtype)}))
    for message in errors(compiled, [path, path]):
        assert f"tensor '{Q}' has dtype {code}" in message and "model.safetensors" in message


def test_truncated_file(compiled, good, tmp_path):
    path = single_file(tmp_path, good, lambda t: None)
    file = path / "model.safetensors"
    with open(file, "r+b") as fh:
        fh.truncate(file.stat().st_size - 1000)
    for message in errors(compiled, [path, path]):
        assert f"{file} is truncated: tensor '" in message


def test_corrupt_header(compiled, tmp_path):
    (tmp_path / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}")
    for message in errors(compiled, [tmp_path, tmp_path]):
        assert "model.safetensors: the safetensors header is not valid JSON" in message


def test_index_pointing_at_a_missing_file(compiled, good, tmp_path):
    for name in os.listdir(good):
        if name != "config.json":
            (tmp_path / name).write_bytes((good / name).read_bytes())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = index["weight_map"][Q]
    os.remove(tmp_path / victim)
    for message in errors(compiled, [tmp_path, tmp_path]):
        assert "puts tensor '" in message and f"in {victim}, which is missing from {tmp_path}" in message


def test_a_failure_on_one_rank_stops_every_rank(compiled, good, tmp_path):
    path = single_file(tmp_path, good, lambda t: t.pop(Q))
    first, second = errors(compiled, [good, path])  # rank 0 reads a good checkpoint, rank 1 a bad one
    assert second is not None and f"lacks tensor '{Q}'" in second
    assert first is not None and first.startswith("rank 1 failed to load the initial parameters:") and Q in first


def test_no_such_path(compiled, tmp_path):
    for message in errors(compiled, [tmp_path / "nope", tmp_path / "nope"]):
        assert "nope: no such file or directory" in message


def _trainer_error(compiled, **per_rank):
    """Each thread rank's TrainingError message (``RunConfig`` keyword values are per-rank lists)."""
    from hgraph.errors import TrainingError

    def rank(comm):
        try:
            hgraph.Trainer(compiled, comm=comm, run=hgraph.RunConfig(**{k: v[comm.rank] for k, v in per_rank.items()}))
        except TrainingError as exc:
            return str(exc)
        return None

    return run_threads(rank, 2, timeout=120)


def test_ranks_reading_different_checkpoints_raise(compiled, good, tmp_path):
    """The agreement check compares shard fingerprints: each rank also fingerprints the next rank's
    shard from its own source, so two files that differ anywhere are caught with no full tensor."""
    other = single_file(tmp_path, good, lambda t: t[Q].mul_(-1))
    for message in _trainer_error(compiled, weights=[good, other]):
        assert message is not None and "holds a different model than rank" in message and Q in message


def test_ranks_initialising_with_different_seeds_raise(compiled):
    for message in _trainer_error(compiled, init_seed=[0, 1]):
        assert message is not None and "holds a different model than rank" in message
