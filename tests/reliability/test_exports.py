"""Exports: a killed export leaves no file that reads as complete; an export over an earlier one
removes that one's weight files and index, so a reader never mixes the two."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest
import torch

from hgraph.cli.train_cli import export_over_source
from hgraph.core.checkpoint_files import INDEX_NAME, SINGLE_NAME, SafetensorsCheckpoint
from hgraph.core.sharded_writer import ShardedWriter, TensorSpec
from hgraph.errors import InputError
from hgraph.training.train_config import ExportConfig, read_config


def export(directory, tensors, max_shard_bytes):
    writer = ShardedWriter(directory, [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                           max_shard_bytes)
    for name, value in tensors.items():
        writer.write(name, value)
    return writer.close()


def read(directory):
    checkpoint = SafetensorsCheckpoint(directory)
    with checkpoint.open():
        return {name: checkpoint.read(name, ()) for name in checkpoint.tensors}


def test_single_file_export_over_a_sharded_export_reads_the_new_weights(tmp_path):
    old = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
    export(tmp_path, old, 300)
    assert (tmp_path / INDEX_NAME).is_file()
    new = {f"w{i}": torch.full((64,), 10.0 + i) for i in range(4)}
    files = export(tmp_path, new, "5GB")
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_NAME] == [p.name for p in files]
    assert all(torch.equal(read(tmp_path)[n], v) for n, v in new.items())


def test_sharded_export_over_a_larger_sharded_export_removes_the_extra_shards(tmp_path):
    export(tmp_path, {f"w{i}": torch.zeros(64) for i in range(4)}, 300)  # 4 shards
    new = {f"w{i}": torch.ones(64) for i in range(4)}
    files = export(tmp_path, new, 600)  # 2 shards
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)
    assert len(files) == 3 and all(torch.equal(v, torch.ones(64)) for v in read(tmp_path).values())


def test_an_export_that_fails_leaves_the_previous_one(tmp_path):
    export(tmp_path, {"w": torch.full((8,), 7.0)}, "5GB")
    writer = ShardedWriter(tmp_path, [TensorSpec("w", torch.float32, (8,)), TensorSpec("v", torch.float32, (8,))])
    writer.write("w", torch.ones(8))
    with pytest.raises(InputError, match="'v'"):
        writer.close()  # "v" never arrived
    assert sorted(os.listdir(tmp_path)) == [SINGLE_NAME]
    assert torch.equal(read(tmp_path)["w"], torch.full((8,), 7.0))


_SLOW_EXPORT = textwrap.dedent("""
    import sys, time, torch
    from hgraph.core.sharded_writer import ShardedWriter, TensorSpec
    names = [f"w{i}" for i in range(64)]
    writer = ShardedWriter(sys.argv[1], [TensorSpec(n, torch.float32, (1 << 16,)) for n in names])
    for n in names:
        writer.write(n, torch.ones(1 << 16))
        time.sleep(0.05)
    writer.close()
""")


@pytest.mark.slow
def test_an_export_killed_while_its_file_grows_leaves_the_previous_export(tmp_path):
    export(tmp_path, {"w0": torch.full((4,), 7.0)}, "5GB")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_EXPORT, str(tmp_path)])
    try:
        deadline, sizes = time.monotonic() + 20, []
        while time.monotonic() < deadline and len(set(sizes)) < 3:
            temporaries = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            if temporaries:
                sizes.append(os.stat(temporaries[0]).st_blocks)  # full size at once, filled as tensors arrive
            time.sleep(0.02)
        assert proc.poll() is None, "the export finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [SINGLE_NAME]
    assert torch.equal(read(tmp_path)["w0"], torch.full((4,), 7.0))


def test_an_export_into_the_folder_the_model_loads_from_says_so(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model": "hgraph.cli.demo:tiny_model", "strategies": ["tp1"]}')
    cfg = read_config(str(path))
    source = tmp_path / "hf-model"
    source.mkdir()
    assert export_over_source(replace(cfg, model=str(source), export=ExportConfig(dir=str(tmp_path / "elsewhere")))) == ""
    assert export_over_source(replace(cfg, export=ExportConfig(dir=str(source)))) == ""  # a factory, not a folder
    notice = export_over_source(replace(cfg, model=str(source), export=ExportConfig(dir=str(source / ".." / "hf-model"))))
    assert str(source / ".." / "hf-model") in notice and "replaced when the export completes" in notice
