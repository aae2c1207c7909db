"""``hgraph train CONFIG``: a JSON config trains on local gloo ranks; its losses fall, and the losses it
prints are the ones it records."""

import json
import math
import re
import subprocess
import sys


def test_train_config_trains_and_losses_fall(tmp_path):
    config = {
        "model": "hgraph.cli.demo:tiny_model",
        "strategies": ["tp2", "2x tp1"],
        "world_size": 2,
        "iterations": 8,
        "lr": 0.003,
        "data": {"lengths": "wikipedia", "tokens_per_iteration": 512, "max_len": 128},
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
