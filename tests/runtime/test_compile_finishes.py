"""Compile finishes at compile: after ``hgraph.compile`` returns, every compiled rank's program exists
(overlap graph included), so a training step makes no compiler call; and profiling runs the very
action list a training step runs (overlap included)."""

import collections

import pytest
import torch

import hgraph
import hgraph.compiler.build as build_module
from hgraph.compiler.build import Builder
from hgraph.core.batch import local_micro_batches, micro_batch_align, pack_micro_batch
from hgraph.models import Llama, LlamaConfig
from hgraph.passes.pipeline import PassManager
from hgraph.profiling.profile_ranks import compute_ms
from hgraph.runtime.executor import Executor
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.training.trainer import Trainer
from hgraph.program.options import OverlapConfig
from hgraph.training.configs import RunConfig

# what building calls: every step of the Builder, the functions the build step runs, the pass manager
BUILD_FUNCTIONS = ["build", "plan_parameters", "plan_inputs", "parameter_layouts", "optimizer_layouts", "overlap_order",
                   "overlap_graph", "partition", "activation_subgraphs", "parameter_specs"]


def make_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=2, kv_heads=4))


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in (9, 14, 10, 11)]


def count_compiler_calls(monkeypatch) -> collections.Counter:
    calls: collections.Counter = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in list(vars(Builder).items()):
        if callable(fn):
            monkeypatch.setattr(Builder, name, counted(f"Builder.{name}", fn))
    for name in BUILD_FUNCTIONS:
        monkeypatch.setattr(build_module, name, counted(name, getattr(build_module, name)))
    for name in ("run", "around"):
        monkeypatch.setattr(PassManager, name, counted(f"PassManager.{name}", getattr(PassManager, name)))
    return calls


@pytest.mark.parametrize("schedule", ["none", "overlap"])
def test_a_training_step_after_compile_makes_no_compiler_call(monkeypatch, schedule):
    compiled = hgraph.compile(make_model(), ["tp2", "tp1,pp2"], example_inputs=torch.randint(0, 256, (1, 16)),
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig() if schedule == "overlap" else None)))
    calls = count_compiler_calls(monkeypatch)
    for index in range(2):
        for rank in range(2):
            program = compiled.program(index, rank)  # a lookup: built at compile
            assert (program.overlap_graph is not None) == (schedule == "overlap")

    def train(comm):
        trainer = Trainer(compiled, comm=comm, run=RunConfig(micro_batch_tokens=16))
        return [trainer.step(batch(seed), strategy=seed % 2) for seed in range(3)]

    losses = run_threads(train, 2)
    assert losses[0] == losses[1]
    assert calls == collections.Counter(), f"compiler calls during training: {dict(calls)}"
    # the counters count: a compile for rank 0 alone (no dry run over every rank) builds rank 1's program
    # on first use
    mine = hgraph.compile(make_model(), ["tp2"], example_inputs=torch.randint(0, 256, (1, 16)),
                          options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig() if schedule == "overlap" else None),
                                                        build=hgraph.BuildConfig(rank=0, verify=False)))
    assert calls["Builder.program"] == 1  # rank 0's, at compile
    mine.program(0, 1)
    assert calls["Builder.program"] == 2


def test_profiling_runs_the_action_list_training_runs(monkeypatch):
    compiled = hgraph.compile(make_model(), ["tp1,pp2"], example_inputs=torch.randint(0, 256, (1, 16)),
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig())))
    ran = collections.defaultdict(list)  # rank -> the action lists the executor ran, in order
    original = Executor.run

    def recording(self, actions, on_step=None):
        ran[self.program.rank].append(list(actions))
        return original(self, actions, on_step)

    monkeypatch.setattr(Executor, "run", recording)

    def body(comm):
        trainer = Trainer(compiled, comm=comm, run=RunConfig(micro_batch_tokens=16))
        sequences = batch()
        trainer.step(sequences)  # one micro-batch per sequence: the four do not pack into 16 tokens
        program = compiled.program(0, comm.rank)
        buffers = {ph: compiled.traced.buffers()[fqn] for ph, fqn in compiled.traced.buffer_names.items()}
        mbs = [local_micro_batches([pack_micro_batch([s], micro_batch_align(program.groups))], program.groups,
                                   comm.rank, buffers)[0] for s in sequences]
        ms = compute_ms(program, trainer.optimizer.shards, mbs, comm)
        return ms, len(trainer.history[0]["dispatch"][0])

    results = run_threads(body, 2)
    for rank, (ms, micro_batches) in enumerate(results):
        assert micro_batches == len(batch()) and len(ms) == micro_batches
        training, profiling = ran[rank]
        assert profiling == training == compiled.program(0, rank).actions(micro_batches)
        assert any(a.at is not None for a in profiling)  # the overlap lowering: pulls attached at first use
