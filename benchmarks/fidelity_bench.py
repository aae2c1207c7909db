"""Plan fidelity benchmark (prints JSON): predicted vs measured iteration time, and decisions checked
against measured time.

For each model size: ``hgraph profile`` measures ``T(l)`` of every scheme and the iteration terms of
every strategy on ``--world-size`` local gloo ranks (cached in ``$HGRAPH_CACHE``); then the ranks
train on ``--batches`` batches of Wikipedia-sample lengths (``--lengths``, truncated to ``--context``,
``--tokens`` per batch). For every batch, every strategy runs for real (the planner packing the batch
for that strategy), strategies taking turns inside each batch and every (batch, strategy) pair run
``--repeats`` times in rounds, so load from other programs on the machine falls on all alike.

Reported per size and over both: median ``|pred − meas| / meas`` and Spearman rank correlation over
(batch, strategy) pairs, with the online correction off (the profiled model) and on (an
``OnlineCorrection`` fed every measurement so far; each prediction is made before its own
measurement), and the noise: median relative spread of the repeats of one pair.

``--decisions``: for every batch the planner (all candidates, the correction as of then) picks a
strategy before the batch runs; reported: how often the pick's measured time is within 5 % of the
measured best, and the picks' total measured time against the best single homogeneous strategy's.

``--world-size 1 --device cuda`` (issue 15 item 6): compute terms only, one process, ``T(l)``
profiled on that device (``hgraph.profiling.profile_single.measure``), the trainer on the same device; with
``--device cpu`` the same path runs on CPU (what the tests run).

``--busy``: one busy process (half of a 2-core machine) runs while the ranks measure, not while they
profile: a load that came after profiling, which the online correction is for.

Run: ``OMP_NUM_THREADS=1 python benchmarks/fidelity_bench.py --decisions`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from background_load import background_load

from hgraph.program.options import OverlapConfig
from hgraph.training.configs import AdamWConfig, RunConfig

STRATEGIES = ("4x tp1", "2x tp2", "tp4", "2x tp1,pp2", "tp2 + 2x tp1")
SIZES = ("tiny", "small")
LENGTHS = "/work/shared/data/wikipedia_lengths.txt"
PROFILE_LENGTHS = (64, 128, 256, 384, 512)


def schemes_of(strategies: list[str]) -> list[str]:
    from hgraph.core.strategy import Strategy

    return sorted({str(p.stage_key) for s in strategies for p in Strategy.parse(s).pipelines})


def wikipedia_batches(path: str, count: int, tokens: int, context: int, seed: int) -> list[list[int]]:
    """``count`` batches of the length file's documents (seeded shuffle), each truncated to ``context``."""
    from hgraph.planner.batches import make_batches, read_lengths, sample_path

    try:
        lengths = read_lengths(path)
    except FileNotFoundError:
        lengths = read_lengths(sample_path())
    return make_batches(lengths, tokens, context, count, seed)


def _rank_run(size: str, strategies: list[str], table: dict, batches: list[list[int]], repeats: int,
              schedule: str, device: str) -> dict[str, Any]:
    """On every rank: every strategy on every batch, ``repeats`` rounds; rank 0 predicts and records."""
    import hgraph
    from hgraph.cli.demo import model_factory
    from hgraph.planner.assign import Planner
    from hgraph.planner.correction import OnlineCorrection
    from hgraph.planner.cost import CostModel
    from hgraph.planner.terms import terms_of
    from hgraph.training.trainer import Trainer

    cost = CostModel.from_table(table)
    terms = terms_of(cost)
    model = model_factory(size)
    compiled = hgraph.compile(model, strategies, example_inputs=torch.randint(0, 8, (1, 16)),
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(
                                  overlap=OverlapConfig() if schedule == "overlap" else None)))
    correction = OnlineCorrection()
    single = [Planner(cost, [s], terms=terms, schedule=schedule, correction=correction) for s in compiled.strategies]
    full = Planner(cost, compiled.strategies, terms=terms, schedule=schedule, correction=correction)
    trainer = Trainer(compiled, optimizer=AdamWConfig(lr=1e-4),
                      run=RunConfig(device=None if device == "cpu" else device))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    data = [[torch.randint(0, vocab, (n,), generator=g) for n in b] for b in batches]
    for k in range(len(strategies)):  # warm-up: first run of every program
        trainer.planner = single[k]
        trainer.step(data[0])
    correction.__init__()  # forget the warm-up
    rows: list[dict[str, Any]] = []
    for b, batch in enumerate(data):
        pick = None
        if trainer.rank == 0:
            plan = full.plan([len(s) for s in batch])
            pick = compiled.strategy_index(plan.strategy)
        for rep in range(repeats):
            order = list(range(len(strategies)))
            shift = (b + rep) % len(order)
            for k in order[shift:] + order[:shift]:
                trainer.planner = single[k]
                trainer.step(batch)
                rec = trainer.history[-1]
                rows.append({"batch": b, "repeat": rep, "strategy": k, "pick": pick,
                             "measured_ms": rec["measured_ms"], "predicted_ms": rec["predicted_ms"],
                             "predicted_raw_ms": rec["predicted_raw_ms"]})
    return {"rows": rows, "strategies": [str(s) for s in compiled.strategies], "correction": correction.state()}


def profile_table(size: str, world: int, strategies: list[str], repeats: int,
                  batches: list[list[int]]) -> tuple[dict, str]:
    from hgraph.cli.demo import _SizedFactory
    from hgraph.profiling.profile_iteration import profile_iteration
    from hgraph.profiling.profile_ranks import profile_ranks
    from hgraph.planner.terms import with_terms

    factory = _SizedFactory(size)
    prof = profile_ranks(factory, world, schemes_of(strategies), PROFILE_LENGTHS, repeats=repeats)
    terms = profile_iteration(factory, world, strategies, prof.cost_model, PROFILE_LENGTHS, repeats=repeats,
                              batches=batches)
    return with_terms(prof.cost_model, terms.terms).to_table(), f"{prof}\n{terms}"


def summarize(rows: list[dict], names: list[str], decisions: bool) -> dict[str, Any]:
    from hgraph.planner.correction import fidelity
    from hgraph.core.strategy import Strategy

    pairs: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        pairs.setdefault((r["batch"], r["strategy"]), []).append(r)
    keys = sorted(pairs)
    measured = [statistics.median(r["measured_ms"] for r in pairs[k]) for k in keys]
    raw = [pairs[k][0]["predicted_raw_ms"] for k in keys]  # the profiled model (no correction)
    corrected = [pairs[k][0]["predicted_ms"] for k in keys]  # first run: predicted before measuring the pair
    spread = [(max(v) - min(v)) / statistics.mean(v) for v in
              ([r["measured_ms"] for r in pairs[k]] for k in keys) if len(v) > 1]
    out: dict[str, Any] = {
        "pairs": len(keys),
        "correction_off": fidelity(raw, measured),
        "correction_on": fidelity(corrected, measured),
        "noise_median_repeat_spread": statistics.median(spread) if spread else None,
        "per_strategy_median_rel_error_off": {
            names[s]: statistics.median(abs(p - m) / m for (b, k), p, m in zip(keys, raw, measured) if k == s)
            for s in range(len(names))},
    }
    if decisions:
        by_batch: dict[int, dict[int, float]] = {}
        for (b, k), m in zip(keys, measured):
            by_batch.setdefault(b, {})[k] = m
        picks = {r["batch"]: r["pick"] for r in rows}
        within = [by_batch[b][picks[b]] <= 1.05 * min(t.values()) for b, t in by_batch.items()]
        homogeneous = [k for k, n in enumerate(names) if len({str(p) for p in Strategy.parse(n).pipelines}) == 1]
        totals = {names[k]: sum(t[k] for t in by_batch.values()) for k in homogeneous}
        picked = sum(by_batch[b][picks[b]] for b in by_batch)
        best_name = min(totals, key=totals.get)
        out["decisions"] = {
            "batches": len(by_batch), "pick_within_5pct_of_measured_best": sum(within) / len(within),
            "picked_total_ms": picked, "best_homogeneous": best_name, "best_homogeneous_total_ms": totals[best_name],
            "picked_over_best_homogeneous": picked / totals[best_name],
            "oracle_total_ms": sum(min(t.values()) for t in by_batch.values()),
            "picks": {names[k]: sum(1 for p in picks.values() if p == k) for k in range(len(names))},
        }
    return out


def run_world(args: argparse.Namespace) -> dict[str, Any]:
    from hgraph.runtime.launch import launch

    strategies = [s.strip() for s in args.strategies.split(";") if s.strip()]
    batches = wikipedia_batches(args.lengths, args.batches, args.tokens, args.context, args.seed)
    result: dict[str, Any] = {"world_size": args.world_size, "schedule": args.schedule, "strategies": strategies,
                              "background_load": args.busy,
                              "batches": args.batches, "tokens_per_batch": args.tokens, "context": args.context,
                              "repeats": args.repeats, "sizes": {}}
    all_rows, names = [], None
    for size in args.sizes.split(","):
        start = time.perf_counter()
        # profiled on other batches of the same length distribution than the ones measured below
        profile_batches = wikipedia_batches(args.lengths, 3, args.tokens, args.context, args.seed + 1000)
        table, text = profile_table(size, args.world_size, strategies, args.profile_repeats, profile_batches)
        print(text, file=sys.stderr)
        profile_s = time.perf_counter() - start
        with background_load(args.busy):
            out = launch(_rank_run, args.world_size, timeout=args.timeout,
                         args=(size, strategies, table, batches, args.repeats, args.schedule, "cpu"))[0]
        names = out["strategies"]
        summary = summarize(out["rows"], names, args.decisions)
        summary.update(profile_s=profile_s, run_s=time.perf_counter() - start - profile_s,
                       correction=out["correction"])
        result["sizes"][size] = summary
        offset = len({r["batch"] for r in all_rows})
        all_rows += [{**r, "batch": r["batch"] + offset, "size": size} for r in out["rows"]]
    result["all"] = summarize(all_rows, names, args.decisions)
    if args.rows:
        with open(args.rows, "w") as f:
            json.dump(all_rows, f)
    return result


def run_single(args: argparse.Namespace) -> dict[str, Any]:
    """World size 1 on ``--device``: compute terms only (see the module docstring)."""
    import hgraph
    from hgraph.cli.demo import model_factory
    from hgraph.planner.assign import Planner
    from hgraph.planner.correction import OnlineCorrection
    from hgraph.profiling.profile_single import build_table, measure
    from hgraph.planner.terms import AlphaBeta, IterationTerms, StrategyTerms
    from hgraph.runtime.kernels.thread_comm import run_threads
    from hgraph.training.trainer import Trainer

    batches = wikipedia_batches(args.lengths, args.batches, args.tokens, args.context, args.seed)
    result: dict[str, Any] = {"world_size": 1, "device": args.device, "batches": args.batches, "sizes": {}}
    for size in args.sizes.split(","):
        raw = measure(f"hgraph.cli.demo:{size}_model", PROFILE_LENGTHS, args.device, "float32", args.profile_repeats)
        cost, _ = build_table(raw, [1], f"{size}-{args.device}")
        name = "tp1"
        terms = IterationTerms(AlphaBeta(0.0, 0.0), 0.0, raw["layers"],
                               {(name, "none"): StrategyTerms(name, "none", 0.0, 0.0, 1.0, 0.0, 0.0)})
        model = model_factory(size)

        def body(comm: Any) -> list[dict]:
            compiled = hgraph.compile(model, ["tp1"], example_inputs=torch.randint(0, 8, (1, 16)))
            planner = Planner(cost, compiled.strategies, terms=terms, correction=OnlineCorrection())
            trainer = Trainer(compiled, optimizer=AdamWConfig(lr=1e-4), run=RunConfig(device=args.device), comm=comm, planner=planner)
            g = torch.Generator().manual_seed(0)
            data = [[torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in b] for b in batches]
            trainer.step(data[0])  # warm-up
            rows = []
            for rep in range(args.repeats):
                for b, batch in enumerate(data):
                    trainer.step(batch)
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    rec = trainer.history[-1]
                    rows.append({"batch": b, "repeat": rep, "strategy": 0, "pick": 0, "measured_ms": rec["measured_ms"],
                                 "predicted_ms": rec["predicted_ms"], "predicted_raw_ms": rec["predicted_raw_ms"]})
            return rows

        rows = run_threads(body, 1, timeout=args.timeout)[0]
        result["sizes"][size] = summarize(rows, [name], False)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes", default=",".join(SIZES), help="demo model sizes (hgraph.cli.demo.SIZES)")
    parser.add_argument("--strategies", default=";".join(STRATEGIES), help="';'-separated candidate strategies")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per batch")
    parser.add_argument("--context", type=int, default=512, help="every document truncated to this many tokens")
    parser.add_argument("--lengths", default=LENGTHS, help="length file (default: the Wikipedia sample)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every (batch, strategy) pair")
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--schedule", choices=("none", "overlap"), default="none")
    parser.add_argument("--decisions", action="store_true", help="also check the planner's picks by measurement")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda with --world-size 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", default=None, help="also write every measured (batch, strategy, repeat) here")
    parser.add_argument("--busy", action="store_true",
                        help="a busy process on the machine while the ranks measure (profiled without it)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    if args.world_size == 1:
        result = run_single(args)
    elif args.device != "cpu":
        raise SystemExit("--device cuda runs at --world-size 1 (compute terms only); local gloo ranks are CPU")
    else:
        result = run_world(args)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
