"""What the long-run tests share: a small ``hgraph train`` config on real text, starting ``hgraph train``
and ``torchrun`` as a user would (each in its own process group, always stopped at the end), finding a
torchrun worker by its ``RANK``, and comparing exported models bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def train_config(tmp: Path, name: str, iterations: int = 8, interval: int = 2, **top) -> Path:
    """An HF-free tiny Llama (``hgraph.cli.demo:tiny_model``) on the embedded stdlib corpus, two strategies
    taken in turn, a warmup + cosine schedule, checkpoints every ``interval`` iterations (all kept),
    resume on, export at the end; everything under ``tmp/name``."""
    run = tmp / name
    cfg = {
        "model": "hgraph.cli.demo:tiny_model", "strategies": ["tp2", "2x tp1"], "world_size": 2,
        "iterations": iterations, "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
        "lr_schedule": {"kind": "cosine", "warmup": 2},
        "data": {"paths": ["hgraph:stdlib"], "tokenizer": "hgraph:stdlib", "context": 96,
                 "tokens_per_iteration": 384, "window": 16},
        "checkpoint": {"dir": str(run / "checkpoint"), "interval": interval, "resume": True, "keep": 0},
        "export": {"dir": str(run / "model")},
        "out": str(run),
        **top,
    }
    run.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def start(args: list[str], log: Path, **kw) -> subprocess.Popen:
    """Start ``args`` in a process group of its own, stdout and stderr into ``log``."""
    fh = open(log, "w")
    return subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env=kw.pop("env", env()), **kw)


def stop(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and everything it started (its process group) if still running."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@contextlib.contextmanager
def running(args: list[str], log: Path, **kw) -> Iterator[subprocess.Popen]:
    proc = start(args, log, **kw)
    try:
        yield proc
    finally:
        stop(proc)


def hgraph_train(config: Path) -> list[str]:
    return [sys.executable, "-m", "hgraph", "train", str(config)]


def torchrun_train(config: Path, *torchrun_args: str) -> list[str]:
    return [TORCHRUN, *torchrun_args, "-m", "hgraph", "train", str(config)]


def wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll ``ready`` until true; fail clearly if ``proc`` ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (code {proc.returncode}) before {what}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f}s:\n{tail(log)}")
        time.sleep(0.05)


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """Wait for ``proc`` to end on its own; its output. Fails (after stopping it) on a timeout."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError(f"still running after {timeout:.0f}s:\n{tail(log)}") from None
    return log.read_text()


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text()[-chars:] if log.exists() else "(no output)"


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def worker_env(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return {}


def torchrun_worker(agent: int, rank: int) -> Optional[int]:
    """The pid of the torchrun worker with global ``RANK=rank`` among agent ``agent``'s children."""
    for child in children(agent):
        if worker_env(child).get("RANK") == str(rank):
            return child
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(checkpoint_dir: Path, iteration: int) -> bool:
    return (checkpoint_dir / f"step-{iteration:08d}" / "manifest.json").is_file()


def load_export(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model" / "model.safetensors"))


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def history(run: Path) -> list[dict]:
    return json.loads((run / "history.json").read_text())
