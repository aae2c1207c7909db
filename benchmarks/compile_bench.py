"""Compile time of ``hgraph.compile`` vs model depth and number of strategies (prints JSON).

    python benchmarks/compile_bench.py [--quick] [--worlds 8,64,1024] [--world-layers 8] [--deep 32]
    python benchmarks/compile_bench.py --only-worlds --baseline /tmp/old-checkout   # before/after
    python benchmarks/compile_bench.py --cache --baseline /tmp/old-checkout --worlds 1024 --deep 0

World sweep: an 8-layer Llama with 4 strategies (all tp1; tp2; tp4; tp4,pp2 pipelines) at world
sizes 8..4,096: one rank's work (``compile(rank=0)``, then rank 0's program of each strategy), wall
and CPU seconds; ``--deep`` adds a row with that many layers at world 1,024. ``--baseline DIR``
runs each world in fresh processes alternately with the checkout in DIR (its own
``benchmarks/compile_bench.py``, on ``PYTHONPATH=DIR``) and with this one, so both see the same load.
``--cache`` (with ``--baseline``): each row with an empty compile cache (a miss, which writes the
entry) and then again (a hit), before and after alternately, each checkout with its own cache.
Depth sweep: the hand-written Llama with 2..32 layers, compiled for 4 strategies on 8 ranks.
Strategy sweep: 4 layers, 1..8 strategies on 8 ranks. Reports seconds and seconds per layer /
per strategy, so linear growth shows as a flat per-unit column.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.program.options import OverlapConfig

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
    """Seconds (wall and CPU) to compile ``rank``'s part for ``world`` ranks, its program of every
    strategy included (``schedule="overlap"``: the dry run only where ``compile`` verifies)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=layers, hidden=64, heads=8, kv_heads=8, ffn=128))
    ids = torch.randint(0, 256, (1, 16))
    start, cpu = time.perf_counter(), time.process_time()
    compiled = hgraph.compile(model, world_strategies(world), example_inputs=ids,
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(
                                  overlap=OverlapConfig() if schedule == "overlap" else None),
                                                            build=hgraph.BuildConfig(rank=rank)))
    return {"world": world, "layers": layers, "rank": rank, "schedule": schedule,
            "seconds": round(time.perf_counter() - start, 3), "cpu_seconds": round(time.process_time() - cpu, 3),
            "cache_hit": compiled.cache_hit}


_ROW = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import compile_bench as bench
bench.timed_compile(2, bench.STRATEGIES[:1])
cpu = time.process_time()
row = bench.timed_world(int(sys.argv[2]), int(sys.argv[3]), 0, sys.argv[4])
row["cpu_seconds"] = round(time.process_time() - cpu, 3)
print(json.dumps(row))
"""


def _one_world(checkout: str, world: int, layers: int, schedule: str, cache: str = "") -> dict:
    """One world-sweep row of ``checkout``'s ``timed_world`` in a fresh process (after its warm-up),
    with ``cache`` as ``$HGRAPH_COMPILE_CACHE`` when given."""
    env = dict(os.environ, PYTHONPATH=checkout)
    env.pop("HGRAPH_COMPILE_CACHE", None)
    if cache:
        env["HGRAPH_COMPILE_CACHE"] = cache
    cmd = [sys.executable, "-c", _ROW, os.path.join(checkout, "benchmarks"), str(world), str(layers), schedule]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=checkout).stdout
    return json.loads(out.strip().splitlines()[-1])


def side_by_side(baseline: str, rows: list[tuple[int, int]], schedule: str) -> list[dict]:
    """Each (world, layers) row run with ``baseline`` then with this checkout, alternately."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = []
    for world, layers in rows:
        before = _one_world(baseline, world, layers, schedule)
        after = _one_world(here, world, layers, schedule)
        out.append({"world": world, "layers": layers, "seconds_before": before["seconds"],
                    "seconds_after": after["seconds"], "cpu_seconds_before": before["cpu_seconds"],
                    "cpu_seconds_after": after["cpu_seconds"],
                    "cpu_speedup": round(before["cpu_seconds"] / max(after["cpu_seconds"], 1e-9), 2)})
    return out


def _entry_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def cache_side_by_side(baseline: str, rows: list[tuple[int, int]], schedule: str) -> list[dict]:
    """Each row's compile with an empty cache (miss) and then again (hit), before and after alternately."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = []
    for world, layers in rows:
        with tempfile.TemporaryDirectory() as before_dir, tempfile.TemporaryDirectory() as after_dir:
            row: dict = {"world": world, "layers": layers}
            for phase in ("miss", "hit"):
                before = _one_world(baseline, world, layers, schedule, before_dir)
                after = _one_world(here, world, layers, schedule, after_dir)
                assert after["cache_hit"] == (phase == "hit"), after
                row[phase] = {"seconds_before": before["seconds"], "seconds_after": after["seconds"],
                              "cpu_seconds_before": before["cpu_seconds"], "cpu_seconds_after": after["cpu_seconds"],
                              "cpu_after_over_before": round(after["cpu_seconds"] / max(before["cpu_seconds"], 1e-9), 3)}
            row["entry_bytes_before"], row["entry_bytes_after"] = _entry_bytes(before_dir), _entry_bytes(after_dir)
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points (for CI smoke runs)")
    parser.add_argument("--worlds", default="", help="comma-separated world sizes (default 8..4096)")
    parser.add_argument("--world-layers", type=int, default=8, help="layers of the world-sweep model")
    parser.add_argument("--only-worlds", action="store_true", help="skip the depth and strategy sweeps")
    parser.add_argument("--schedule", default="none", choices=["none", "overlap"], help="world sweep's schedule")
    parser.add_argument("--deep", type=int, default=32, help="layers of an extra world-1,024 row (0: none)")
    parser.add_argument("--baseline", default="", help="another checkout to time side by side (world sweep)")
    parser.add_argument("--cache", action="store_true", help="with --baseline: compile-cache miss and hit times")
    args = parser.parse_args()
    default_worlds = "8,64,256" if args.quick else "8,16,64,256,1024,4096"
    worlds = [int(w) for w in (args.worlds or default_worlds).split(",")]
    rows = [(w, args.world_layers) for w in worlds] + ([(1024, args.deep)] if args.deep else [])
    if args.baseline and args.cache:
        print(json.dumps({"cache_side_by_side": cache_side_by_side(args.baseline, rows, args.schedule)}, indent=1))
        return
    if args.baseline:
        print(json.dumps({"side_by_side": side_by_side(args.baseline, rows, args.schedule)}, indent=1))
        return
    timed_compile(2, STRATEGIES[:1])  # warm-up: first torch.export in a process pays one-off costs
    by_world = [timed_world(w, layers, 0, args.schedule) for w, layers in rows]
    w64 = next((r["seconds"] for r in by_world if r["world"] == 64 and r["layers"] == args.world_layers), None)
    w1024 = next((r["seconds"] for r in by_world if r["world"] == 1024 and r["layers"] == args.world_layers), None)
    goals = {"world_1024_over_64": round(w1024 / w64, 2) if w64 and w1024 else None,
             "goal_world_1024_over_64": 2.0, "goal_deep_1024_seconds": 10.0}
    if args.only_worlds:
        print(json.dumps({"by_world": by_world, "goals": goals}, indent=1))
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
        "goals": goals,
        "by_layers": by_depth,
        "by_strategies": by_count,
        "growth_vs_linear_layers": round(growth_layers, 3),
        "growth_vs_linear_strategies": round(growth_strategies, 3),
        "note": "growth_vs_linear = (time ratio) / (size ratio); 1.0 is linear, < 1 sub-linear",
    }, indent=1))


if __name__ == "__main__":
    main()
