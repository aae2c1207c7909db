"""Training equivalence: hgraph.Trainer, switching strategy every iteration, learns exactly what a
single-process AdamW run learns on the same global batches (threads, real gloo processes, torchrun)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adamw_oracle import assert_matches_reference, single_process_adamw
import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.core.batch import pack_micro_batch
from hgraph.training.trainer import Trainer, default_dispatch
from hgraph.training.configs import AdamWConfig, RunConfig

ROOT = Path(__file__).resolve().parents[2]
WORLD4 = ["tp4", "2x tp2", "tp2 + 2x tp1", "tp2,pp2", "2x tp1,pp2", "2x cp2"]
WORLD2 = ["tp2", "2x tp1", "tp1,pp2", "cp2"]
# Adam divides by sqrt(v) + eps, which magnifies the last-bit differences of near-zero gradients
# (other summation order under TP); a modest lr keeps that far below the 1e-6 tolerance.
OPT = dict(lr=2e-4, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)


def make_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=2, kv_heads=4))


def make_batches(iterations, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, 256, (int(n),), generator=g) for n in torch.randint(3, 40, (6,), generator=g)]
        for _ in range(iterations)
    ]


def reference_run(batches):
    ref = single_process_adamw(make_model(), batches, **OPT)
    return ref.losses, ref.params


def hgraph_run(strategies, iterations, comm=None, micro_batch_tokens=64):
    """Runs on every rank (module level so spawned processes can import it)."""
    model = make_model()
    compiled = hgraph.compile(model, strategies, example_inputs=torch.randint(0, 256, (1, 16)))
    trainer = Trainer(compiled, comm=comm, optimizer=AdamWConfig(**OPT),
                      run=RunConfig(micro_batch_tokens=micro_batch_tokens))
    losses, params = [], []
    for i, batch in enumerate(make_batches(iterations)):
        losses.append(trainer.step(batch, strategy=i % len(strategies)))
        params.append(trainer.full_parameters())
    return losses, params


check = assert_matches_reference


def test_simulated_ranks_switching_every_iteration():
    iterations = len(WORLD4)
    results = run_threads(lambda comm: hgraph_run(WORLD4, iterations, comm), 4)
    reference = reference_run(make_batches(iterations))
    for r in results:
        check(r, reference)


def test_real_gloo_processes_world_4():
    iterations = len(WORLD4)
    results = hgraph.launch(hgraph_run, 4, args=(WORLD4, iterations), timeout=300)
    reference = reference_run(make_batches(iterations))
    for r in results:
        check(r, reference)


def test_real_gloo_processes_world_2():
    results = hgraph.launch(hgraph_run, 2, args=(WORLD2, 4), timeout=300)
    reference = reference_run(make_batches(4))
    check(results[0], reference)
    check(results[1], reference)


def test_packing_does_not_change_the_result():
    """Sequences packed into one micro-batch give the same loss and update as one per micro-batch."""
    packed = run_threads(lambda comm: hgraph_run(["2x tp1"], 2, comm, micro_batch_tokens=10_000), 2)
    single = run_threads(lambda comm: hgraph_run(["2x tp1"], 2, comm, micro_batch_tokens=1), 2)
    check(packed[0], (single[0][0], single[0][1]))


def test_pack_micro_batch_layout():
    mb = pack_micro_batch([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], align=4)
    assert mb["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert mb["targets"].tolist() == [[6, 7, -100, 9, -100, -100, -100, -100]]


def test_default_dispatch_places_every_sequence_once():
    strategy = hgraph.Strategy.parse("tp2,pp2 + 2x tp1")
    lengths = [50, 3, 20, 20, 7, 9, 31, 2]
    plan = default_dispatch(strategy.pipelines, lengths, micro_batch_tokens=40)
    placed = sorted(i for mbs in plan for mb in mbs for i in mb)
    assert placed == list(range(len(lengths)))
    for mbs in plan:
        for mb in mbs:
            assert len(mb) == 1 or sum(lengths[i] for i in mb) <= 40


def test_bad_batches_are_rejected():
    model = make_model()
    compiled = hgraph.compile(model, ["tp1"], example_inputs=torch.randint(0, 256, (1, 8)))

    def body(comm):
        trainer = Trainer(compiled, comm=comm)
        errors = []
        for batch in ([], [torch.tensor([1])], [torch.ones(3)]):
            try:
                trainer.step(batch)
            except hgraph.errors.InputError as exc:
                errors.append(str(exc))
        return errors

    errors = run_threads(body, 1)[0]
    assert len(errors) == 3 and "empty batch" in errors[0] and "at least 2" in errors[1] and "LongTensor" in errors[2]


def test_torchrun_path():
    """examples/train_llama.py under torchrun (2 processes, tp2 then 2x tp1): the losses it prints are
    single-process AdamW's on the same model and batches (printed to 4 decimals)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    strategies = ["tp2", "2x tp1"]
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "train_llama.py"), "--iterations", "2", "--strategies", *strategies],
        capture_output=True, text=True, timeout=180, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = re.findall(r"^iter (\d+) loss ([0-9.]+) strategy (.+)$", proc.stdout, re.M)
    assert [(int(i), s) for i, _, s in printed] == [(i, str(hgraph.Strategy.parse(s))) for i, s in enumerate(strategies)]
    example = _example("train_llama")
    torch.manual_seed(0)
    model = example.Llama(example.LlamaConfig(layers=2, kv_heads=4))
    want = single_process_adamw(model, example.batches(2), grad_clip=1.0, lr=3e-3, weight_decay=0.01).losses
    assert [float(x) for _, x, _ in printed] == pytest.approx(want, abs=1.5e-4)


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
