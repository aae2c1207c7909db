"""``hgraph plan``: JSON schema, plan validity, error exit codes; length files; the example script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hgraph.cli.command import main
from hgraph.errors import InputError, PlanError
from hgraph.planner.batches import make_batches, read_lengths, sample_path

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_json_schema_and_plan_validity(capsys):
    rc, out, _ = _run(capsys, "--gpus", "8", "--iterations", "2", "--tokens-per-iteration", "20000",
                      "--max-len", "16384", "--seed", "1", "--json")
    assert rc == 0
    data = json.loads(out)
    assert set(data) == {"iterations", "summary"}
    batches = make_batches(read_lengths(sample_path()), 20000, 16384, 2, seed=1)
    assert len(data["iterations"]) == 2
    for it, batch in zip(data["iterations"], batches):
        assert set(it) == {"strategy", "lengths", "pipelines", "predicted_ms", "plan_ms", "lower_bound", "ratio_to_bound"}
        assert it["lengths"] == batch
        placed = []
        for p in it["pipelines"]:
            assert set(p) == {"tp", "pp", "cp", "ranks", "max_len", "micro_batches"}
            assert len(p["ranks"]) == p["tp"] * p["pp"] * p["cp"]
            for mb in p["micro_batches"]:
                assert sum(batch[i] for i in mb) <= p["max_len"]
                placed += mb
        assert sorted(placed) == list(range(len(batch)))
    s = data["summary"]
    assert set(s) == {"predicted_ms_total", "baseline", "baselines", "speedup", "plan_ms_median", "plan_ms_max",
                      "lower_bound_ms_total", "ratio_to_bound_max"}
    assert s["baseline"]["name"] == "megatron"
    assert [b["name"] for b in s["baselines"]] == ["megatron", "homogeneous-tuned"]
    assert s["speedup"] == pytest.approx(s["baseline"]["predicted_ms_total"] / s["predicted_ms_total"], rel=1e-3)
    assert s["predicted_ms_total"] == pytest.approx(sum(it["predicted_ms"] for it in data["iterations"]), abs=0.01)
    tuned = s["baselines"][1]["predicted_ms_total"]
    assert s["predicted_ms_total"] <= tuned + 1e-6


def test_plan_text_output(capsys):
    rc, out, _ = _run(capsys, "--gpus", "8", "--tokens-per-iteration", "5000", "--max-len", "8192")
    assert rc == 0 and "iteration 0: IterationPlan" in out and "homogeneous-tuned" in out


def test_plan_errors_exit_nonzero_with_a_message(capsys, tmp_path):
    rc, _, err = _run(capsys, "--gpus", "0", "--json")
    assert rc == 1 and "gpus=0" in err
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n7\nseven\n")
    rc, _, err = _run(capsys, "--gpus", "8", "--lengths", str(bad), "--json")
    assert rc == 1 and "bad.txt:3" in err and "'seven'" in err
    rc, _, err = _run(capsys, "--gpus", "8", "--cost-table", "no_such_table", "--json")
    assert rc == 1


def test_read_lengths_rejects_negative_and_empty_files(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("5\n-3\n")
    with pytest.raises(InputError, match="l.txt:2: length -3 is not positive"):
        read_lengths(f)
    f.write_text("\n\n")
    with pytest.raises(InputError, match="empty"):
        read_lengths(f)
    assert len(read_lengths(sample_path())) == 20_000


def test_batches_fill_the_token_budget_and_truncate():
    batches = make_batches([10, 500, 30, 40], 100, 64, 3, seed=0)
    for b in batches:
        assert max(b) <= 64 and sum(b) >= 100 and sum(b) - b[-1] < 100
    assert make_batches([10, 500, 30, 40], 100, 64, 3, seed=0) == batches
    with pytest.raises(PlanError, match="tokens_per_iteration=0"):
        make_batches([10], 0, 64, 1)


def test_plan_only_example_runs():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "plan_only.py"), "--iterations", "2"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("IterationPlan") == 2


def test_plan_with_reference_baseline_prints_only_json(capfd):
    rc = main(["plan", "--gpus", "8", "--tokens-per-iteration", "3000", "--max-len", "8192", "--baselines", "--json"])
    out = capfd.readouterr().out
    assert rc == 0
    data = json.loads(out)  # MILP solver chatter must not reach stdout
    names = [b["name"] for b in data["summary"]["baselines"]]
    assert names == ["megatron", "homogeneous-tuned", "hydraulis-reference"]
    ref = data["summary"]["baselines"][2]["predicted_ms_total"]
    assert data["summary"]["predicted_ms_total"] <= ref + 1e-6
