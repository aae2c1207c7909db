"""Long runs survive what clusters do to them, and continue exactly: a rank killed under
``torchrun --max-restarts 1`` (the job restarts itself from its newest checkpoint; ``hgraph train`` and
the Python script pattern of ``examples/train_llama.py``), and SIGTERM
(every rank finishes the iteration, checkpoints, exits 0; a second run resumes). The oracle is the same
``hgraph train`` config run without interruption: the exported model must be equal bit for bit (gloo),
and so must every loss of the iterations trained again."""

import os
import signal

import pytest
from safetensors.torch import load_file

from long_run_tools import (
    ROOT, TORCHRUN, assert_bitwise_equal, complete, finish, hgraph_train, history, load_export, running, tail,
    torchrun_train, torchrun_worker, train_config, wait_for,
)
from hgraph.runtime.metrics import read_jsonl

ITERATIONS = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its exported model and history."""
    tmp = tmp_path_factory.mktemp("reference")
    config = train_config(tmp, "run", ITERATIONS)
    log = tmp / "log.txt"
    with running(hgraph_train(config), log) as proc:
        out = finish(proc, log, 600)
    assert proc.returncode == 0, out[-4000:]
    return load_export(tmp / "run"), history(tmp / "run")


def assert_continues_exactly(run, reference):
    model, ref_history = reference
    assert_bitwise_equal(load_export(run), model)
    # metrics.jsonl spans the restart: the killed attempt's records of the iterations trained again
    # were replaced; every loss and batch equals the uninterrupted run's
    records = read_jsonl(run / "metrics")
    assert [r["iteration"] for r in records] == list(range(ITERATIONS))
    assert [r["loss"] for r in records] == [h["loss"] for h in ref_history]
    assert [r["tokens"] for r in records] == [sum(h["lengths"]) for h in ref_history]
    # history.json: at least the iterations of the last attempt, equal to the reference's
    got = history(run)
    first = got[0]["iteration"]
    assert [h["iteration"] for h in got] == list(range(first, ITERATIONS)) and first < ITERATIONS
    for h in got:
        want = ref_history[h["iteration"]]
        assert (h["loss"], h["lengths"], h["strategy"]) == (want["loss"], want["lengths"], want["strategy"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_restarts_after_a_killed_rank_and_continues_exactly(tmp_path, reference):
    config = train_config(tmp_path, "run", ITERATIONS)
    ckpt, log = tmp_path / "run" / "checkpoint", tmp_path / "log.txt"
    with running(torchrun_train(config, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                "--monitor-interval", "0.1"), log) as agent:
        wait_for("the second checkpoint", lambda: complete(ckpt, 4), agent, log, 600)
        victim = torchrun_worker(agent.pid, 1)
        assert victim is not None, tail(log)
        os.kill(victim, signal.SIGKILL)  # no handler runs: the rank is simply gone
        out = finish(agent, log, 600)
    assert agent.returncode == 0, out[-4000:]
    assert "resumed from" in out and "step-0000000" in out, out[-4000:]  # the restarted attempt resumed
    assert_continues_exactly(tmp_path / "run", reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_finishes_the_iteration_checkpoints_exits_0_and_resumes_exactly(tmp_path, reference):
    config = train_config(tmp_path, "run", ITERATIONS, interval=3)
    ckpt, log = tmp_path / "run" / "checkpoint", tmp_path / "log.txt"
    with running(hgraph_train(config), log) as proc:
        wait_for("iteration 2", lambda: "iter 2/8" in log.read_text(), proc, log, 600)
        proc.send_signal(signal.SIGTERM)  # to `hgraph train`, which passes it on to its ranks
        out = finish(proc, log, 300)
    assert proc.returncode == 0, out[-4000:]
    stopped = [int(line.split("after iteration ")[1].split(";")[0]) for line in out.splitlines()
               if "stopped by a signal after iteration" in line and ";" in line]
    assert stopped and 2 <= stopped[0] < ITERATIONS, out[-4000:]
    assert complete(ckpt, stopped[0]), sorted(p.name for p in ckpt.iterdir())
    assert not (tmp_path / "run" / "model").exists()  # a stopped run does not export
    log2 = tmp_path / "log2.txt"
    with running(hgraph_train(config), log2) as proc:
        out = finish(proc, log2, 600)
    assert proc.returncode == 0, out[-4000:]
    assert f"resumed from {ckpt / f'step-{stopped[0]:08d}'}" in out
    assert_continues_exactly(tmp_path / "run", reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_one_torchrun_worker_stops_every_rank_after_the_same_iteration(tmp_path, reference):
    """A scheduler may signal the ranks at different moments, or only some: every rank still stops after
    the same iteration (the stop request rides on the iteration's all-reduce), and torchrun exits 0."""
    config = train_config(tmp_path, "run", ITERATIONS, interval=0)
    ckpt, log = tmp_path / "run" / "checkpoint", tmp_path / "log.txt"
    args = torchrun_train(config, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1")
    with running(args, log) as agent:
        wait_for("iteration 3", lambda: "iter 3/8" in log.read_text(), agent, log, 600)
        os.kill(torchrun_worker(agent.pid, 1), signal.SIGTERM)  # rank 1 only; rank 0 never gets a signal
        out = finish(agent, log, 300)
    assert agent.returncode == 0, out[-4000:]
    steps = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))
    assert len(steps) == 1 and 3 <= int(steps[0][5:]) < ITERATIONS, steps  # one checkpoint, by every rank
    with running(torchrun_train(config, "--standalone", "--nproc-per-node", "2"), log) as agent:
        out = finish(agent, log, 600)
    assert agent.returncode == 0, out[-4000:]
    assert_continues_exactly(tmp_path / "run", reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_python_script_pattern_restarts_under_torchrun_and_continues_exactly(tmp_path):
    """``examples/train_llama.py`` (init_from_env, CheckpointManager.resume, checkpoints.step) under
    ``torchrun --max-restarts 1``: rank 1 killed after the second checkpoint; the job finishes on its
    own with the weights of an uninterrupted run, bit for bit."""
    script = str(ROOT / "examples" / "train_llama.py")
    common = ["--iterations", "30", "--strategies", "tp2", "2x tp1", "--checkpoint-interval", "2"]
    ref_log = tmp_path / "ref.txt"
    with running([TORCHRUN, "--standalone", "--nproc-per-node", "2", script, *common,
                  "--checkpoint-dir", str(tmp_path / "ref-ckpt"), "--out", str(tmp_path / "ref")], ref_log) as proc:
        out = finish(proc, ref_log, 600)
    assert proc.returncode == 0, out[-4000:]
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.txt"
    with running([TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval",
                  "0.1", script, *common, "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "run")],
                 log) as agent:
        wait_for("the second checkpoint", lambda: complete(ckpt, 4), agent, log, 600)
        os.kill(torchrun_worker(agent.pid, 1), signal.SIGKILL)
        out = finish(agent, log, 600)
    assert agent.returncode == 0, out[-4000:]
    assert "resumed at iteration" in out, out[-4000:]
    assert_bitwise_equal(load_file(str(tmp_path / "run" / "model.safetensors")),
                         load_file(str(tmp_path / "ref" / "model.safetensors")))
    losses = {}  # every iteration's printed loss equals the uninterrupted run's (redone ones included)
    for text in (out, ref_log.read_text()):
        for line in text.splitlines():
            if line.startswith("iter ") and " loss " in line:
                i, loss = line.split()[1], line.split()[3]
                losses.setdefault(int(i), set()).add(loss)
    assert sorted(losses) == list(range(30)) and all(len(v) == 1 for v in losses.values())
