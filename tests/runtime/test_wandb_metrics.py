"""``[metrics] wandb = true``: the scalars TensorBoard gets also go to a Weights & Biases run. Checked
offline (``WANDB_MODE=offline``): the run's transaction log is read back with wandb's own record
type (``wandb_internal_pb2.Record``) and compared with the event files read by tensorboard's reader."""

from __future__ import annotations

import json
import struct
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hgraph.errors import InputError
from hgraph.runtime.metrics import MB, MetricsConfig, MetricsWriter
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


def test_wandb_gets_the_scalars_tensorboard_gets(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    writer = MetricsWriter(MetricsConfig(str(tmp_path / "metrics"), jsonl=False, wandb=True, peak_tflops=1.0),
                           world_size=2, flops=None, iterations=3)
    for i in range(3):
        writer.record({"iteration": i, "seconds": 0.25 + i, "lengths": [8, 3 + i], "loss": 2.0 / (i + 1),
                       "grad_norm": 0.5 + i, "lr": 1e-3 * (i + 1), "peak_memory_bytes": [MB, (2 + i) * MB],
                       "exposed_comm_ms": [0.1, 0.2 * i], "strategy": "tp2", "strategy_index": i % 2,
                       "predicted_ms": None if i == 0 else 9.5, "measured_ms": 10.0 + i})
    writer.close()
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
