"""Checkpoints off the critical path, on real gloo processes: the write runs in the background while
training continues, holds the state of the iteration it was taken at, at most one is in flight (a
second save waits), and a rank killed in the middle of writing its file leaves the previous checkpoint
complete and loadable (the killed one is never taken for complete)."""

import copy
import json
import os
import signal
import time

import pytest
import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime import checkpoint, checkpoint_dcp
from hgraph.runtime.checkpoint_manager import CheckpointManager, complete_steps, latest
from hgraph.runtime.kernels.thread_comm import run_threads
from test_metrics import SMALL, _planner

STRATEGIES = ["2x tp1", "tp2"]
WRITE_DELAY = 1.5  # seconds every background write is held back, so that it is surely still in flight


def make_trainer():
    model = Llama(LlamaConfig(vocab_size=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64), seed=0)
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=torch.randint(0, 8, (1, 16)))
    return hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=3e-3, grad_clip=1.0))


def batch(i):
    g = torch.Generator().manual_seed(i)
    return [torch.randint(0, 128, (int(n),), generator=g) for n in torch.randint(4, 40, (5,), generator=g)]


def step(trainer):
    trainer.step(batch(trainer.iteration), strategy=trainer.iteration % len(STRATEGIES))


def _train_save_and_get_killed(directory, record):
    trainer = make_trainer()
    rank = trainer.rank
    events = []
    write_data, commit = checkpoint_dcp.FreshWriter.write_data, checkpoint.commit

    def slow_write_data(writer, plan, planner):  # DCP's background write, timed and held back
        events.append(("write_start", writer.path.name.split(".")[1], time.monotonic()))
        time.sleep(WRITE_DELAY)
        return write_data(writer, plan, planner)

    def timed_commit(snap, path, comm):  # the end of the background work
        out = commit(snap, path, comm)
        events.append(("write_end", path.name, time.monotonic()))
        return out

    checkpoint_dcp.FreshWriter.write_data, checkpoint.commit = slow_write_data, timed_commit
    manager = CheckpointManager(directory, keep=0)
    step(trainer)
    step(trainer)
    params = {2: trainer.full_parameters()}
    manager.save(trainer)  # step-2, asynchronous
    in_flight_at_return = manager.in_flight
    start = time.monotonic()
    step(trainer)  # trains while step-2 is written
    trained_during_write = manager.in_flight
    events.append(("step_3_done", "", time.monotonic() - start))
    params[3] = trainer.full_parameters()
    manager.save(trainer)  # step-3: waits for step-2's write first
    events.append(("save_3_returned", "", time.monotonic()))
    manager.wait()
    checkpoint_dcp.FreshWriter.write_data, checkpoint.commit = write_data, commit
    if rank == 0:
        torch.save(params, record / "params.pt")
        (record / "events.json").write_text(json.dumps({"events": events, "in_flight": in_flight_at_return,
                                                         "trained_during_write": trained_during_write}))
    step(trainer)
    step(trainer)
    if rank == 1:  # killed in the middle of writing its file of step-5 (DCP writes it with torch.save)
        def torn_save(obj, fh):
            fh.write(b"PK\x03\x04 half a checkpoint")
            fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.torch.save = torn_save
    manager.save(trainer, blocking=True)
    step(trainer)
    return "not reached"


def _resume(directory):
    trainer = make_trainer()
    manager = CheckpointManager(directory)
    resumed = manager.resume(trainer)
    params = trainer.full_parameters()
    step(trainer)  # and it trains on
    manager.close()
    earlier = make_trainer()
    earlier.load(os.path.join(directory, "step-00000002"))  # written while iteration 3 trained
    return str(resumed), trainer.iteration, params, earlier.full_parameters()


@pytest.mark.timeout(600)
def test_async_write_in_background_one_in_flight_and_a_kill_mid_write_leaves_the_previous(tmp_path):
    directory, record = tmp_path / "ckpt", tmp_path
    with pytest.raises(hgraph.errors.CommunicationError, match="rank 1 was killed by SIGKILL"):
        hgraph.launch(_train_save_and_get_killed, 2, args=(str(directory), record), timeout=500)
    found = json.loads((record / "events.json").read_text())
    assert found["in_flight"] and found["trained_during_write"]  # save returned at once; training went on
    events = {(kind, name): t for kind, name, t in found["events"]}
    assert events[("step_3_done", "")] < WRITE_DELAY  # the step did not wait for the write
    # one write in flight at most: step-3's write began only after step-2's had ended
    assert events[("write_start", "step-00000003")] >= events[("write_end", "step-00000002")]
    assert [i for i, _ in complete_steps(directory)] == [2, 3]  # step-5 never became a checkpoint
    # the kill really hit the write: rank 1's file was open (what reached it of the torn write is DCP's
    # stream's business) in a folder that never got a manifest
    partial = directory / ".step-00000005.partial"
    torn = partial / checkpoint.rank_file(1)
    assert torn.exists() and not (partial / checkpoint.MANIFEST).exists(), sorted(partial.iterdir())
    assert torn.stat().st_size < (directory / "step-00000003" / checkpoint.rank_file(1)).stat().st_size
    assert latest(directory) == directory / "step-00000003"

    path, iteration, params, params_2 = hgraph.launch(_resume, 2, args=(str(directory),), timeout=500)[0]
    assert path.endswith("step-00000003") and iteration == 4
    want = torch.load(record / "params.pt")
    for name in want[3]:
        assert torch.equal(params[name], want[3][name]), name
        assert torch.equal(params_2[name], want[2][name]), name  # the state at the save, not later
    assert not (directory / ".step-00000005.partial").exists()  # resume cleared the torn save


def test_a_save_killed_between_its_renames_leaves_the_previous_checkpoint_loadable(tmp_path):
    """``trainer.save`` onto an existing checkpoint renames it aside before the new one takes its place;
    a kill between the two renames leaves only ``.<name>.old``, which ``load`` then uses."""
    model = Llama(LlamaConfig(vocab_size=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64), seed=0)
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=torch.randint(0, 8, (1, 16)))
    path = tmp_path / "ckpt"

    def body(comm):
        trainer = hgraph.Trainer(compiled, comm=comm, optimizer=hgraph.AdamWConfig(lr=3e-3))
        step(trainer)
        trainer.save(str(path))
        saved = trainer.full_parameters()
        comm.barrier(trainer.world)
        if trainer.rank == 0:  # the state a kill right after the first rename leaves
            path.rename(path.with_name(".ckpt.old"))
        comm.barrier(trainer.world)
        fresh = hgraph.Trainer(compiled, comm=comm, optimizer=hgraph.AdamWConfig(lr=3e-3))
        fresh.load(str(path))
        return saved, fresh.full_parameters(), fresh.iteration

    for saved, loaded, iteration in run_threads(body, 2, timeout=300):
        assert iteration == 1
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_resume_restores_the_planners_online_correction(tmp_path):
    """The correction a planner fitted to measured times is part of the checkpoint: a resumed planner
    holds exactly the state the saving one had, so it plans the next batch as that one would have."""
    model = Llama(LlamaConfig(**SMALL), seed=0)
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=torch.randint(0, 64, (1, 8)))
    g = torch.Generator().manual_seed(0)
    data = [[torch.randint(0, 64, (int(n),), generator=g) for n in (12, 30, 7, 50)] for _ in range(3)]
    lengths = [40, 9, 33, 17, 60]

    def body(comm):
        planner = _planner(compiled, STRATEGIES)
        trainer = hgraph.Trainer(compiled, comm=comm, optimizer=hgraph.AdamWConfig(lr=1e-3), planner=planner)
        manager = CheckpointManager(str(tmp_path / "ckpt"))
        for batch in data:
            trainer.step(batch)
        manager.save(trainer)
        at_save = copy.deepcopy(planner)
        trainer.step(data[0])  # the run goes on; the correction moves on
        fresh_planner = _planner(compiled, STRATEGIES)
        fresh = hgraph.Trainer(compiled, comm=comm, optimizer=hgraph.AdamWConfig(lr=1e-3), planner=fresh_planner)
        manager.resume(fresh)
        return at_save, fresh_planner, planner

    at_save, resumed, moved_on = run_threads(body, 2, timeout=300)[0]  # rank 0 plans, so rank 0 corrects
    assert resumed.correction.observations == at_save.correction.observations == 3
    assert resumed.correction.state_dict() == at_save.correction.state_dict()
    assert moved_on.correction.state_dict() != at_save.correction.state_dict()
    assert resumed.plan(lengths).predicted_ms == at_save.plan(lengths).predicted_ms
