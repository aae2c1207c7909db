"""The planner's gain over the best homogeneous strategy, measured interleaved (prints JSON).

    OMP_NUM_THREADS=1 python benchmarks/planner_gain_bench.py [--repeats 3] [--batches 8] [--regimes ...]

Three regimes, each with and without a background load (one busy process started by the benchmark,
half of a 2-core machine):

* ``uniform``: every sequence the same length (2 ranks): no heterogeneity to exploit;
* ``demo_corpus``: the demo's batches (the standard library, cut at 2,048 tokens; 2 ranks);
* ``memory_binds``: the standard library cut at ``--binding-max-len`` (2,048) tokens on 4 ranks, with a
  per-rank memory budget under which documents of ``--binding-len`` (2,048) tokens do not fit a
  ``tp1`` pipeline (a ``tp2`` one takes them) (``hgraph.planner.memory.budget_below``), so the best homogeneous strategy is the
  best one that takes every document.

Per regime and load: ``T(l)`` profiled on the ranks (cached, ``hgraph profile``), candidates proposed
from the batches' lengths under the budget (``hgraph.planner.propose``) plus every homogeneous
strategy that takes every document, and the comparison of ``hgraph.cli.demo_compare`` (same
batches, same warm-up, arms interleaved in rotating blocks, repeated). Reported: the best
homogeneous strategy, the ratio (its step seconds / the planner's) median and range over
repetitions, what the planner used, and the planner's prediction fidelity (median relative error,
Spearman rank correlation, and the measured spread max/min over its iterations).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from background_load import background_load

from hgraph.cli.demo import DemoConfig, corpus_loaders, factory_of, profiled_cost_table, with_iteration_terms
from hgraph.cli.demo_compare import CompareSpec, homogeneous_arms, probing_batches, rank_compare, ratios
from hgraph.core.degrees import Degrees
from hgraph.planner.settling import PROBE_ROUNDS
from hgraph.planner.cost import CostModel
from hgraph.planner.memory import budget_below
from hgraph.planner.proposal import propose
from hgraph.runtime.launch import launch

MOST_WARMUP = 2 + PROBE_ROUNDS * 6  # 6: the most homogeneous strategies of 4 ranks


def _corpus(cfg: DemoConfig, count: int) -> list[tuple[torch.Tensor, ...]]:
    train, _ = corpus_loaders(cfg)
    return [tuple(b) for b in train.first_batches(count)]


def _uniform(cfg: DemoConfig, count: int, length: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(cfg.seed)
    per = max(1, cfg.tokens_per_iteration // length)
    return [tuple(torch.randint(0, 512, (length,), generator=g) for _ in range(per)) for _ in range(count)]


def regime(name: str, args: argparse.Namespace) -> tuple[DemoConfig, list, float | None]:
    """The demo config, the batches (room for the longest warm-up first) and the memory budget of a regime."""
    n = args.batches + max(MOST_WARMUP, args.warmup or 0)
    if name == "uniform":
        cfg = DemoConfig(world_size=2, max_len=2048)
        return cfg, _uniform(cfg, n, args.uniform_len), None
    if name == "demo_corpus":
        cfg = DemoConfig(world_size=2, max_len=2048)
        return cfg, _corpus(cfg, n), None
    cfg = DemoConfig(world_size=4, max_len=args.binding_max_len)
    return cfg, _corpus(cfg, n), -1.0  # budget computed from the profiled table


def measure(name: str, args: argparse.Namespace, loaded: bool) -> dict:
    cfg, batches, budget = regime(name, args)
    lengths = [[len(s) for s in b] for b in batches]
    table = profiled_cost_table(cfg)
    cost_model = CostModel.from_table(table).with_world_size(cfg.world_size)
    if budget is not None:
        budget = budget_below(cost_model.memory, 1, 1, 1, cfg.world_size, args.binding_len)
        cost_model = cost_model.with_gpu_memory(budget)
    flat = [l for b in lengths for l in b]
    fitting = homogeneous_arms(cost_model, cfg.world_size, lengths, most=None)
    proposed = [str(s) for s in propose(cost_model, cfg.world_size, flat, cfg.max_len,
                                        tokens_per_iteration=cfg.tokens_per_iteration, max_candidates=6)]
    candidates = list(dict.fromkeys(proposed + fitting))  # every homogeneous strategy that fits is a candidate
    table = with_iteration_terms(cfg, table, candidates, lengths[:3])
    costed = CostModel.from_table(table).with_world_size(cfg.world_size)
    costed = costed if budget is None else costed.with_gpu_memory(budget)
    arms = homogeneous_arms(costed, cfg.world_size, lengths)
    # the warm-up covers the planner's probing (each homogeneous candidate measured PROBE_ROUNDS times)
    probing = probing_batches(costed, candidates)
    warmup = args.warmup if args.warmup is not None else 2 + probing
    spec = CompareSpec(model_factory=factory_of(cfg), candidates=tuple(candidates), homogeneous=tuple(arms),
                       cost_table=json.dumps(table), batches=tuple(batches[warmup:warmup + args.batches]),
                       warmup=tuple(batches[:warmup]), repeats=args.repeats, block=args.block,
                       oracle=tuple(c for c in candidates if c not in arms),
                       gpu_memory=budget)
    with background_load(loaded):
        start = time.perf_counter()
        result = launch(rank_compare, cfg.world_size, args=(spec,), timeout=args.timeout)[0]
        wall = time.perf_counter() - start
    out = ratios(result)
    longest = max(flat)
    return {"regime": name, "background_load": loaded, "world_size": cfg.world_size, "max_len": cfg.max_len,
            "longest": longest, "memory_budget_bytes": budget,
            "tp1_max_len": cost_model.max_len(Degrees(1, 1)), "candidates": candidates, "homogeneous": arms,
            "warmup": warmup, "probe_iterations": probing,
            "wall_s": wall, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", nargs="+", default=["uniform", "demo_corpus", "memory_binds"])
    parser.add_argument("--loads", nargs="+", default=["none", "busy"], choices=["none", "busy"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=8, help="measured batches per repetition")
    parser.add_argument("--warmup", type=int, default=None,
                        help="batches every arm trains first, not counted (default: 2 + the planner's probing)")
    parser.add_argument("--block", type=int, default=2, help="iterations per arm per turn")
    parser.add_argument("--uniform-len", type=int, default=512)
    parser.add_argument("--binding-max-len", type=int, default=2048)
    parser.add_argument("--binding-len", type=int, default=2048,
                        help="memory_binds: documents of this many tokens or more do not fit a tp1 pipeline")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    rows = []
    for name in args.regimes:
        for load in args.loads:
            row = measure(name, args, load == "busy")
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("regime", "background_load", "best_homogeneous", "ratio_median",
                                                  "ratio_min", "ratio_max", "gain_bound", "planner_strategies", "wall_s")}),
                  file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "planner_gain", "repeats": args.repeats, "batches": args.batches,
                      "block": args.block, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
