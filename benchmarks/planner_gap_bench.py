"""The planner's gap to the true optimum on small instances, the optimum found outside the planner.

For each random instance (1-3 pipelines with random ``T(l) = a·l² + b·l + c``, pp and MaxLen, or a
strategy of the A800 7B table; 3-8 sequences), the optimum comes from exhaustive search
(``planner_optimum.py``, which imports nothing from hgraph). Reported: the heuristic's gap to it
(``Planner.plan`` without a communication model), and whether the MILP of ``hgraph/planner/exact.py``
agrees with it. Prints one JSON object.

    python benchmarks/planner_gap_bench.py [--instances 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_optimum import optimum  # noqa: E402

from hgraph.planner.assign import Planner  # noqa: E402
from hgraph.planner.cost import CostModel  # noqa: E402
from hgraph.planner.exact import solve_joint  # noqa: E402

PRESET_STRATEGIES = ["tp2 + tp1,pp2", "2x tp1,pp2", "tp4 + 2x tp2", "tp4", "2x tp2", "tp1,pp4", "tp2,pp2 + tp2"]


def instance(rng: random.Random, model: CostModel) -> tuple[list[tuple], list[int], object]:
    """``(pipelines as (a, b, c, pp, max_len), lengths, planner)``: random costs or a 7B strategy."""
    n = rng.randint(3, 8)
    if rng.random() < 0.5:
        planner = Planner(model, [rng.choice(PRESET_STRATEGIES)], comm=None)
        costs = planner.pipeline_costs[0]
        longest = max(c.max_len for c in costs)
        lengths = [rng.randint(100, min(longest, 12_000)) for _ in range(n)]
    else:
        from hgraph.planner.timing import PipelineCost

        costs = [
            PipelineCost(rng.uniform(0, 2e-6), rng.uniform(0.01, 0.1), rng.uniform(5, 60),
                         rng.choice([1, 2, 4]), rng.choice([4096, 8192, 16384]))
            for _ in range(rng.randint(1, 3))
        ]
        lengths = [rng.randint(100, 4096) for _ in range(n)]
        planner = None
    return [(c.a, c.b, c.c, c.pp, c.max_len) for c in costs], lengths, (planner, costs)


def heuristic_ms(planner, costs, lengths: list[int]) -> float:
    if planner is None:
        from hgraph.planner.dispatch import Assigner

        _, times = Assigner(costs, lengths).run()
        return max(times)
    return planner.plan(lengths).predicted_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--milp-time-limit", type=float, default=20.0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    model = CostModel.preset("llama7b_a800")
    gaps, milp_agrees, milp_timeouts, worst = [], 0, 0, None
    t_oracle = t_heuristic = 0.0
    for k in range(args.instances):
        pipes, lengths, (planner, costs) = instance(rng, model)
        t0 = time.perf_counter()
        best = optimum(pipes, lengths)
        t1 = time.perf_counter()
        ours = heuristic_ms(planner, costs, lengths)
        t2 = time.perf_counter()
        t_oracle, t_heuristic = t_oracle + t1 - t0, t_heuristic + t2 - t1
        if not math.isfinite(best):
            continue
        if ours < best * (1 - 1e-9):
            raise SystemExit(f"instance {k}: the heuristic ({ours}) beat the exhaustive optimum ({best})")
        gap = max(0.0, ours / best - 1)  # clamp float noise below zero
        gaps.append(gap)
        if gap > 1e-9 and (worst is None or gap > worst["gap"]):
            worst = {"instance": k, "gap": gap, "lengths": lengths, "pipelines": pipes}
        try:
            _, milp = solve_joint(costs, lengths, time_limit=args.milp_time_limit)
            milp_agrees += abs(milp - best) <= 1e-6 * best
        except Exception:  # the MILP hit its time limit: counted, not compared
            milp_timeouts += 1
    print(json.dumps({
        "benchmark": "planner_gap",
        "oracle": "exhaustive search (benchmarks/planner_optimum.py)",
        "instances": len(gaps),
        "gap_max": max(gaps),
        "gap_mean": statistics.mean(gaps),
        "gap_median": statistics.median(gaps),
        "optimal": sum(g <= 1e-9 for g in gaps),
        "within_1pct": sum(g <= 0.01 for g in gaps),
        "within_2pct": sum(g <= 0.02 for g in gaps),
        "milp_equals_exhaustive": milp_agrees,
        "milp_time_limit_hits": milp_timeouts,
        "oracle_seconds": round(t_oracle, 2),
        "heuristic_seconds": round(t_heuristic, 2),
        "worst": worst,
    }, indent=1))


if __name__ == "__main__":
    main()
