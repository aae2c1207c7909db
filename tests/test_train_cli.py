"""``hgraph train CONFIG`` on local gloo ranks: with strategies and no planner section it plans every
iteration (each batch's strategy is the planner's choice for its lengths); ``planner = "none"``
rotates and says so, and its losses fall and are the ones printed; config keys and command-line flags
reach ``compile`` and the ``Trainer`` (read back from what ran); the backend follows CUDA's
availability; no whole-run time limit unless one is given. One console line per iteration (log
records go to a file, never in between) and the same figures in ``metrics.jsonl`` and in TensorBoard
event files, read back with tensorboard's own reader."""

import inspect
import json
import math
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import hgraph
from hgraph.errors import InputError
from hgraph.core.strategy import Strategy
from hgraph.cli.command import build_parser
from hgraph.cli.train_cli import choose_backend, configured
from hgraph.training.train_config import TrainConfig, read_config


def _train(tmp_path, config, *flags, env=None):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"out": str(tmp_path / "run"), **config}))
    out = subprocess.run([sys.executable, "-m", "hgraph", "train", str(path), *flags], capture_output=True,
                         text=True, timeout=1200, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    return out, history, json.loads((tmp_path / "run" / "summary.json").read_text())


TINY = {"model": "hgraph.cli.demo:tiny_model", "strategies": ["tp2", "2x tp1"], "world_size": 2, "optimizer": {"lr": 0.003},
        "data": {"lengths": "wikipedia", "tokens_per_iteration": 512, "max_len": 128}}


def test_planner_none_rotates_says_so_and_losses_fall(tmp_path):
    out, history, summary = _train(tmp_path, {**TINY, "iterations": 8, "planner": "none",
                                              "metrics": {"peak_tflops": 0.5}})
    assert 'planner = "none": iteration i runs strategy i mod 2' in out.stdout
    losses = [h["loss"] for h in history]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert [h["strategy"] for h in history] == ["tp2", "2x tp1"] * 4  # rotated, as said
    assert all(h["predicted_ms"] is None for h in history) and summary["planner"] == "rotation"
    assert [str(Strategy.parse(s)) for s in summary["strategies"]] == summary["strategies"]
    printed = re.search(r"^training loss ([0-9.]+) -> ([0-9.]+)$", out.stdout, re.M)
    assert printed, out.stdout
    assert [float(x) for x in printed.groups()] == [round(losses[0], 4), round(losses[-1], 4)]
    vocab = 512  # hgraph.cli.demo:tiny_model
    assert losses[0] > math.log(vocab) * 0.9  # starts near chance
    assert sum(losses[-2:]) / 2 < losses[0] - 0.2, losses  # measured: 5.56 -> 5.18
    check_metrics(tmp_path / "run", out.stdout, history)


def test_config_keys_and_flags_reach_compile_and_trainer(tmp_path):
    config = {**TINY, "strategies": ["tp1,pp2", "2x tp1"], "iterations": 2, "planner": "none",
              "compile": {"compute_dtype": "bfloat16", "reduce_dtype": "bfloat16", "recompute": {"mode": "selective"},
                          "schedule": {"overlap": {}}}, "backend": "gloo"}
    flags = ("--recompute", "full", "--schedule", "none", "--pipeline-schedule", "zb1p", "--optimizer.lr", "3e-4",
             "--data.max_len", "96")
    _, history, summary = _train(tmp_path, config, *flags)
    assert summary["options"] == {"compute_dtype": "bfloat16", "reduce_dtype": "bfloat16", "recompute": "full",
                                  "schedule": "none", "pipeline_schedule": "zb1p"}  # what the compiled model holds
    assert summary["backend"] == "gloo" and summary["device"] == "cpu"
    assert all(math.isfinite(h["loss"]) for h in history)
    assert all(max(h["lengths"]) <= 96 for h in history)  # --data.max_len reached the batches
    # the run folder's config.toml is the run's resolved config (file and flags), and a config itself
    ran = configured(build_parser().parse_args(["train", str(tmp_path / "config.json"), *flags]))
    assert ran.optimizer.lr == 3e-4 and ran.compile.schedule.overlap is None
    assert read_config(str(tmp_path / "run" / "config.toml")) == ran


def test_backend_follows_cuda_availability(monkeypatch):
    import torch

    cfg = TrainConfig(model="m:f", strategies=("2x tp1",), world_size=2)
    for available, count, local, expected in [(True, 8, 8, "nccl"), (True, 8, 4, "nccl"), (True, 2, 4, "gloo"),
                                              (False, 0, 2, "gloo")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda a=available: a)
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        assert choose_backend(cfg, local) == expected, (available, count, local)
        assert choose_backend(TrainConfig("m:f", ("2x tp1",), backend="gloo"), local) == "gloo"
    with pytest.raises(InputError, match="backend='nccl' needs 2 GPUs; this machine has 0.*gloo"):
        choose_backend(TrainConfig("m:f", ("2x tp1",), backend="nccl"), 2)
    with pytest.raises(InputError, match="needs 2 GPUs"):
        choose_backend(TrainConfig("m:f", ("2x tp1",), device="cuda"), 2)  # device = "cuda" asks for NCCL
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert choose_backend(TrainConfig("m:f", ("2x tp1",), device="cpu"), 2) == "gloo"


def _sleep_then_meet(seconds):
    import torch.distributed as dist

    time.sleep(seconds)
    dist.barrier()
    return seconds


def test_no_whole_run_timeout_by_default():
    assert inspect.signature(hgraph.launch).parameters["timeout"].default is None

    args = build_parser().parse_args(["train", "config.toml"])
    assert args.timeout is None and args.comm_timeout == 300
    # a run longer than its collective timeout finishes: the collective timeout bounds waits, not the run
    start = time.monotonic()
    assert hgraph.launch(_sleep_then_meet, 2, args=(4,), comm_timeout=2) == [4, 4]
    assert time.monotonic() - start > 4


@pytest.mark.slow  # profiles this machine first (about two minutes here)
@pytest.mark.timeout(1800)
def test_no_planner_section_plans_every_iteration(tmp_path, monkeypatch):
    from hgraph.planner.assign import Planner
    from hgraph.cli.model_spec import ModelSpec
    from hgraph.cli.train_planning import planning_cost_model, profiled_table

    env = {**__import__("os").environ, "HGRAPH_CACHE": str(tmp_path / "cache")}
    out, history, summary = _train(tmp_path, {**TINY, "iterations": 6}, env=env)
    assert "planning every iteration over 2 strategies" in out.stdout and "rotat" not in out.stdout
    assert summary["planner"] == "per iteration"
    # the oracle: the planner called directly on each batch's lengths, with the profile the run cached
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    cfg = read_config(str(tmp_path / "config.json"))
    table = profiled_table(cfg, ModelSpec(cfg.model, cfg.seed), ["tp2", "tp1"], measure=False)  # the cached profile only
    planner = Planner(planning_cost_model(cfg, table), list(cfg.strategies))
    for h in history:
        assert h["predicted_ms"] is not None
        assert h["strategy"] == str(planner.plan(h["lengths"]).strategy), h["lengths"]


def _torchrun(tmp_path, config, flags=()):
    """``torchrun --standalone --nproc-per-node 2 -m hgraph train`` on ``config`` (``$HGRAPH_CACHE`` in
    ``tmp_path``) with ``flags``: the finished process and torchrun's own process id."""
    import os
    from pathlib import Path

    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", HGRAPH_CACHE=str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"out": str(tmp_path / "run"), **config}))
    with subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hgraph", "train", str(path),
                           *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        stdout, stderr = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), proc.pid


def test_under_torchrun_plans_with_a_cost_table_or_says_why_it_cannot_profile(tmp_path):
    """``torchrun -m hgraph train``: with a preset cost table it plans every iteration (said once, by
    rank 0); without one, where profiling cannot run (a context too short for three profile lengths)
    it stops with the reason and the fix, having measured nothing."""
    proc, _ = _torchrun(tmp_path, {**TINY, "iterations": 2, "planner": {"cost_table": "llama7b_a800"}})
    assert proc.returncode != 0 and "cannot plan these strategies: cost model" in proc.stderr
    assert "no scheme tp1;" in proc.stderr  # the 7B table has no single-GPU scheme: named, before any compile
    proc, _ = _torchrun(tmp_path, {**TINY, "strategies": ["tp2", "tp1,pp2"], "iterations": 2,
                                   "planner": {"cost_table": "llama7b_a800"}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("planning every iteration over 2 strategies (tp2; tp1,pp2) with cost table "
                             "llama7b_a800") == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["planner"] == "per iteration" and summary["backend"] == "gloo" and summary["iterations"] == 2
    proc, _ = _torchrun(tmp_path, {**TINY, "iterations": 2, "data": {**TINY["data"], "max_len": 20}})
    assert proc.returncode != 0 and not (tmp_path / "cache" / "profile").exists()
    assert "profiles T(l) on the job's own ranks, which cannot run here: lengths [16, 20]" in proc.stderr
    assert "cost_table" in proc.stderr and 'planner = "none"' in proc.stderr


@pytest.mark.slow  # two torchrun jobs, the first profiles (about a minute here)
@pytest.mark.timeout(1800)
def test_under_torchrun_profiles_on_its_own_ranks_then_reuses_the_profile(tmp_path, monkeypatch):
    """With strategies and no cost table, the first ``torchrun -m hgraph train`` measures ``T(l)`` on its
    own two ranks (the processes torchrun started: their parent is torchrun), caches it, and plans every
    iteration with it; the second run reads that cache and measures nothing."""
    from hgraph.cli.model_spec import ModelSpec
    from hgraph.cli.train_planning import planning_cost_model, profiled_table
    from hgraph.planner.assign import Planner
    from hgraph.training.train_config import read_config

    config = {**TINY, "iterations": 3}
    proc, torchrun_pid = _torchrun(tmp_path, config, ["--verbose"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("hgraph train: profiling T(l) on this job's 2 ranks (cpu): schemes tp2, tp1") == 1
    # progress: rank 0's log records (--verbose shows INFO on stderr), none from rank 1
    assert proc.stderr.count("INFO hgraph.profiling.profile_job: round 3/3 measured") == 1, proc.stderr[-3000:]
    assert "with T(l) profiled on this job's 2 ranks (tp2, tp1; now, cached in" in proc.stdout
    [entry] = (tmp_path / "cache" / "profile").iterdir()
    raw = json.loads(entry.read_bytes().split(b"\n", 1)[1])
    assert [(m["rank"], m["parent_pid"]) for m in raw["measured_by"]] == [(0, torchrun_pid), (1, torchrun_pid)]
    assert raw["world_size"] == 2 and raw["ranks_per_node"] == 2 and raw["device"] == "cpu"
    first = json.loads((tmp_path / "run" / "history.json").read_text())
    # the oracle: the planner called directly on each batch's lengths, with the table of the cached profile
    # (read through the local profile's cache key: a local run and a torchrun job on one node share it)
    cfg = read_config(str(tmp_path / "config.json"))
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    table = profiled_table(cfg, ModelSpec(cfg.model, cfg.seed), ["tp2", "tp1"], measure=False)
    planner = Planner(planning_cost_model(cfg, table), list(cfg.strategies))
    for h in first:
        assert h["predicted_ms"] is not None
        assert h["strategy"] == str(planner.plan(h["lengths"]).strategy), h["lengths"]

    stamp, blob = entry.stat().st_mtime_ns, entry.read_bytes()
    proc, _ = _torchrun(tmp_path, config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profiling" not in proc.stdout and "round 1/" not in proc.stdout + proc.stderr
    assert f"with T(l) profiled on this job's 2 ranks (tp2, tp1; read from {entry})" in proc.stdout
    assert entry.stat().st_mtime_ns == stamp and entry.read_bytes() == blob  # not measured, not rewritten
    assert list((tmp_path / "cache" / "profile").iterdir()) == [entry]
    second = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [h["strategy"] for h in second] == [h["strategy"] for h in first]
    assert [h["predicted_ms"] for h in second] == [h["predicted_ms"] for h in first]


def check_metrics(run, stdout, history):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hgraph.runtime.metrics import read_jsonl

    progress = [line for line in stdout.splitlines() if line.startswith("iter ")]
    assert len(progress) == len(history)  # one line per iteration, each whole
    for k, (line, h) in enumerate(zip(progress, history)):
        assert line.startswith(f"iter {k + 1}/{len(history)}  loss {h['loss']:.4f}  ") and h["strategy"] in line
    assert "INFO" not in stdout and "hgraph.training.trainer" not in stdout  # log records are not on the console...
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
