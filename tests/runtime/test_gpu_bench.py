"""Smoke test of benchmarks/gpu_bench.py: without CUDA (or with --smoke) it trains a tiny HF Llama with
hgraph and with the hand-written loop on the same packed Wikipedia-length batches, prints its JSON and
says what it skipped; the two loops learn the same thing; the planner's prediction and the measured
step times are reported side by side, and the cp flex section runs its eager path."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.timeout(400)
def test_gpu_bench_smoke_mode(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delitem(sys.modules, "gpu_bench", raising=False)
    import gpu_bench

    report = gpu_bench.main(["--smoke"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
    assert report["cuda"] is False and len(report["skipped"]) >= 4
    run = report["throughput"]
    assert "error" not in run, run.get("traceback")
    assert run["tokens_per_s"]["hgraph"] > 0 and run["tokens_per_s"]["hand"] > 0
    for ours, theirs in zip(run["losses"]["hgraph"], run["losses"]["hand"]):
        assert abs(ours - theirs) < 1e-4 * abs(theirs)
    variants = report["attention_variants"]
    assert "error" not in variants, variants.get("traceback")
    for name in ("causal", "window=256", "softcap=30.0", "window=256, softcap=30.0"):
        assert variants[name]["ok"] and variants[name]["kernel"] == "sdpa", (name, variants[name])
    prediction = report["prediction"]
    assert "error" not in prediction, prediction.get("traceback")
    assert len(prediction["steps"]) == 4 and prediction["measured_over_predicted"]["min"] > 0
    assert all(r["measured_ms"] >= r["optimizer_ms"] > 0 and r["predicted_ms"] > 0 for r in prediction["steps"])
    flex = report["flex_cp_memory"]
    assert "error" not in flex and "error" not in flex["eager"], flex
    assert flex["query_tokens"] == 512 and flex["eager"]["measured_ms"] > 0 and not flex["compiled_used"]
