"""The main job at a tiny size: ``hgraph demo`` trains end to end and writes every artifact."""

import json

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
