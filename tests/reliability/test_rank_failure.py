"""No hangs: a rank that dies, is killed or stops makes every other rank fail within the timeout, and
``hgraph.launch`` raises one ``CommunicationError`` naming it, with no process left behind."""

import multiprocessing
import os
import re
import signal
import time

import pytest
import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.training.configs import RunConfig


def train_and_fail(victim, kill_signal, at_step, strategy):
    """Two iterations on every rank; ``victim`` dies at schedule event ``at_step`` of the second."""
    import torch.distributed as dist

    import hgraph.training.trainer as trainer_module

    torch.manual_seed(0)
    model = Llama(LlamaConfig(hidden=32, heads=4, kv_heads=2, ffn=64, layers=2))
    compiled = hgraph.compile(model, [strategy], example_inputs=torch.randint(0, 256, (1, 8)))
    trainer = trainer_module.Trainer(compiled, run=RunConfig(micro_batch_tokens=16))
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, 256, (12,), generator=g) for _ in range(8)]
    trainer.step(batch)
    if dist.get_rank() == victim:
        events = []

        def die(event, step):
            events.append(event)
            if len(events) == at_step:
                if kill_signal is None:
                    os._exit(1)
                os.kill(os.getpid(), kill_signal)

        run = trainer_module.run_iteration
        trainer_module.run_iteration = lambda *a, **k: run(*a, on_step=die, **k)
    trainer.step(batch)
    return "finished"


def _assert_reported(exc_text, victim, how):
    first, *others = exc_text.splitlines()
    assert first.startswith(f"rank {victim} {how}"), exc_text
    survivors = [line for line in others if line.startswith("  rank ")]
    assert len(survivors) == 3, exc_text
    # Every survivor failed on its own (not stopped by the launcher) and says what it was doing.
    assert all("CommunicationError: rank" in line and "failed in" in line for line in survivors), exc_text
    assert multiprocessing.active_children() == []


def test_killed_rank_is_reported_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(hgraph.errors.CommunicationError) as info:
        hgraph.launch(train_and_fail, 4, args=(2, None, 3, "tp2,pp2"), timeout=90, comm_timeout=20)
    assert time.monotonic() - start < 90
    _assert_reported(str(info.value), 2, "died with exit code 1")


@pytest.mark.slow
def test_sigkill_during_push_is_reported():
    with pytest.raises(hgraph.errors.CommunicationError) as info:
        hgraph.launch(train_and_fail, 4, args=(1, signal.SIGKILL, 8, "2x tp2"), timeout=90, comm_timeout=20)
    _assert_reported(str(info.value), 1, "was killed by SIGKILL")


def stuck_in_subgroup(seconds):
    """Ranks 0-2 all-reduce on a subgroup; rank 2 never joins (sleeps past the collective timeout)."""
    import torch.distributed as dist

    from hgraph.runtime.kernels.failures import comm_step
    from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm

    comm = ProcessGroupComm()
    rank = dist.get_rank()
    if rank == 2:
        time.sleep(seconds)
        return "slept"
    if rank == 3:
        return "idle"
    start = time.monotonic()
    try:
        with comm_step(rank, "a test all_reduce on group (0, 1, 2)"):
            comm.all_reduce(torch.ones(1), (0, 1, 2))
    except hgraph.errors.CommunicationError as exc:
        raise hgraph.errors.CommunicationError(f"{exc} [waited {time.monotonic() - start:.1f}s]") from exc
    return "never"


def test_stuck_peer_times_out_on_a_subgroup():
    """Subgroups get the launch's collective timeout (torch's default would be 30 minutes)."""
    with pytest.raises(hgraph.errors.CommunicationError) as info:
        hgraph.launch(stuck_in_subgroup, 4, args=(120,), timeout=120, comm_timeout=3)
    text = str(info.value)
    assert text.startswith("rank 2 stopped responding"), text
    waited = [float(w) for w in re.findall(r"\[waited ([0-9.]+)s\]", text)]
    assert len(waited) == 2 and all(3 <= w < 15 for w in waited), text  # ranks 0 and 1, not 30 minutes
    assert "rank 0: CommunicationError: rank 0 failed in a test all_reduce on group (0, 1, 2)" in text
    assert "rank 3: finished" in text
    assert multiprocessing.active_children() == []


def test_launch_rejects_bad_timeouts():
    with pytest.raises(hgraph.errors.CommunicationError, match=r"comm_timeout=0; launch needs a positive number"):
        hgraph.launch(stuck_in_subgroup, 2, args=(0,), comm_timeout=0)
