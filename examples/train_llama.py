"""Train the hand-written Llama-style model with hgraph, switching strategies every iteration.

    python examples/train_llama.py                 # spawns 4 local gloo ranks itself
    torchrun --nproc-per-node 4 examples/train_llama.py   # one process per rank (NCCL on GPUs)

Every rank builds the same model (same seed), compiles it for a few strategies, and trains on the
same synthetic batches; each iteration runs on the next strategy in the list.
"""

from __future__ import annotations

import argparse
import os

import torch

import hgraph
from hgraph.models import Llama, LlamaConfig

STRATEGIES = ["tp2 + 2x tp1", "4x tp1", "tp2,pp2", "2x tp1,pp2", "tp4"]


def batches(iterations: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(iterations):
        lengths = torch.randint(8, 64, (8,), generator=g)
        out.append([torch.randint(0, 256, (int(n),), generator=g) for n in lengths])
    return out


def train(iterations: int = 5, strategies: tuple[str, ...] = tuple(STRATEGIES)) -> list[float]:
    """Runs on every rank; returns the losses."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=2, kv_heads=4))  # tp4 needs 4 key/value heads
    compiled = hgraph.compile(model, list(strategies), example_inputs=torch.randint(0, 256, (1, 16)))
    trainer = hgraph.Trainer(compiled, lr=3e-3, weight_decay=0.01, grad_clip=1.0)
    losses = []
    for i, batch in enumerate(batches(iterations)):
        loss = trainer.step(batch, strategy=i % len(compiled.strategies))
        losses.append(loss)
        if trainer.rank == 0:
            print(f"iter {i} loss {loss:.4f} strategy {compiled.strategies[i % len(compiled.strategies)]}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4, help="local ranks to spawn (ignored under torchrun)")
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, help="e.g. 'tp2' '2x tp1'")
    args = parser.parse_args()
    strategies = tuple(args.strategies)
    if "RANK" in os.environ:  # started by torchrun
        hgraph.init_from_env()  # NCCL when CUDA is available, else gloo
        train(args.iterations, strategies)
    else:
        hgraph.launch(train, args.world_size, args=(args.iterations, strategies), timeout=600)


if __name__ == "__main__":
    main()
