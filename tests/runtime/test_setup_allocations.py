"""No rank allocates a full parameter it does not own while it sets up: building on meta, compiling
and ``Trainer(weights=...)``. Every allocation of the process is recorded (the profiler's memory
events, each ``malloc`` of torch's CPU allocator) and none may reach the size of the smallest weight
matrix in fp32; the model is shaped so that every rank's shards are smaller than that."""

import pytest
import torch
import transformers

import hgraph

STRATEGIES = {2: ["tp2", "tp1,pp2"], 4: ["tp4", "tp2,pp2"]}


def config() -> transformers.LlamaConfig:
    # matrices 128x128 (64 KiB in fp32) and 192x128 / 128x192 (96 KiB); a rank's shards are at most half
    return transformers.LlamaConfig(vocab_size=192, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)


def smallest_matrix_bytes() -> int:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config())
    return min(p.numel() * 4 for p in model.parameters() if p.dim() == 2)


def allocations(fn) -> list[int]:
    """Sizes of every CPU allocation made while ``fn()`` runs, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    return sorted((e.nbytes() for e in events if e.name() == "[memory]" and e.nbytes() > 0), reverse=True)


def set_up(path, world: int) -> int:
    """Build on meta, compile, load: a rank's set-up; returns its largest fp32 shard in bytes."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config()).eval()
    compiled = hgraph.compile(model, STRATEGIES[world], example_inputs=torch.randint(0, 192, (1, 8)))
    trainer = hgraph.Trainer(compiled, run=hgraph.RunConfig(weights=path))
    return max(s.numel() * 4 for s in trainer.optimizer.shards.values())


def on_ranks(path) -> tuple[int, int]:
    """A gloo rank: (largest allocation during its set-up, its largest shard)."""
    box = {}
    sizes = allocations(lambda: box.setdefault("shard", set_up(path, torch.distributed.get_world_size())))
    return sizes[0], box["shard"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("alloc")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config()).save_pretrained(path, max_shard_size="200KB")
    return path


def check(results) -> None:
    limit = smallest_matrix_bytes()
    for rank, (largest, shard) in enumerate(results):
        assert shard < limit  # the test's premise: every shard is smaller than every full matrix
        assert largest < limit, f"rank {rank} allocated {largest} bytes during set-up (a full matrix is {limit})"


@pytest.mark.timeout(900)
def test_no_full_parameter_allocated_on_2_gloo_ranks(weights):
    check(hgraph.launch(on_ranks, 2, args=(weights,), timeout=600))


@pytest.mark.slow  # real processes, 4 of them
@pytest.mark.timeout(900)
def test_no_full_parameter_allocated_on_4_gloo_ranks(weights):
    check(hgraph.launch(on_ranks, 4, args=(weights,), timeout=600))
