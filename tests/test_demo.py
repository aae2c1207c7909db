"""The main job at a tiny size: ``hgraph demo`` trains end to end and writes every artifact."""

import json

import pytest

from hgraph.cli.command import main
from hgraph.core.strategy import Strategy


def test_demo_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    code = main(["demo", "--world-size", "2", "--iterations", "3", "--max-len", "128",
                 "--tokens-per-iteration", "512", "--out", str(out), "--compare", "--compare-batches", "2",
                 "--compare-repeats", "2"])
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
def test_default_demo_keeps_long_files_off_one_rank_and_compares_interleaved(tmp_path, monkeypatch, capsys):
    """`make demo`'s settings (files cut at 2048 tokens, 4096 tokens per iteration, 2 ranks, a memory
    budget under which a file of 2048 tokens does not fit a tp1 pipeline), fewer iterations: a
    2048-token file never runs on a tp1 pipeline (9 of these 10 batches have one), the best homogeneous
    strategy compared is one that takes every file, and the planner and the best homogeneous strategies
    run the same batches interleaved, repeated, and the ratio is printed."""
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["demo", "--iterations", "10", "--eval-interval", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured speedup (best homogeneous / hgraph)" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategies_used"], summary["strategy_counts"]
    comparison = summary["comparison"]
    assert summary["measured_speedup"] > 0 and comparison["best_homogeneous"] != "2x tp1"
    assert len(comparison["ratio_per_repetition"]) == 3
    assert max(summary["longest_per_iteration"]) == 2048
    for plan in json.loads((out / "plans.json").read_text()):  # the budget binds: long files never on tp1
        strategy = Strategy.parse(plan["strategy"])
        for pipeline, micro_batches in zip(strategy.pipelines, plan["pipelines"]):
            if pipeline.tp * pipeline.pp * pipeline.cp == 1:
                assert max((n for mb in micro_batches for n in mb), default=0) < 2048, plan
