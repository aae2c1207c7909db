"""HuggingFace transformers' LlamaForCausalLM (small random config, no download) under hgraph.

    python examples/hf_llama.py

Compiles the unmodified HF model for three strategies, checks on simulated ranks that each gives
the eager model's loss and gradients, then trains a few steps on 2 local gloo ranks.
"""

from __future__ import annotations

import torch

import hgraph
from hgraph.models import tiny_hf_llama
from hgraph.core.batch import next_token_targets

STRATEGIES = ["tp2", "2x tp1", "tp1,pp2"]


def check_against_eager() -> None:
    model = tiny_hf_llama(seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=ids)
    logits = model(ids).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    ref.backward()
    for s in compiled.strategies:
        loss, grads = compiled.simulate(s, ids)
        worst = max(float((grads[n] - p.grad).abs().max()) for n, p in model.named_parameters())
        print(f"{str(s):14} loss {float(loss):.6f} (eager {float(ref):.6f}), largest gradient difference {worst:.1e}")


def train(steps: int) -> list[float]:
    """Runs on each of the 2 ranks."""
    model = tiny_hf_llama(seed=0)
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=torch.randint(0, 256, (1, 16)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=3e-3))
    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(steps):
        batch = [torch.randint(0, model.config.vocab_size, (int(n),), generator=g) for n in (12, 30, 7, 19)]
        losses.append(trainer.step(batch, strategy=i % len(STRATEGIES)))
    return losses


if __name__ == "__main__":
    check_against_eager()
    losses = hgraph.launch(train, 2, args=(3,), timeout=300)[0]
    print("training losses on 2 ranks, switching strategy every step:", [round(x, 4) for x in losses])
