"""Trainer features against the unmodified model: gradient clipping equals
``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.AdamW``, and planned iterations
(``Trainer(planner=...)``: the planner picks strategy, dispatch and packing) equal single-process AdamW."""

import torch

from adamw_oracle import single_process_adamw
import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.planner.assign import Planner
from hgraph.planner.cost import CostModel
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig, RunConfig

OPT = dict(lr=2e-4, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)


def make_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=2, kv_heads=4))


def make_batches(iterations, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, 256, (int(n),), generator=g) for n in torch.randint(3, 40, (6,), generator=g)]
        for _ in range(iterations)
    ]


def reference(batches, grad_clip=None):
    """Single-process AdamW on the unmodified model; returns losses, norms before clipping, params."""
    ref = single_process_adamw(make_model(), batches, grad_clip=grad_clip, **OPT)
    return ref.losses, ref.norms, ref.params


def check_params(got, want):
    for it, (g, w) in enumerate(zip(got, want)):
        for name, value in w.items():
            torch.testing.assert_close(g[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"iter {it} {name}: {m}")


def test_grad_clip_equals_clip_grad_norm_on_the_unmodified_model():
    batches = make_batches(3)
    clip = 0.5
    ref_losses, ref_norms, ref_params = reference(batches, grad_clip=clip)
    assert all(n > 2 * clip for n in ref_norms)  # clipping is active in every iteration
    compiled = hgraph.compile(make_model(), ["tp2", "2x tp1"], example_inputs=torch.randint(0, 256, (1, 16)))

    def body(comm):
        trainer = Trainer(compiled, comm=comm, optimizer=AdamWConfig(grad_clip=clip, **OPT),
                          run=RunConfig(micro_batch_tokens=64))
        losses, params = [], []
        for i, batch in enumerate(batches):
            losses.append(trainer.step(batch, strategy=i % 2))
            params.append(trainer.full_parameters())
        return losses, [h["grad_norm"] for h in trainer.history], params

    for losses, norms, params in run_threads(body, 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        check_params(params, ref_params)


def tiny_cost_model():
    """Made-up ``T(l) = a·l² + b·l + c`` per stage, such that medium sequences favour the pp2 pipeline
    (many micro-batches), one long sequence favours tp2: the planner must switch strategies."""
    schemes = [dict(tp=1, pp=1, a=2e-2, b=0.1, c=1.0), dict(tp=2, pp=1, a=1e-3, b=0.3, c=1.0),
               dict(tp=1, pp=2, a=5e-3, b=0.05, c=0.5)]
    return CostModel.from_table({
        "strategies": schemes,
        "memory_regression": {"A": {"tp1": 1, "tp2": 1}, "B": 1, "alpha": 0.75, "gap": {"node": 0}, "safe_bound": 0},
        "model_config": {"H": 64, "L": 2, "V": 256},
        "cluster_config": {"gpus_per_node": 8, "gpu_memory_bound": 1e15},
    }, name="tiny")


def test_planned_iterations_equal_single_process_adamw():
    g = torch.Generator().manual_seed(5)
    lengths = [[20, 18, 22, 19, 21, 20], [39, 3, 3, 4], [25, 30, 5, 8, 12, 3], [38, 2, 3]]
    batches = [[torch.randint(0, 256, (n,), generator=g) for n in batch] for batch in lengths]
    ref_losses, _, ref_params = reference(batches)
    compiled = hgraph.compile(make_model(), ["2x tp1", "tp2", "tp1,pp2"], example_inputs=torch.randint(0, 256, (1, 16)))
    planner = Planner(tiny_cost_model(), compiled.strategies, comm=None)

    def body(comm):
        trainer = Trainer(compiled, comm=comm, planner=planner, optimizer=AdamWConfig(**OPT))
        losses, params = [], []
        for batch in batches:
            losses.append(trainer.step(batch))
            params.append(trainer.full_parameters())
        return losses, trainer.history, params

    results = run_threads(body, 2)
    for losses, history, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        check_params(params, ref_params)
        assert all(h["predicted_ms"] is not None for h in history)  # the planner decided every iteration
    history = results[0][1]
    assert len({h["strategy"] for h in history}) > 1  # the planner switched strategies
    assert max(len(p) for h in history for p in h["dispatch"]) > 1  # and packed several micro-batches
