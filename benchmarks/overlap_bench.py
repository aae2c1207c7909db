"""Overlap scheduling benchmark (prints JSON).

1. Measured: 4 gloo ranks on this machine, a Llama (hidden 256, 4 layers), step time and exposed
   communication (``runtime.timeline.exposed_communication``: communication not overlapped by compute,
   max over ranks, mean over measured iterations; also split into pulls + pushes and activations,
   which include the pipeline bubble: waiting for the other stage's compute) with
   ``schedule="none"`` vs ``"overlap"`` for ``4x tp1`` (ZeRO pulls/pushes) and ``2x tp1,pp2``.
   Both schedules run in the same processes, one step each in turn, so load from other programs on
   the machine affects both alike; figures are medians over the measured iterations.
   ``losses_bit_identical``: both schedules' losses over the run are equal bit for bit.
2. Predicted: LLaMA-7B shapes on a simulated 64-GPU cluster (8 nodes x 8), strategy ``8x tp8``: pull and
   push times per layer from the LNK topology model (``ReshardPlan.predicted_time_s``) and compute
   time per layer from the planner's A800 cost table (``T(l)`` of ``tp8,pp1``); overlap hides layer
   ``k + 1``'s pull behind layer ``k``'s forward and layer ``k - 1``'s push behind layer ``k``'s backward.

Run: ``OMP_NUM_THREADS=1 python benchmarks/overlap_bench.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

import hgraph
from hgraph.core.layout import Layout
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.lnk import solve
from hgraph.lnk.topology import Topology
from hgraph.models import Llama, LlamaConfig
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import load_cost_model
from hgraph.runtime.timeline import exposed_communication
from hgraph.training.trainer import Trainer
from hgraph.core.zero import optimizer_layout
from hgraph.program.options import OverlapConfig
from hgraph.training.configs import AdamWConfig, RunConfig

STRATEGIES = ["4x tp1", "2x tp1,pp2"]
ITERATIONS = 6  # per strategy and schedule; the first is a warm-up
PULL_PUSH = ("pull_parameter", "push_gradient")


def measure() -> dict:
    """On every rank: both schedules, stepped alternately so machine noise hits both alike."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(hidden=256, layers=4, heads=8, kv_heads=8, vocab_size=4096, ffn=1024))
    example = torch.randint(0, 4096, (1, 16))
    trainers = {
        schedule: Trainer(
            hgraph.compile(model, STRATEGIES, example_inputs=example,
                           options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(
                               overlap=OverlapConfig() if schedule == "overlap" else None))),
            optimizer=AdamWConfig(lr=1e-4), run=RunConfig(micro_batch_tokens=256, timeline=True),
        )
        for schedule in ("none", "overlap")
    }
    g = torch.Generator().manual_seed(1)
    out: dict = {}
    for index, strategy in enumerate(STRATEGIES):
        for _ in range(ITERATIONS):
            batch = [torch.randint(0, 4096, (128,), generator=g) for _ in range(8)]
            for trainer in trainers.values():
                trainer.step(batch, strategy=index)
        for schedule, trainer in trainers.items():
            rows = trainer.history[-ITERATIONS + 1 :]
            its = [r["iteration"] for r in rows]
            events = trainer.gather_timeline()
            trainer.timeline.clear()
            if trainer.rank != 0:
                continue

            def worst(exposed: dict) -> float:  # slowest rank, median over iterations
                return statistics.median(max(exposed[r][i] for r in exposed) for i in its)

            out.setdefault(strategy, {})[schedule] = {
                "step_s": statistics.median(r["seconds"] for r in rows),
                "exposed_comm_s": worst(exposed_communication(events)),
                "exposed_pull_push_s": worst(exposed_communication(events, PULL_PUSH)),
                "exposed_activation_s": worst(exposed_communication(events, ("communicate_activation",))),
                "losses": [r["loss"] for r in trainer.history[-ITERATIONS:]],
            }
    return out


def predicted_64_gpus(tokens_per_micro_batch: int = 16384, micro_batches: int = 4) -> dict:
    topo = Topology(ranks_per_node=8)
    world = tuple(range(64))
    h, f, layers = 4096, 11008, 32
    shapes = {
        "q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "gate": (f, h), "up": (f, h), "down": (h, f),
        "norm1": (h,), "norm2": (h,),
    }
    pull = push = 0.0
    for name, shape in shapes.items():
        dim = 1 if name == "o" or name == "down" else 0
        tp = Shard(dim) if len(shape) > 1 else Replicate()
        compute = Layout(shape, world, (8, 8), (Replicate(), tp))
        grad = Layout(shape, world, (8, 8), (Partial(), tp))  # summed over the 8 data-parallel pipelines
        zero = optimizer_layout(shape, 64)
        pull += solve(zero, compute, itemsize=2, topology=topo).predicted_time_s(topo)
        push += solve(grad, zero, itemsize=2, topology=topo).predicted_time_s(topo)
    cost = load_cost_model("llama7b_a800").stage_cost(Degrees(tp=8, pp=1, cp=1))
    t_mb = cost.seq_time(tokens_per_micro_batch) / 1e3  # forward + backward of one micro-batch, s
    fwd_layer, bwd_layer = t_mb / 3 / layers, 2 * t_mb / 3 / layers
    compute_total = micro_batches * t_mb
    none = layers * (pull + push) + compute_total
    exposed_pull = pull + (layers - 1) * max(0.0, pull - fwd_layer)
    exposed_push = push + (layers - 1) * max(0.0, push - bwd_layer)
    overlap = compute_total + exposed_pull + exposed_push
    return {
        "strategy": "8x tp8 (LLaMA-7B, 64 GPUs, 8 per node)",
        "pull_per_layer_s": pull, "push_per_layer_s": push, "compute_per_iteration_s": compute_total,
        "iteration_none_s": none, "iteration_overlap_s": overlap,
        "exposed_comm_none_s": layers * (pull + push), "exposed_comm_overlap_s": exposed_pull + exposed_push,
        "predicted_speedup": none / overlap,
    }


def main() -> None:
    measured = hgraph.launch(measure, 4, timeout=600)[0]
    for rows in measured.values():
        none, overlap = rows["none"], rows["overlap"]
        rows["exposed_reduction"] = 1 - overlap["exposed_comm_s"] / max(none["exposed_comm_s"], 1e-12)
        pull_push = none["exposed_pull_push_s"], overlap["exposed_pull_push_s"]
        rows["exposed_pull_push_reduction"] = 1 - pull_push[1] / max(pull_push[0], 1e-12)
        rows["step_speedup"] = none["step_s"] / overlap["step_s"]
        rows["losses_bit_identical"] = none.pop("losses") == overlap.pop("losses")  # same batches, same steps
    result = {"measured_gloo_4_ranks": measured, "predicted_64_gpus": predicted_64_gpus()}
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
