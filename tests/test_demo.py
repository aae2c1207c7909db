"""The main job at a tiny size: ``hgraph demo`` trains end to end and writes every artifact."""

import json

import pytest

from hgraph.cli.command import main


def test_demo_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    code = main(["demo", "--world-size", "2", "--iterations", "3", "--max-len", "128",
                 "--tokens-per-iteration", "512", "--out", str(out), "--compare"])
    assert code == 0
    text = capsys.readouterr().out
    assert "[4/4] writing the run folder" in text and "measured speedup" in text
    for name in ("loss.png", "strategies.png", "predicted_vs_measured.png", "timeline.png",
                 "trace.json", "plans.json", "summary.json", "summary.md"):
        assert (out / name).stat().st_size > 0, name
    trace = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if "pid" in e} >= {0, 1}
    plans = json.loads((out / "plans.json").read_text())
    assert len(plans) == 3
    for plan in plans:  # every sequence of the batch ran somewhere, within the demo's max length
        lengths = [n for pipeline in plan["pipelines"] for mb in pipeline for n in mb]
        assert lengths and max(lengths) <= 128
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 3 and summary["measured_speedup"] > 0
    # real code (the stdlib corpus): the held-out loss, on files never trained on, falls
    heldout = [e["loss"] for e in summary["heldout"]]
    assert len(heldout) == 2 and heldout[-1] < heldout[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_default_demo_switches_strategy_with_the_batch_and_compares(tmp_path, monkeypatch, capsys):
    """`make demo`'s settings (files cut at 2048 tokens, 4096 tokens per iteration, 2 ranks), fewer
    iterations: batches of two full-length files and batches of one long and shorter files want
    different strategies, so the planner uses more than one; the same batches then run on the best
    homogeneous strategy and the measured ratio is printed."""
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["demo", "--iterations", "10", "--eval-interval", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured speedup (homogeneous / hgraph)" in text
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["strategies_used"]) >= 2, summary["strategy_counts"]
    assert summary["measured_speedup"] > 0 and summary["homogeneous"]["strategy"]
    assert max(summary["longest_per_iteration"]) == 2048
