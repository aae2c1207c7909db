"""Step time of a checkpointing iteration, synchronous vs asynchronous, side by side (JSON).

    python benchmarks/checkpoint_bench.py [--world-size 2] [--hidden 384] [--layers 6] [--rounds 4]

On local gloo ranks an ``hgraph.models.Llama`` trains (``2x tp1`` and ``tp2`` in turn) on random
sequences; its sharded checkpoint (fp32 master shards + Adam moments: 12 bytes per parameter over
all ranks) is written by ``hgraph.CheckpointManager`` into a temporary directory. Each round runs

    [sync save] step  step  step   [async save] step  step  step

where a checkpointing iteration is timed from the start of its ``trainer.step`` to the return of its
``save`` (synchronous: the files are written, checksummed, committed; asynchronous: the shards were
copied to host memory and the write continues in a background thread). The three iterations after
each save are timed too: after an asynchronous save they run while the write is in flight (on a
CPU-only machine the writer competes with training for the cores), and the round waits for the write
before the next synchronous save. Reported: medians over the rounds on rank 0, the overhead of each
kind of save over a plain step, ``sync_over_async`` (the ratio of the checkpointing iterations'
times), ``after_async_over_plain`` (what the write in flight costs the steps it overlaps) and how long
a write takes from snapshot to commit (``CheckpointManager.write_seconds``). Noisy machines: compare
within one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.checkpoint_manager import CheckpointManager

AFTER = 3  # plain iterations after each save


def batch(seed: int, vocab: int, tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], tokens
    while left > 16:
        n = int(torch.randint(16, min(512, left) + 1, (1,), generator=g))
        lengths.append(n)
        left -= n
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _rank(args: argparse.Namespace, directory: str) -> dict:
    config = LlamaConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.heads, ffn=4 * args.hidden)
    model = Llama(config, seed=0)
    strategies = ["2x tp1", "tp2"] if args.world_size == 2 else [f"{args.world_size}x tp1"]
    compiled = hgraph.compile(model, strategies, example_inputs=torch.randint(0, 8, (1, 16)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-4))
    manager = CheckpointManager(directory, keep=1)
    times: dict[str, list[float]] = {"plain": [], "sync_checkpoint": [], "async_checkpoint": [],
                                     "after_sync": [], "after_async": []}
    step = 0

    def timed(save: str = "") -> float:
        nonlocal step
        dist.barrier()
        start = time.perf_counter()
        trainer.step(batch(step, args.vocab, args.tokens), strategy=step % len(strategies))
        step += 1
        if save:
            manager.async_write = save == "async"
            manager.save(trainer)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        times["plain"].append(timed())
    times["plain"].clear()
    for _ in range(args.rounds):
        times["sync_checkpoint"].append(timed("sync"))
        times["after_sync"] += [timed() for _ in range(AFTER)]
        times["async_checkpoint"].append(timed("async"))
        times["after_async"] += [timed() for _ in range(AFTER)]
        manager.wait()
        times["plain"].append(timed())
    manager.close()
    size = sum(f.stat().st_size for f in Path(directory).rglob("*.pt"))
    params = sum(p.numel() for p in model.parameters())
    writes = manager.write_seconds  # alternating: synchronous, asynchronous (snapshot to commit)
    return {"times": times, "checkpoint_bytes": size, "parameters": params,
            "write_s": {"sync": writes[0::2], "async": writes[1::2]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per iteration")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hgraph-ckpt-bench-") as directory:
        out = hgraph.launch(_rank, args.world_size, args=(args, directory), timeout=args.timeout)[0]
    t = out["times"]
    med = {k: statistics.median(v) for k, v in t.items() if v}
    report = {
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "parameters": out["parameters"]},
        "world_size": args.world_size, "tokens_per_iteration": args.tokens, "rounds": args.rounds,
        "checkpoint_bytes": out["checkpoint_bytes"],
        "median_step_s": med,
        "sync_overhead_s": med["sync_checkpoint"] - med["plain"],
        "async_overhead_s": med["async_checkpoint"] - med["plain"],
        "sync_over_async": med["sync_checkpoint"] / med["async_checkpoint"],
        "after_async_over_plain": med["after_async"] / med["plain"],
        "median_write_s": {k: statistics.median(v) for k, v in out["write_s"].items()},
        "samples": {k: [round(x, 4) for x in v] for k, v in t.items()},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
