"""Out by slices: ``export_pretrained`` writes HF's sharded safetensors format with an index, one tensor
at a time, and ``from_pretrained`` (and ``Trainer(weights=...)``) load the result; the writing rank's
memory peak during the export stays below the largest shard, far below the model."""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hgraph
from hgraph.training.export import export_pretrained, save_safetensors
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.kernels.thread_comm import run_threads

SHARD = 150_000  # bytes: the 0.6 MB model below needs several shards


def config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=g) for n in (20, 11, 7)]


def live_peak(events) -> int:
    """Most bytes allocated at once (from the profiler's allocation and free events, in time order)."""
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def export_on_ranks(path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config()).eval()
    compiled = hgraph.compile(model, ["tp2", "tp1,pp2"], example_inputs=torch.randint(0, 256, (1, 8)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-2),
                             run=hgraph.RunConfig(init_seed=1))
    trainer.step(batch(), strategy=0)
    state = trainer.state_dict(dst=0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        export_pretrained(trainer, model, path, max_shard_size=SHARD)
    memory = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    export_pretrained(trainer, model, path + "_bf16", dtype=torch.bfloat16, max_shard_size=SHARD)
    again = hgraph.Trainer(compiled, run=hgraph.RunConfig(weights=path)).state_dict(dst=0)  # the export read back by slices
    return {"state": state, "again": again, "peak": live_peak(memory)}


@pytest.mark.timeout(900)
def test_sharded_export_round_trips_through_from_pretrained(tmp_path):
    path = str(tmp_path / "export")
    got = hgraph.launch(export_on_ranks, 2, args=(path,), timeout=800)[0]
    state = got["state"]
    index = json.loads(open(os.path.join(path, "model.safetensors.index.json")).read())
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(files) >= 3 and set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(state)
    sizes = [os.path.getsize(os.path.join(path, f)) for f in files]
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in state.values())
    assert max(sizes) <= SHARD + 16_384  # a shard: at most the limit (+ its header)
    assert got["peak"] <= max(sizes) < sum(sizes) / 3  # the writer held less than a shard at any time
    loaded = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    assert set(loaded.state_dict()) == set(state)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state[name]), name
    for name, value in got["again"].items():
        assert torch.equal(value, state[name]), name
    half = transformers.LlamaForCausalLM.from_pretrained(path + "_bf16")
    assert half.config.dtype == torch.bfloat16 or str(half.config.dtype).endswith("bfloat16")
    for name, value in half.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, state[name].to(torch.bfloat16)), name
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        fresh = transformers.LlamaForCausalLM(config()).eval()
        fresh.load_state_dict(state)
        assert torch.equal(fresh(ids).logits, loaded(ids).logits)


def test_non_hf_model_streams_to_safetensors_shards(tmp_path):
    """The train command's export of a model without save_pretrained (thread ranks)."""
    compiled = hgraph.compile(Llama(LlamaConfig(layers=2, kv_heads=4, tie_embeddings=True), seed=0),
                              ["tp2"], example_inputs=torch.randint(0, 256, (1, 8)))

    def rank(comm):
        trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-2), comm=comm)
        trainer.step(batch(), strategy=0)
        files = save_safetensors(trainer, tmp_path, max_shard_size=40_000)
        return trainer.state_dict(), files

    (state, files), (_, none) = run_threads(rank, 2, timeout=300)
    assert none == [] and len(files) > 2 and files[-1].name == "model.safetensors.index.json"
    stored = {}
    for file in files[:-1]:
        stored.update(load_file(file))
    assert set(stored) == set(state) - {"lm_head.weight"}  # tied: written once, under its first name
    for name, value in stored.items():
        assert torch.equal(value, state[name]), name
