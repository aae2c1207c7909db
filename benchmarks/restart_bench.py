"""What a lost rank costs: ``hgraph train`` under ``torchrun --max-restarts 1`` with one rank SIGKILLed
mid-run, against the same run uninterrupted, side by side (JSON).

    python benchmarks/restart_bench.py [--iterations 16] [--interval 4] [--kill-after 10]

Both runs are the same 2-rank ``torchrun --standalone`` job of ``hgraph train`` as a user starts it: the
tiny Llama of ``make demo`` (``hgraph.cli.demo:tiny_model``) on the embedded stdlib corpus, ``tp2`` and
``2x tp1`` in turn, warmup + cosine schedule, an asynchronous checkpoint every ``--interval``
iterations, export at the end. In the second run rank 1 is SIGKILLed as soon as rank 0 has printed
iteration ``--kill-after`` (between two checkpoints, so the iterations since the last one are trained
again); torchrun restarts the job, which resumes from the newest complete checkpoint.

Reported: each iteration's loss in both runs (from ``metrics.jsonl``), whether they are equal and the
largest difference, whether the exported models are equal bit for bit, the wall time of each job, the
restart's cost (``restart_cost_s``: from the kill until the restarted job has printed the iteration the
killed one had reached; ``extra_wall_s``: the job's wall time over the uninterrupted one's) and its parts
(kill to "resumed from": torchrun stopping the surviving rank, ``torchrun_stop_s`` of it, then process
start, compile and checkpoint load; then the iterations trained again). Noisy machines: compare within one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import load_file

from hgraph.runtime.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def config(directory: Path, name: str, args: argparse.Namespace) -> Path:
    run = directory / name
    cfg = {
        "model": "hgraph.cli.demo:tiny_model", "strategies": ["tp2", "2x tp1"], "world_size": 2,
        "iterations": args.iterations, "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
        "lr_schedule": {"kind": "cosine", "warmup": 2},
        "data": {"paths": ["hgraph:stdlib"], "tokenizer": "hgraph:stdlib", "context": 96,
                 "tokens_per_iteration": 384, "window": 16},
        "checkpoint": {"dir": str(run / "checkpoint"), "interval": args.interval, "resume": True, "keep": 2},
        "export": {"dir": str(run / "model")},
        "out": str(run),
    }
    path = directory / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def torchrun(cfg: Path, log: Path, *extra: str) -> subprocess.Popen:
    args = [TORCHRUN, "--standalone", "--nproc-per-node", "2", *extra, "-m", "hgraph", "train", str(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout: float) -> float:
    """Poll until ``ready``; the monotonic time it became true. Fails if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"job ended (code {proc.returncode}) or timed out:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)
    return time.monotonic()


def worker(agent: int, rank: int) -> Optional[int]:
    """The pid of torchrun agent ``agent``'s worker with ``RANK=rank`` (Linux /proc)."""
    for task in Path(f"/proc/{agent}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                raw = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in raw:
                    return int(child)
    return None


def printed(log: Path, iteration: int, total: int, after: str = "") -> bool:
    """Whether rank 0 printed iteration ``iteration`` (1-based, as the console does) after ``after``."""
    text = log.read_text()
    if after:
        text = text.partition(after)[2] if after in text else ""
    return f"iter {iteration}/{total} " in text


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> float:
    try:
        proc.wait(timeout)
    finally:
        stop(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"job failed (code {proc.returncode}):\n{log.read_text()[-3000:]}")
    return time.monotonic()


def torchrun_stop_s(out: str) -> Optional[float]:
    """Seconds from torchrun's SIGTERM to the surviving workers until it reported the failure (both log
    lines carry torchrun's timestamp), i.e. how long the surviving ranks took to exit."""
    stamps = {}
    for line in out.splitlines():
        for key, marker in (("sigterm", "closing signal SIGTERM"), ("failed", "failed (exitcode")):
            if marker in line and key not in stamps:
                clock = line.split()[1]  # "W1202 00:13:44.749000 pid file:line] ..."
                h, m, sec = clock.split(":")
                stamps[key] = int(h) * 3600 + int(m) * 60 + float(sec)
    return stamps["failed"] - stamps["sigterm"] if len(stamps) == 2 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--interval", type=int, default=4, help="checkpoint every N iterations")
    parser.add_argument("--kill-after", type=int, default=10, help="kill rank 1 once iteration N is printed")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    n, k = args.iterations, args.kill_after
    with tempfile.TemporaryDirectory(prefix="hgraph-restart-bench-") as tmp:
        d = Path(tmp)
        log = d / "reference.txt"
        start = time.monotonic()
        proc = torchrun(config(d, "reference", args), log)
        reference_wall = finish(proc, log, args.timeout) - start

        log = d / "killed.txt"
        start = time.monotonic()
        proc = torchrun(config(d, "killed", args), log, "--max-restarts", "1", "--monitor-interval", "0.1")
        try:
            killed_at = wait_until(lambda: printed(log, k, n), proc, log, args.timeout)
            victim = worker(proc.pid, 1)
            if victim is None:
                raise RuntimeError("no torchrun worker with RANK=1")
            os.kill(victim, signal.SIGKILL)
            resumed_at = wait_until(lambda: "resumed from" in log.read_text(), proc, log, args.timeout)
            caught_up = wait_until(lambda: printed(log, k, n, after="resumed from"), proc, log, args.timeout)
        except BaseException:
            stop(proc)
            raise
        killed_wall = finish(proc, log, args.timeout) - start
        out = log.read_text()
        resumed_line = next(line for line in out.splitlines() if "resumed from" in line)
        resumed_iteration = int(resumed_line.rsplit("at iteration ", 1)[1])

        ref, got = read_jsonl(d / "reference" / "metrics"), read_jsonl(d / "killed" / "metrics")
        ref_model = load_file(str(d / "reference" / "model" / "model.safetensors"))
        got_model = load_file(str(d / "killed" / "model" / "model.safetensors"))
    bitwise = set(ref_model) == set(got_model) and all(
        got_model[name].dtype == value.dtype and torch.equal(got_model[name], value) for name, value in ref_model.items())
    losses = {"uninterrupted": [r["loss"] for r in ref], "killed_and_restarted": [r["loss"] for r in got]}
    equal_len = len(ref) == len(got)
    report = {
        "iterations": n, "checkpoint_interval": args.interval, "killed_after_iteration": k,
        "resumed_at_iteration": resumed_iteration, "iterations_trained_again": k - resumed_iteration,
        "losses_equal": equal_len and losses["uninterrupted"] == losses["killed_and_restarted"],
        "max_abs_loss_difference": max(abs(a - b) for a, b in zip(*losses.values())) if equal_len else None,
        "exported_model_bitwise_equal": bitwise,
        "wall_s": {"uninterrupted": reference_wall, "killed_and_restarted": killed_wall},
        "extra_wall_s": killed_wall - reference_wall,
        "restart_cost_s": caught_up - killed_at,
        "kill_to_resumed_s": resumed_at - killed_at,
        "resumed_to_caught_up_s": caught_up - resumed_at,
        "torchrun_stop_s": torchrun_stop_s(out),
        "losses": losses,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
