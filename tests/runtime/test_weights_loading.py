"""A model built on meta, loaded with ``Trainer(weights=...)`` by slices on real gloo processes: its
``state_dict()`` is the checkpoint bit for bit (fp32; bf16 and fp16 upcast exactly), under strategies with tp,
pp and cp, for HF Llama (sharded checkpoint with an index) and GPT-2 (one file, tied embeddings, a
fused qkv projection whose optimizer layout is cut block by block); it trains like the unmodified
model; and without weights it is initialised by the contract of ``hgraph.frontend.layerwise_init``."""

import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

import hgraph
from hgraph.runtime.kernels.thread_comm import run_threads

STRATEGIES = {2: ["tp2", "tp1,pp2", "cp2"], 4: ["tp4", "tp2,pp2", "tp2,cp2"]}


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                   bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


FAMILIES = {"llama": (transformers.LlamaForCausalLM, llama_config), "gpt2": (transformers.GPT2LMHeadModel, gpt2_config)}


def batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g) for n in (17, 9, 24, 13)]


def checkpoint(path) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def unmodified_loss(model: torch.nn.Module) -> float:
    total, tokens = 0.0, 0
    with torch.no_grad():
        for seq in batch():
            logits = model(seq[None]).logits[0, :-1].double()
            total += float(F.cross_entropy(logits, seq[1:], reduction="sum"))
            tokens += len(seq) - 1
    return total / tokens


def meta_trainers(family: str, world: int, path, comm=None) -> dict:
    """Rank side: build on meta, compile, load ``path`` by slices; state, one step per strategy, and
    the layer-wise initialised state (rank 0 receives)."""
    cls, config = FAMILIES[family]
    with torch.device("meta"):
        model = cls(config()).eval()
    compiled = hgraph.compile(model, STRATEGIES[world], example_inputs=torch.randint(0, 256, (1, 8)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-3),
                             run=hgraph.RunConfig(weights=path), comm=comm)
    state = trainer.state_dict(dst=0)
    losses = []
    for i in range(len(STRATEGIES[world])):
        fresh = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-3),
                               run=hgraph.RunConfig(weights=path), comm=comm)
        losses.append(fresh.step(batch(), strategy=i))
    initialised = hgraph.Trainer(compiled, comm=comm, run=hgraph.RunConfig(init_seed=3)).state_dict(dst=0)
    assert all(p.is_meta for p in model.parameters())  # the model itself never held a value
    return {"state": state, "losses": losses, "init": initialised}


def run_on_ranks(paths: dict) -> dict:
    world = torch.distributed.get_world_size()
    return {key: meta_trainers(key[0], world, path) for key, path in paths.items()}


def init_reference(family: str, seed: int) -> dict[str, torch.Tensor]:
    cls, config = FAMILIES[family]
    with torch.device("meta"):
        model = cls(config()).eval()
    model.to_empty(device="cpu")
    model.tie_weights()
    torch.manual_seed(seed)
    model.initialize_weights()
    return model.state_dict()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """HF Llama as HF shards + index (fp32 and bf16), GPT-2 as one model.safetensors; and the eager
    models they came from (loaded back with from_pretrained, the oracle)."""
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(llama_config())
    llama.save_pretrained(root / "llama", max_shard_size="100KB")
    llama.to(torch.bfloat16).save_pretrained(root / "llama_bf16", max_shard_size="100KB")
    llama.to(torch.float16).save_pretrained(root / "llama_fp16", max_shard_size="100KB")
    transformers.GPT2LMHeadModel(gpt2_config()).save_pretrained(root / "gpt2")
    assert os.path.isfile(root / "llama" / "model.safetensors.index.json")
    assert os.path.isfile(root / "gpt2" / "model.safetensors")
    return {("llama", "fp32"): root / "llama", ("llama", "bf16"): root / "llama_bf16", ("llama", "fp16"): root / "llama_fp16",
            ("gpt2", "fp32"): root / "gpt2"}


def check(results: dict, paths: dict) -> None:
    for (family, kind), path in paths.items():
        got = results[(family, kind)]
        stored = checkpoint(path)
        cls, _ = FAMILIES[family]
        eager = cls.from_pretrained(path, dtype=torch.float32).eval()
        want = eager.state_dict()
        assert set(got["state"]) == set(want)
        for name, value in got["state"].items():
            assert value.dtype == torch.float32
            source = stored.get(name, want[name])  # tied lm_head: the stored embedding
            assert torch.equal(value, source.to(torch.float32)), (family, kind, name)
        oracle = unmodified_loss(eager)
        for loss in got["losses"]:
            assert loss == pytest.approx(oracle, rel=1e-5)
        reference = init_reference(family, 3)
        for name, value in got["init"].items():
            if name in reference:
                assert torch.equal(value, reference[name]), (family, name)


@pytest.mark.slow  # real processes: ~1-3 min on 2 busy cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_weights_load_by_slices_on_gloo(world, checkpoints):
    results = hgraph.launch(run_on_ranks, world, args=(checkpoints,), timeout=800)[0]
    check(results, checkpoints)


def test_weights_load_by_slices_on_thread_ranks(checkpoints):
    """The default run's version: simulated ranks, HF Llama fp32 and bf16 shards."""
    paths = {key: path for key, path in checkpoints.items() if key in (("llama", "fp32"), ("llama", "bf16"))}
    ranks = run_threads(lambda comm: {key: meta_trainers(key[0], 2, p, comm) for key, p in paths.items()}, 2, timeout=600)
    check(ranks[0], paths)


def test_release_model_frees_an_eager_models_parameters():
    """release_model=True: once sharded, the eager model holds no parameter storage; training and the
    model's state (names, buffers, trained values) are those of a run that keeps it."""
    def run(release):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config()).eval()
        compiled = hgraph.compile(model, ["tp2"], example_inputs=torch.randint(0, 256, (1, 8)))

        def rank(comm):
            trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-2),
                                     run=hgraph.RunConfig(release_model=release), comm=comm)
            loss = trainer.step(batch(), strategy=0)
            return loss, trainer.state_dict()

        out = run_threads(rank, 2, timeout=300)
        return out[0], all(p.is_meta for p in model.parameters())

    (kept_loss, kept), kept_meta = run(False)
    (loss, state), released = run(True)
    assert released and not kept_meta
    assert loss == kept_loss and set(state) == set(kept)
    for name, value in state.items():
        assert torch.equal(value, kept[name]), name
