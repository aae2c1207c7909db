"""ZeRO shards as DCP chunks: saved at one world size, read back at others, box by box, against torch.chunk."""

import pytest
import torch

from hgraph.core.placement import InterleavedShard
from hgraph.core.zero import optimizer_layout
from hgraph.errors import CheckpointError
from hgraph.runtime import checkpoint_dcp
from hgraph.runtime.checkpoint_dcp import ShardBoxes
from hgraph.runtime.kernels.thread_comm import run_threads

BLOCKS = (8, 4, 4)  # a fused q, k, v along dim 0
TENSORS = {
    "qkv": ((16, 6), dict(interleaved=InterleavedShard(0, BLOCKS))),
    "experts": ((2, 6, 4), dict(expert=True)),
    "short": ((3, 2), {}),  # no dim as long as 4 ranks: the last of them holds nothing
    "scale": ((), {}),
}


def full_tensors():
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, (shape, _) in TENSORS.items()}


def expected(name, full, world, rank):
    """The oracle: torch.chunk of each block (interleaved), of dim 0 (others), or the whole (scalars)."""
    if not full.dim():
        return full
    if name == "qkv" and all(b % world == 0 for b in BLOCKS):
        return torch.cat([block.chunk(world)[rank] for block in full.split(BLOCKS)])
    if name == "experts" and world == 4:  # a (2 experts, 2) mesh: each expert cut along its longest dim
        return full.chunk(2)[rank // 2].chunk(2, dim=1)[rank % 2]
    dim = 1 if name == "experts" and world == 3 else 0  # the first dim at least as long as the world
    chunks = full.chunk(world, dim)
    return chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)


def layouts(world):
    return {name: optimizer_layout(shape, world, **kw) for name, (shape, kw) in TENSORS.items()}


def save_at(world, path):
    full = full_tensors()

    def body(comm):
        state = {name: ShardBoxes.of(layout, comm.rank, layout.local_of(full[name], comm.rank))
                 for name, layout in layouts(world).items()}
        checkpoint_dcp.save(state, path, comm, tuple(range(world)), comm.rank)

    run_threads(body, world)
    return full


@pytest.mark.parametrize("world", [2, 3, 4])
def test_saved_at_4_reads_back_at_any_world_size(tmp_path, world):
    full = save_at(4, tmp_path)
    metadata = checkpoint_dcp.read_metadata(tmp_path)
    for rank in range(world):
        local = {name: torch.full(layout.local_shape(rank), float("nan")) for name, layout in layouts(world).items()}
        state = {name: ShardBoxes.of(layout, rank, local[name]) for name, layout in layouts(world).items()}
        checkpoint_dcp.load(state, tmp_path, metadata)
        for name, value in local.items():
            assert torch.equal(value, expected(name, full[name], world, rank)), (name, world, rank)


def test_a_rank_reads_only_the_files_that_hold_its_boxes(tmp_path):
    save_at(4, tmp_path)
    metadata = checkpoint_dcp.read_metadata(tmp_path)
    read = {}
    for rank in range(2):
        state = {name: ShardBoxes.of(layout, rank, torch.empty(layout.local_shape(rank), device="meta"))
                 for name, layout in layouts(2).items() if name != "scale"}
        read[rank] = checkpoint_dcp.files_read(metadata, state)
    assert read == {0: ["__0_0.distcp", "__1_0.distcp"], 1: ["__2_0.distcp", "__3_0.distcp"]}


def test_interleaved_boxes_are_one_chunk_per_block(tmp_path):
    layout = optimizer_layout((16, 6), 4, interleaved=InterleavedShard(0, BLOCKS))
    assert str(ShardBoxes.of(layout, 1, torch.empty(layout.local_shape(1)))) == (
        "ShardBoxes([16, 6]: [2, 0]+[2, 6], [9, 0]+[1, 6], [13, 0]+[1, 6])")
    save_at(4, tmp_path)
    chunks = checkpoint_dcp.read_metadata(tmp_path).state_dict_metadata["qkv"].chunks
    assert sorted(c.offsets[0] for c in chunks) == [0, 2, 4, 6, 8, 9, 10, 11, 12, 13, 14, 15]


def test_pickled_objects_are_refused(tmp_path):
    def body(comm):
        checkpoint_dcp.save({"qkv": {"not": "a tensor"}}, tmp_path, comm, (0,), 0)

    run_threads(body, 1)
    metadata = checkpoint_dcp.read_metadata(tmp_path)
    with pytest.raises(CheckpointError, match="'qkv' is stored as a pickled object"):
        checkpoint_dcp.load({"qkv": torch.empty(1)}, tmp_path, metadata)


def test_a_checkpoint_write_shows_a_bar_of_the_bytes_written(tmp_path, monkeypatch, capsys):
    from hgraph.core import progress as progress_module

    monkeypatch.setenv(progress_module.PROGRESS_ENV, "1")
    monkeypatch.setattr(progress_module, "DELAY_S", 0)
    save_at(2, tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert err.count("writing checkpoint ckpt:") >= 1 and "B/s" in err  # one bar (the first rank's), in bytes
