"""A checkpoint folder belongs to one run (issue 38 items 1-2), with the manager on thread ranks:
another run's checkpoints are never written over or deleted, a restart that does not resume refuses
before writing, a crash between a replacing save's renames loses nothing, and a damaged newest
checkpoint is skipped for the newest one that verifies."""

import json
import os
import shutil

import pytest
import torch

import hgraph
from hgraph.errors import CheckpointError
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime import checkpoint
from hgraph.runtime.checkpoint_manager import CheckpointManager, CheckpointWarning, complete_steps
from hgraph.runtime.kernels.thread_comm import run_threads

STRATEGIES = ["2x tp1", "tp2"]


def compiled_llama(layers=2):
    model = Llama(LlamaConfig(vocab_size=128, hidden=32, layers=layers, heads=4, kv_heads=2, ffn=64), seed=0)
    return hgraph.compile(model, STRATEGIES, example_inputs=torch.randint(0, 8, (1, 16)))


@pytest.fixture(scope="module")
def compiled():
    return compiled_llama()


def batch(i):
    g = torch.Generator().manual_seed(i)
    return [torch.randint(0, 128, (int(n),), generator=g) for n in torch.randint(4, 40, (5,), generator=g)]


def train(compiled, directory, iterations, resume=False, keep=2):
    """Every thread rank: a run that checkpoints every 2 iterations; returns the parameters, the
    iteration it started at, and the error it stopped with (``None``)."""

    def body(comm):
        trainer = hgraph.Trainer(compiled, comm=comm, optimizer=hgraph.AdamWConfig(lr=3e-3))
        manager = CheckpointManager(str(directory), interval=2, keep=keep, async_write=False)
        try:
            if resume:
                manager.resume(trainer)
            start = trainer.iteration
            while trainer.iteration < iterations:
                trainer.step(batch(trainer.iteration), strategy=trainer.iteration % 2)
                manager.step(trainer)
        except CheckpointError as exc:
            return None, None, str(exc)
        return trainer.full_parameters(), start, None

    return run_threads(body, 2, timeout=300)


def names(directory):
    return [p.name for _, p in complete_steps(directory)]


def manifests(directory):
    return {n: (directory / n / checkpoint.MANIFEST).read_bytes() for n in names(directory)}


def test_a_restart_without_resume_refuses_before_writing_over_the_runs_checkpoints(compiled, tmp_path):
    train(compiled, tmp_path, 6)
    before = manifests(tmp_path)
    assert list(before) == ["step-00000004", "step-00000006"]
    for _, _, error in train(compiled, tmp_path, 6):
        assert error is not None and str(tmp_path) in error and "step-00000006" in error
        assert "checkpoint.resume = true" in error and "another" in error
    assert manifests(tmp_path) == before  # nothing replaced, nothing deleted


def test_another_runs_folder_is_refused_on_resume_and_on_save_and_kept_whole(compiled, tmp_path):
    train(compiled, tmp_path, 4)
    before = manifests(tmp_path)
    other = compiled_llama(layers=1)  # another model
    for resume in (True, False):
        for _, _, error in train(other, tmp_path, 4, resume=resume):
            assert error is not None and "another run's checkpoints" in error and str(tmp_path) in error
    assert manifests(tmp_path) == before


def test_retention_deletes_only_this_runs_checkpoints(compiled, tmp_path):
    train(compiled, tmp_path / "a", 2)
    train(compiled, tmp_path / "b", 8, keep=1)
    shutil.copytree(tmp_path / "a" / "step-00000002", tmp_path / "b" / "step-00000002")
    (tmp_path / "b" / "step-00000002" / checkpoint.MANIFEST).write_text(json.dumps(
        {**json.loads((tmp_path / "a" / "step-00000002" / checkpoint.MANIFEST).read_text()),
         "run": {"model": "SomeoneElses", "parameters": "0", "data": None}}))
    for _, _, error in train(compiled, tmp_path / "b", 10, resume=True, keep=1):
        assert error is not None and "another run's" in error  # refused, not resumed past it
    assert names(tmp_path / "b") == ["step-00000002", "step-00000008"]


def test_resume_after_a_crash_between_the_renames_recovers_the_old_copy(compiled, tmp_path):
    want = train(compiled, tmp_path / "ref", 6)[0][0]
    train(compiled, tmp_path / "run", 4)
    final = tmp_path / "run" / "step-00000004"
    final.rename(final.with_name(".step-00000004.old"))  # what a kill after the first rename leaves
    with pytest.warns(CheckpointWarning, match="put back"):
        results = train(compiled, tmp_path / "run", 6, resume=True)
    for params, start, error in results:
        assert error is None and start == 4
        assert all(torch.equal(params[k], want[k]) for k in want)


@pytest.mark.parametrize("damage", ["truncated rank file", "manifest with wrong types"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_that_verifies(compiled, tmp_path, damage):
    want = train(compiled, tmp_path / "ref", 6)[0][0]
    train(compiled, tmp_path / "run", 4, keep=2)
    newest = tmp_path / "run" / "step-00000004"
    if damage == "truncated rank file":
        rank_file = newest / checkpoint.rank_file(1)
        rank_file.write_bytes(rank_file.read_bytes()[: os.path.getsize(rank_file) // 2])
    else:
        manifest = json.loads((newest / checkpoint.MANIFEST).read_text())
        manifest["files"] = ["not", "a", "mapping"]
        (newest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.warns(CheckpointWarning, match="step-00000004 skipped"):
        results = train(compiled, tmp_path / "run", 6, resume=True)
    for params, start, error in results:
        assert error is None and start == 2
        assert all(torch.equal(params[k], want[k]) for k in want)  # 2 -> 6 again, exactly
    assert names(tmp_path / "run") == ["step-00000004", "step-00000006"]  # the damaged one was replaced
    checkpoint.read_manifest(newest)


def test_a_manifest_with_wrong_types_is_refused_by_name(compiled, tmp_path):
    train(compiled, tmp_path, 2, keep=1)
    path = tmp_path / "step-00000002"
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    for key, value, message in [("files", ["x"], "files is a list; expected a dict"),
                                ("world_size", "2", "world_size is '2'; expected an integer >= 1"),
                                ("parameters", {"w": {"shape": "8"}}, "parameters['w'] is")]:
        (path / checkpoint.MANIFEST).write_text(json.dumps({**manifest, key: value}))
        with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
            checkpoint.read_manifest(path)


def test_when_no_checkpoint_of_the_run_verifies_resume_refuses(compiled, tmp_path):
    train(compiled, tmp_path, 2, keep=1)
    (tmp_path / "step-00000002" / checkpoint.rank_file(0)).write_bytes(b"garbage")
    for _, _, error in train(compiled, tmp_path, 4, resume=True):
        assert error is not None and "none of its 1 checkpoints of this run verifies" in error
