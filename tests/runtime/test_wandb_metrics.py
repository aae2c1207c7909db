"""``[metrics] wandb = true``: the scalars TensorBoard gets also go to a Weights & Biases run. Checked
offline (``WANDB_MODE=offline``): the run's transaction log is read back with wandb's own record
type (``wandb_internal_pb2.Record``) and compared with the event files read by tensorboard's reader."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hgraph.errors import InputError
from hgraph.runtime.metrics import MetricsConfig
from hgraph.training.train_config import read_config

wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK = 32768  # the transaction log's block size (LevelDB's log format)
FULL, LAST = 1, 4


def logged_history(run_file) -> list[dict]:
    """The history rows of an offline run's ``run-<id>.wandb``: a 7-byte file header, then records in
    32 KiB blocks, each as chunks of ``crc32 (4) | length (2) | type (1) | data`` (FULL, or FIRST,
    MIDDLE..., LAST), a block's tail shorter than a chunk header left as zeros."""
    raw, rows, pos, record = run_file.read_bytes(), [], 7, b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        record += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            if parsed.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in parsed.history.item})
            record = b""
    return rows


WRITE = """
import sys
from hgraph.runtime.metrics import MB, MetricsConfig, MetricsWriter
writer = MetricsWriter(MetricsConfig(sys.argv[1], jsonl=False, wandb=True, peak_tflops=1.0),
                       world_size=2, flops=None, iterations=3)
for i in range(3):
    writer.record({"iteration": i, "seconds": 0.25 + i, "lengths": [8, 3 + i], "loss": 2.0 / (i + 1),
                   "grad_norm": 0.5 + i, "lr": 1e-3 * (i + 1), "peak_memory_bytes": [MB, (2 + i) * MB],
                   "exposed_comm_ms": [0.1, 0.2 * i], "strategy": "tp2", "strategy_index": i % 2,
                   "predicted_ms": None if i == 0 else 9.5, "measured_ms": 10.0 + i})
writer.close()
"""


def test_wandb_gets_the_scalars_tensorboard_gets(tmp_path):
    """The run is written by a fresh interpreter, as ``hgraph train``'s rank 0 is: wandb's service
    process belongs to the process that started it, and one shared by earlier tests in the same
    worker has lost history records."""
    (tmp_path / "wandb-dir").mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-dir"), "WANDB_SILENT": "true"}
    subprocess.run([sys.executable, "-c", WRITE, str(tmp_path / "metrics")], env=env, check=True, timeout=300)
    events = EventAccumulator(str(tmp_path / "metrics" / "tensorboard"))
    events.Reload()
    tensorboard = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    [run_file] = (tmp_path / "wandb-dir" / "wandb").glob("offline-run-*/run-*.wandb")
    rows = logged_history(run_file)
    assert [row["_step"] for row in rows] == [0, 1, 2]
    logged = {(tag, row["_step"]): value for row in rows for tag, value in row.items() if not tag.startswith("_")}
    assert logged.keys() == tensorboard.keys()
    assert {("time/predicted_ms", 0), ("throughput/tflops", 0)}.isdisjoint(logged)  # None: not logged
    for key, value in logged.items():
        assert tensorboard[key] == pytest.approx(value, rel=1e-6), key  # TensorBoard keeps float32


def test_metrics_wandb_key_is_read_and_refused_without_wandb(tmp_path, monkeypatch):
    (tmp_path / "model.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 512, "hidden_size": 32,
                                                     "num_hidden_layers": 2, "num_attention_heads": 4}))
    path = tmp_path / "train.toml"
    path.write_text('model = "model.json"\nstrategies = ["tp1"]\n[metrics]\nwandb = true\n')
    assert read_config(str(path)).metrics.wandb
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(InputError, match=r"config .*train.toml: metrics: metrics.wandb = true logs to Weights & Biases, "
                                         r"but the wandb package is not installed; pip install wandb"):
        read_config(str(path))
    with pytest.raises(InputError, match=r"MetricsConfig wandb=True logs to Weights & Biases, but the wandb "
                                         r"package is not installed; pip install wandb \(or hgraph\[wandb\]\), "
                                         r"or set it to false"):
        MetricsConfig(str(tmp_path), wandb=True)
