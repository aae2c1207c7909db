"""hgraph.runtime.clock: a measured interval covers the work the device did in it (not its launch),
and the Trainer's ``measured_ms`` ends after the optimizer's step. The oracle is a real delay of known
length planted in the work: ``time.sleep`` on CPU, ``torch.cuda._sleep`` (a kernel that spins) on CUDA."""

import time

import pytest
import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.clock import DeviceClock, wall_seconds
from hgraph.runtime.kernels.thread_comm import ThreadComm, ThreadWorld
from hgraph.training.configs import AdamWConfig, RunConfig
from hgraph.training.trainer import Trainer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_interval_covers_the_work_and_reads_as_wall_clock():
    clock = DeviceClock("cpu")
    before = time.time()
    start = clock.mark()
    time.sleep(0.05)
    end = clock.mark()
    after = time.time()
    assert 50.0 <= clock.elapsed_ms(start, end) <= 1e3 * (after - before) + 1.0
    assert before - 1e-3 <= clock.seconds(start) <= clock.seconds(end) <= after + 1e-3
    assert abs(wall_seconds() - time.time()) < 0.05


def _planted_optimizer_delay(trainer: Trainer, delay) -> None:
    """Run ``delay()`` after every optimizer step of ``trainer`` (the real step, then the delay)."""
    apply = trainer.optimizer.apply

    def slow_apply(*args, **kwargs):
        out = apply(*args, **kwargs)
        delay()
        return out

    trainer.optimizer.apply = slow_apply


def _tiny_trainer(device: str = "cpu") -> Trainer:
    torch.manual_seed(0)
    compiled = hgraph.compile(Llama(LlamaConfig(layers=1, kv_heads=4)), ["tp1"],
                              example_inputs=torch.randint(0, 256, (1, 16)))
    return Trainer(compiled, comm=ThreadComm(ThreadWorld(1), 0), optimizer=AdamWConfig(lr=1e-3),
                   run=RunConfig(device=torch.device(device)))


def test_measured_ms_includes_the_optimizer_step():
    trainer = _tiny_trainer()
    batch = [torch.randint(0, 256, (24,)), torch.randint(0, 256, (9,))]
    trainer.step(batch)
    plain = trainer.history[-1]
    _planted_optimizer_delay(trainer, lambda: time.sleep(0.3))
    trainer.step(batch)
    slow = trainer.history[-1]
    assert slow["optimizer_ms"] >= 300.0
    assert slow["measured_ms"] >= 300.0 + (slow["measured_ms"] - slow["optimizer_ms"])
    assert slow["measured_ms"] - plain["measured_ms"] > 250.0
    assert 1e3 * slow["seconds"] >= slow["measured_ms"]


@cuda
def test_cuda_interval_covers_the_kernels_not_their_launch():
    device = torch.device("cuda", 0)
    clock = DeviceClock(device)
    torch.cuda._sleep(1000)  # warm-up: load the kernel
    torch.cuda.synchronize(device)
    host = time.perf_counter()
    start = clock.mark()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on a ~2 GHz GPU
    end = clock.mark()
    launched_ms = 1e3 * (time.perf_counter() - host)
    device_ms = clock.elapsed_ms(start, end)  # waits for the kernel
    synced_ms = 1e3 * (time.perf_counter() - host)
    assert launched_ms < 0.5 * device_ms  # a host clock alone would have measured the launch
    assert 0.8 * synced_ms <= device_ms <= synced_ms + 1.0
    assert clock.seconds(start) <= clock.seconds(end) <= wall_seconds() + 1e-3


@cuda
def test_cuda_measured_ms_includes_the_optimizer_kernels():
    trainer = _tiny_trainer("cuda")
    batch = [torch.randint(0, 256, (24,)), torch.randint(0, 256, (9,))]
    trainer.step(batch)
    clock = DeviceClock("cuda")
    start = clock.mark()
    torch.cuda._sleep(200_000_000)
    spin_ms = clock.elapsed_ms(start, clock.mark())
    _planted_optimizer_delay(trainer, lambda: torch.cuda._sleep(200_000_000))  # queued, not waited for
    trainer.step(batch)
    slow = trainer.history[-1]
    assert slow["optimizer_ms"] >= 0.9 * spin_ms
    assert slow["measured_ms"] >= slow["optimizer_ms"]
