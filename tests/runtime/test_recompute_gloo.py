"""Recomputation on real gloo processes: training with ``recompute="full"`` (and selective on some
layers) learns exactly what single-process AdamW learns on the same batches."""

import torch

from adamw_oracle import single_process_adamw
import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.passes.recompute import RecomputeConfig
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig, RunConfig

OPT = dict(lr=2e-4, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)
STRATEGIES = ["tp2", "tp1,pp2", "2x tp1"]


def make_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=2, kv_heads=2))


def make_batches(iterations):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, 256, (int(n),), generator=g) for n in torch.randint(3, 40, (5,), generator=g)]
            for _ in range(iterations)]


def reference_run(batches):
    ref = single_process_adamw(make_model(), batches, **OPT)
    return ref.losses, ref.params


def recompute_run(configs, iterations):
    """Runs on every rank (module level so spawned processes can import it): one training per config."""
    results = []
    for recompute in configs:
        compiled = hgraph.compile(make_model(), STRATEGIES, example_inputs=torch.randint(0, 256, (1, 16)),
                                  options=hgraph.CompileOptions(recompute=hgraph.RecomputeConfig.of(recompute)))
        trainer = Trainer(compiled, optimizer=AdamWConfig(**OPT), run=RunConfig(micro_batch_tokens=64))
        losses, params = [], []
        for i, batch in enumerate(make_batches(iterations)):
            losses.append(trainer.step(batch, strategy=i % len(STRATEGIES)))
            params.append(trainer.full_parameters())
        results.append((losses, params))
    return results


def test_full_and_selective_recompute_on_real_gloo_processes():
    iterations = len(STRATEGIES)
    ref_losses, ref_params = reference_run(make_batches(iterations))
    configs = ["full", RecomputeConfig("selective", layers={1})]
    for per_config in hgraph.launch(recompute_run, 2, args=(configs, iterations), timeout=300):
        for losses, params in per_config:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            for got, want in zip(params, ref_params):
                for name, value in want.items():
                    torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
