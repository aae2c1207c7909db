"""``hgraph train CONFIG``: a JSON config trains on local gloo ranks; its losses fall, and the losses it
prints are the ones it records: one console line per iteration (log records go to a file, never in
between) and the same figures in ``metrics.jsonl`` and in TensorBoard event files, read back with
tensorboard's own reader."""

import json
import math
import re
import subprocess
import sys

import numpy as np


def test_train_config_trains_and_losses_fall(tmp_path):
    config = {
        "model": "hgraph.cli.demo:tiny_model",
        "strategies": ["tp2", "2x tp1"],
        "world_size": 2,
        "iterations": 8,
        "lr": 0.003,
        "data": {"lengths": "wikipedia", "tokens_per_iteration": 512, "max_len": 128},
        "metrics": {"peak_tflops": 0.5},
        "out": str(tmp_path / "run"),
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "hgraph", "train", str(path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    losses = [h["loss"] for h in history]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert {h["strategy"] for h in history} == {"(tp2)", "2×(tp1)"}  # cycled through both strategies
    printed = re.search(r"^training loss ([0-9.]+) -> ([0-9.]+)$", out.stdout, re.M)
    assert printed, out.stdout
    assert [float(x) for x in printed.groups()] == [round(losses[0], 4), round(losses[-1], 4)]
    vocab = 512  # hgraph.cli.demo:tiny_model
    assert losses[0] > math.log(vocab) * 0.9  # starts near chance
    assert sum(losses[-2:]) / 2 < losses[0] - 0.2, losses  # measured: 5.56 -> 5.18
    check_metrics(tmp_path / "run", out.stdout, history)


def check_metrics(run, stdout, history):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hgraph.runtime.metrics import read_jsonl

    progress = [line for line in stdout.splitlines() if line.startswith("iter ")]
    assert len(progress) == len(history)  # one line per iteration, each whole
    for k, (line, h) in enumerate(zip(progress, history)):
        assert line.startswith(f"iter {k + 1}/{len(history)}  loss {h['loss']:.4f}  ") and h["strategy"] in line
    assert "INFO" not in stdout and "hgraph.trainer" not in stdout  # log records are not on the console...
    logged = (run / "logs" / "rank0.log").read_text()
    assert f"iter {len(history) - 1} loss {history[-1]['loss']:.4f}" in logged  # ...they are in the log file
    records = read_jsonl(run / "metrics")
    assert [r["loss"] for r in records] == [h["loss"] for h in history]
    assert all(r["mfu"] == r["tflops"] / (0.5 * 2) and len(r["peak_memory_mb"]) == 2 for r in records)
    events = EventAccumulator(str(run / "metrics" / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(len(history)))
    assert [e.value for e in loss] == [float(np.float32(h["loss"])) for h in history]
    for tag in ("throughput/tokens_per_s", "throughput/mfu", "memory/peak_mb/rank1", "comm/exposed_ms/rank0",
                "time/measured_ms", "train/grad_norm", "train/lr"):
        assert len(events.Scalars(tag)) == len(history), tag
