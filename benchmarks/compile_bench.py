"""Compile time of ``hgraph.compile`` vs model depth and number of strategies (prints JSON).

    python benchmarks/compile_bench.py [--quick] [--worlds 8,64,1024] [--world-layers 8]

World sweep: an 8-layer Llama with 4 strategies (all tp1; tp2; tp4; tp4,pp2 pipelines) at world
sizes 8..4,096 (the whole compile, then rank 0's program of each strategy). Depth sweep: the hand-written Llama with 2..32 layers, compiled for 4 strategies on 8 ranks.
Strategy sweep: 4 layers, 1..8 strategies on 8 ranks. Reports seconds and seconds per layer /
per strategy, so linear growth shows as a flat per-unit column.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hgraph
from hgraph.models import Llama, LlamaConfig

STRATEGIES = ["8x tp1", "4x tp2", "2x tp4", "tp8", "2x tp2,pp2", "tp4,pp2", "tp4 + 2x tp2", "tp2,pp2 + tp4"]


def timed_compile(layers: int, strategies: list[str]) -> dict:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=layers, hidden=64, heads=8, kv_heads=8, ffn=128))
    ids = torch.randint(0, 256, (1, 16))
    start = time.perf_counter()
    compiled = hgraph.compile(model, strategies, example_inputs=ids)
    total = time.perf_counter() - start
    passes: dict[str, float] = {}
    for record in compiled.pass_history:
        key = record.name.split("[")[0]
        passes[key] = passes.get(key, 0.0) + record.seconds
    passes["trace (torch.export)"] = total - sum(passes.values())
    return {"layers": layers, "strategies": len(strategies), "seconds": round(total, 3),
            "trace_and_passes": {k: round(v, 3) for k, v in passes.items()}}


def world_strategies(world: int) -> list[str]:
    """Four strategies covering ``world`` ranks (data-parallel pipelines of tp1, tp2, tp4, tp4+pp2)."""
    return [f"{world}x tp1", f"{world // 2}x tp2", f"{world // 4}x tp4", f"{world // 8}x tp4,pp2"]


def timed_world(world: int, layers: int, rank: int = 0, schedule: str = "none") -> dict:
    """Seconds to compile for ``world`` ranks and build ``rank``'s program of every strategy
    (``schedule="overlap"`` includes the compile-time dry run of every rank's schedule)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=layers, hidden=64, heads=8, kv_heads=8, ffn=128))
    ids = torch.randint(0, 256, (1, 16))
    start = time.perf_counter()
    compiled = hgraph.compile(model, world_strategies(world), example_inputs=ids, schedule=schedule)
    for i in range(len(compiled.strategies)):
        compiled.program(i, rank)
    return {"world": world, "layers": layers, "rank": rank, "schedule": schedule,
            "seconds": round(time.perf_counter() - start, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points (for CI smoke runs)")
    parser.add_argument("--worlds", default="", help="comma-separated world sizes (default 8..4096)")
    parser.add_argument("--world-layers", type=int, default=8, help="layers of the world-sweep model")
    parser.add_argument("--only-worlds", action="store_true", help="skip the depth and strategy sweeps")
    parser.add_argument("--schedule", default="none", choices=["none", "overlap"], help="world sweep's schedule")
    args = parser.parse_args()
    timed_compile(2, STRATEGIES[:1])  # warm-up: first torch.export in a process pays one-off costs
    default_worlds = "8,64,256" if args.quick else "8,16,64,256,1024,4096"
    worlds = [int(w) for w in (args.worlds or default_worlds).split(",")]
    by_world = [timed_world(w, args.world_layers, 0, args.schedule) for w in worlds]
    if args.only_worlds:
        print(json.dumps({"by_world": by_world}, indent=1))
        return
    depths = [2, 4, 8] if args.quick else [2, 4, 8, 16, 32]
    counts = [1, 2, 4] if args.quick else [1, 2, 4, 8]
    by_depth = [timed_compile(d, STRATEGIES[:4]) for d in depths]
    for row in by_depth:
        row["seconds_per_layer"] = round(row["seconds"] / row["layers"], 4)
    by_count = [timed_compile(4, STRATEGIES[:n]) for n in counts]
    for row in by_count:
        row["seconds_per_strategy"] = round(row["seconds"] / row["strategies"], 4)
    growth_layers = by_depth[-1]["seconds"] / by_depth[0]["seconds"] / (depths[-1] / depths[0])
    growth_strategies = by_count[-1]["seconds"] / by_count[0]["seconds"] / (counts[-1] / counts[0])
    print(json.dumps({
        "by_world": by_world,
        "by_layers": by_depth,
        "by_strategies": by_count,
        "growth_vs_linear_layers": round(growth_layers, 3),
        "growth_vs_linear_strategies": round(growth_strategies, 3),
        "note": "growth_vs_linear = (time ratio) / (size ratio); 1.0 is linear, < 1 sub-linear",
    }, indent=1))


if __name__ == "__main__":
    main()
