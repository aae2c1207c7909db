"""One worker of the two-"node" torchrun test (``test_multinode.py``): joins the job torchrun describes,
compiles a Llama for strategies whose TP groups fit in a node of ``LOCAL_WORLD_SIZE`` ranks (with the
node's own compile cache, ``$HGRAPH_COMPILE_CACHE``), trains 3 iterations (one per strategy) and
writes what it saw to ``OUT/rank<RANK>.json`` (rank 0 also the parameters after every iteration)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.kernels.process_group_comm import local_device_index

STRATEGIES = ["2x tp2", "tp2 + 2x tp1", "tp2,pp2"]
OPT = dict(lr=2e-4, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)


def make_model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=2, kv_heads=4))


def make_batches(iterations: int = 3, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, (int(n),), generator=g) for n in torch.randint(3, 40, (6,), generator=g)]
            for _ in range(iterations)]


def main(out: Path) -> None:
    rank, world = hgraph.init_from_env("gloo")
    compiled = hgraph.compile(make_model(), STRATEGIES, example_inputs=torch.randint(0, 256, (1, 16)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(**OPT),
                             run=hgraph.RunConfig(micro_batch_tokens=64))
    losses, params = [], []
    for i, batch in enumerate(make_batches()):
        losses.append(trainer.step(batch, strategy=i))
        params.append(trainer.full_parameters())
    tp_groups = [list(compiled.program(i, rank).groups.get("tp", (rank,))) for i in range(len(STRATEGIES))]
    cache = os.environ["HGRAPH_COMPILE_CACHE"]
    seen = {
        "rank": rank, "world": world, "pid": os.getpid(),
        "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")},
        "device_index": local_device_index(rank),  # the GPU this rank would take under NCCL
        "tp_groups": tp_groups, "cache_dir": cache, "cache_hit": compiled.cache_hit,
        "cache_entries": sorted(p.name for p in Path(cache).glob("*.json")), "losses": losses,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save(params, out / "params.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
