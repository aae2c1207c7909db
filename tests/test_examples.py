"""Every example runs (as a user would run it) and prints what it promises."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, timeout: int = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_train_llama():
    out = run_example("train_llama.py", "--iterations", "3", "--world-size", "4")
    assert "iter 2 loss" in out


def test_hf_llama():
    out = run_example("hf_llama.py")
    assert out.count("largest gradient difference") == 3
    assert "training losses on 2 ranks" in out


def test_inspect_graph():
    out = run_example("inspect_graph.py")
    for kind in ("pull_parameter", "communicate_activation", "push_gradient"):
        assert kind in out
    assert "1F1B schedule" in out


def test_custom_pass():
    out = run_example("custom_pass.py")
    assert "same loss and gradients as without the pass: True" in out


@pytest.mark.skipif(not (ROOT / "examples" / "plan_only.py").exists(), reason="planner example not present")
def test_plan_only():
    out = run_example("plan_only.py")
    assert "predicted" in out
