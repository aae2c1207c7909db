"""Smoke test of benchmarks/runtime_bench.py: the tiny 2-rank configuration runs and reports every number."""

import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_runtime_bench_tiny(monkeypatch, capsys):
    # Spawned ranks unpickle `runtime_bench._rank_main`, so the module must be importable by name.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delitem(sys.modules, "runtime_bench", raising=False)
    import runtime_bench

    report = runtime_bench.main(["--tiny"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))

    labels = {"2x tp1", "tp2"}
    assert set(report["hgraph"]["strategies"]) == labels
    assert set(report["torch_dtensor_fsdp2"]) == labels
    assert set(report["hgraph_over_torch"]) == labels
    assert set(report["scaling_single_over_hgraph"]) == labels
    assert set(report["hgraph"]["switch"]) == labels
    for side in (report["hgraph"]["strategies"], report["torch_dtensor_fsdp2"]):
        for row in side.values():
            assert 0 < row["min_s"] <= row["step_s"] <= row["max_s"]
    for row in report["hgraph"]["switch"].values():
        assert math.isclose(row["switch_adds_s"], row["after_switch_s"] - row["repeat_s"], abs_tol=2e-4)
    # Every side starts from the same weights on the same batch: the same first loss.
    assert report["first_losses_agree"], report["first_losses"]
    assert set(report["first_losses"]) == {"hgraph", "torch 2x tp1", "torch tp2", "single"}
