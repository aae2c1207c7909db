"""``hgraph.core.sharded_writer``: files that safetensors and ``SafetensorsCheckpoint`` read back exactly,
whatever order the tensors arrive in; shards of at most the limit (a larger tensor alone)."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from hgraph.core.checkpoint_files import SafetensorsCheckpoint
from hgraph.errors import InputError
from hgraph.core.sharded_writer import ShardedWriter, TensorSpec, parse_size, plan_shards


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"layers.{i}.w": torch.randn(30, 17 + i, generator=g) for i in range(6)}
    out["half"] = torch.randn(9, 5, generator=g).to(torch.bfloat16)
    out["big"] = torch.randn(200, 30, generator=g)  # larger than a shard: a file of its own
    out["scalar"] = torch.tensor(2.5)
    out["ids"] = torch.arange(7)
    return out


@pytest.mark.parametrize("limit", [10**9, 6_000])
def test_written_in_any_order_and_read_back_exactly(tmp_path, limit):
    values = tensors()
    specs = [TensorSpec(n, v.dtype, tuple(v.shape)) for n, v in values.items()]
    writer = ShardedWriter(tmp_path, specs, limit)
    order = list(values)
    random.Random(1).shuffle(order)
    for name in order:
        writer.write(name, values[name])
    files = writer.close()
    stored = {}
    for f in files:
        if f.suffix == ".safetensors":
            stored.update(load_file(f))
    assert set(stored) == set(values)
    for name, value in values.items():
        assert stored[name].dtype == value.dtype and torch.equal(stored[name], value), name
    checkpoint = SafetensorsCheckpoint(tmp_path)
    with checkpoint.open():
        assert torch.equal(checkpoint.read("layers.3.w", ((4, 9), (2, 11))), values["layers.3.w"][4:9, 2:11])
    if limit < 10**9:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(files) > 3 and index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
        for f in files[:-1]:
            names = [n for n, file in index["weight_map"].items() if file == f.name]
            assert names == ["big"] or sum(values[n].numel() * values[n].element_size() for n in names) <= limit
    else:
        assert [f.name for f in files] == ["model.safetensors"]


def test_plan_and_misuse(tmp_path):
    specs = [TensorSpec("a", torch.float32, (10,)), TensorSpec("b", torch.float32, (100,)), TensorSpec("c", torch.float16, (4,))]
    assert [[s.name for s in shard] for shard in plan_shards(specs, 100)] == [["a"], ["b"], ["c"]]
    assert [[s.name for s in shard] for shard in plan_shards(specs, 500)] == [["a", "b", "c"]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(7) == 7
    with pytest.raises(InputError, match="max_shard_size"):
        parse_size("lots")
    writer = ShardedWriter(tmp_path, specs, 500)
    with pytest.raises(InputError, match="not planned"):
        writer.write("z", torch.zeros(1))
    with pytest.raises(InputError, match="shape"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(InputError, match="not written"):
        writer.close()
