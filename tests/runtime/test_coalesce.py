"""Coalesced Pull/Push: one layer's plans run together issue O(layers) communication calls, and give
the same results as running every plan alone (bit-identical on simulated ranks)."""

import collections
import threading

import pytest
import torch

import hgraph
from hgraph.lnk import local_shards, solve
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.kernels import thread_comm
from hgraph.runtime import executor
from hgraph.runtime.kernels.coalesce import execute_coalesced
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.launch import launch
from hgraph.runtime.kernels.reshard import execute
from hgraph.training.configs import AdamWConfig, RunConfig
from hgraph.training.trainer import Trainer

from test_reshard_gloo import CASES, _value  # the plan cases of every kind (collectives and p2p)

NAMES = ("start_all_reduce", "start_all_gather", "start_reduce_scatter", "start_all_to_all",
         "start_broadcast", "start_exchange")


class CallCounter:
    """Calls every simulated rank starts, by phase: inside Executor.pull_start / push_start / elsewhere."""

    def __init__(self, monkeypatch):
        self.calls = collections.Counter()
        phase = threading.local()
        lock = threading.Lock()
        for name in NAMES:
            original = getattr(thread_comm.ThreadComm, name)

            def counted(comm, *args, _original=original, **kwargs):
                with lock:
                    self.calls[(comm.rank, getattr(phase, "name", "other"))] += 1
                return _original(comm, *args, **kwargs)

            monkeypatch.setattr(thread_comm.ThreadComm, name, counted)
        for name, label in (("pull_start", "pull"), ("push_start", "push")):
            original = getattr(executor.Executor, name)

            def in_phase(*args, _original=original, _label=label, **kwargs):
                phase.name = _label
                try:
                    return _original(*args, **kwargs)
                finally:
                    phase.name = "other"

            monkeypatch.setattr(executor.Executor, name, in_phase)


def _both_ways(comm=None):
    """Every case alone, then all cases as one coalesced bucket; returns both output lists
    (``comm``: a simulated rank's, else the torch.distributed one)."""
    from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm

    comm = comm if comm is not None else ProcessGroupComm()
    rank, world = comm.rank, comm.world_size
    plans, sources = [], []
    for src, dst in CASES[world]:
        plans.append(solve(src, dst, itemsize=8))
        sources.append(local_shards(src, _value(src.shape)).get(rank))
    alone = [execute(p, s, comm, dtype=torch.float64) for p, s in zip(plans, sources)]
    together = execute_coalesced(plans, sources, comm, dtype=torch.float64)
    return alone, together


def _check(per_rank):
    for alone, together in per_rank:
        for a, b in zip(alone, together):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)


def test_coalesced_plans_equal_plans_alone_on_simulated_ranks():
    _check(run_threads(_both_ways, 4))


def test_coalesced_plans_equal_plans_alone_on_gloo():
    _check(launch(_both_ways, 4, timeout=120))


def test_an_iteration_pulls_and_pushes_once_per_layer(monkeypatch):
    torch.manual_seed(0)
    layers = 4
    model = Llama(LlamaConfig(layers=layers, kv_heads=2))
    ids = torch.randint(0, 256, (2, 16))
    counter = CallCounter(monkeypatch)
    strategies = ["tp2 + 2x tp1", "4x tp1", "tp2,pp2", "2x cp2"]
    results, calls = {}, {}
    for coalesce in (False, True):
        compiled = hgraph.compile(model, strategies, example_inputs=ids,
                                  options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(coalesce=coalesce)))
        for s in compiled.strategies:
            counter.calls.clear()
            results[(coalesce, str(s))] = compiled.simulate(s, ids)
            calls[(coalesce, str(s))] = dict(counter.calls)
    params = len(list(model.parameters()))  # 9 per layer + embedding, final norm, head
    buckets = layers + 3
    for s in map(str, compiled.strategies):
        for rank in range(4):
            one_by_one = calls[(False, s)].get((rank, "pull"), 0) + calls[(False, s)].get((rank, "push"), 0)
            together = calls[(True, s)].get((rank, "pull"), 0) + calls[(True, s)].get((rank, "push"), 0)
            assert together <= 2 * buckets < one_by_one <= 2 * params, (s, rank, together, one_by_one)
            assert calls[(True, s)].get((rank, "other")) == calls[(False, s)].get((rank, "other"))
        (loss_a, grads_a), (loss_b, grads_b) = results[(False, s)], results[(True, s)]
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a), s


def _train(coalesce):
    torch.manual_seed(0)
    compiled = hgraph.compile(Llama(LlamaConfig(layers=2)), ["tp2", "2x tp1"],
                              example_inputs=torch.randint(0, 256, (1, 16)),
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(coalesce=coalesce)))
    trainer = Trainer(compiled, optimizer=AdamWConfig(lr=1e-3), run=RunConfig(micro_batch_tokens=64))
    g = torch.Generator().manual_seed(1)
    losses = [trainer.step([torch.randint(0, 256, (n,), generator=g) for n in (9, 30, 17)], strategy=i % 2)
              for i in range(2)]
    return losses, trainer.full_parameters()


@pytest.mark.slow  # the plan-level gloo test above covers coalesced calls on gloo in the default run
def test_coalesced_training_on_gloo_matches_uncoalesced():
    (ref_losses, ref_params), _ = launch(_train, 2, args=(False,), timeout=120)
    for losses, params in launch(_train, 2, args=(True,), timeout=120):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7)
