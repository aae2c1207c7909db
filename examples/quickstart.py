"""The README's quickstart: compile a model for three strategies and let the planner choose one per batch.

    python examples/quickstart.py        # 4 local gloo ranks; profiles this machine once (cached)
"""

import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.profiling.profile import profile_cost_model

STRATEGIES = ["tp2 + 2x tp1", "4x tp1", "tp2,pp2"]


def make_model():  # any nn.Module that returns logits; HF causal LMs too
    return Llama(LlamaConfig(layers=4), seed=0)


def sequence(n, g):  # a learnable sequence of n tokens: an arithmetic progression mod the vocabulary
    start, step = torch.randint(0, 256, (2,), generator=g).tolist()
    return (start + (1 + step % 7) * torch.arange(n)) % 256


def train(cost_model, steps=8):  # runs on every rank
    compiled = hgraph.compile(make_model(), STRATEGIES, example_inputs=torch.randint(0, 256, (1, 16)))
    planner = hgraph.planner.Planner(cost_model, compiled.strategies)  # strategy, dispatch and packing per batch
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=3e-3, grad_clip=1.0), planner=planner)
    g = torch.Generator().manual_seed(0)  # the same global batch on every rank
    for step in range(steps):
        lengths = torch.randint(8, 512, (6,), generator=g).tolist()
        loss = trainer.step([sequence(n, g) for n in lengths])
        if trainer.rank == 0:
            print(f"step {step} loss {loss:.4f} lengths {lengths} strategy {trainer.history[-1]['strategy']}")
    return trainer.state_dict()  # the unmodified model's names, full tensors


if __name__ == "__main__":
    # T(l) of each pipeline shape measured on 4 local ranks (once; cached in ~/.cache/hgraph)
    cost = profile_cost_model(make_model, 4, ["tp1", "tp2", "tp2,pp2"], [64, 128, 256, 512])
    state = hgraph.launch(train, 4, args=(cost,))[0]
    print(f"trained {len(state)} tensors")
