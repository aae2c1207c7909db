"""``Trainer.step`` takes the same global batch on every rank and checks it: 2 real gloo ranks, each
given its own shard (the ``DistributedSampler`` habit) or the same lengths with other tokens, raise
``InputError`` naming rank 1 on both ranks, instead of training on batches they slice differently
or hanging; the same batch on both ranks trains, before and after."""

import torch

import hgraph
from hgraph.errors import InputError
from hgraph.models import Llama, LlamaConfig

LENGTHS = (37, 12, 90, 25, 64, 8)


def _batch(seed: int, lengths=LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def _steps() -> list:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = Llama(LlamaConfig(layers=2), seed=0)
    compiled = hgraph.compile(model, ["2x tp1", "tp2"], example_inputs=torch.randint(0, 256, (1, 16)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-3))
    out = []
    own_lengths = LENGTHS if rank == 0 else tuple(reversed(LENGTHS))
    for batch in (_batch(0), _batch(100 + rank, own_lengths), _batch(100 + rank), _batch(1)):
        try:
            out.append(trainer.step(batch))
        except InputError as exc:
            out.append(str(exc))
    return out + [trainer.iteration]


def test_different_batches_on_two_ranks_raise_input_error_naming_the_rank():
    rank0, rank1 = hgraph.launch(_steps, 2, timeout=600)
    for own_shard in (rank0, rank1):
        first, shard, tokens, last, iterations = own_shard
        assert isinstance(first, float) and isinstance(last, float)  # the same batch trains
        for message in (shard, tokens):  # own shards; then the same lengths with other tokens
            assert isinstance(message, str) and "rank 1 passed a different batch from rank 0" in message
            assert "step_data" in message
        assert iterations == 2  # the refused batches left no iteration behind
    assert rank0[0] == rank1[0] and rank0[3] == rank1[3]
