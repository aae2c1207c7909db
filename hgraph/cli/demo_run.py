"""``hgraph demo``'s run: the command line, what every rank trains, and the run folder.

The inputs (model sizes, corpus, cost tables, candidate schemes) are in ``hgraph.cli.demo``; this
module starts the ranks (``launch``), trains with the planner choosing per batch (``rank_train``),
then the interleaved comparison (``--compare``, ``hgraph.cli.demo_compare``), and writes the plots, the
Perfetto trace, the plans and the summary.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from hgraph.cli import plots
from hgraph.cli.demo import (MAX_LEN, MEMORY_BINDS, SIZES, TOKENS_PER_ITERATION, WORLD_SIZE, DemoConfig, factory_of,
                             corpus_batches, corpus_loaders, model_factory, profiled_cost_table, with_iteration_terms)
from hgraph.cli.demo_compare import CompareSpec, homogeneous_arms, probing_batches, rank_compare, ratios
from hgraph.core import atomic_files
from hgraph.compiler import entry
from hgraph.errors import HGraphError
from hgraph.planner.assign import Planner
from hgraph.planner.correction import OnlineCorrection, fidelity
from hgraph.planner.cost import CostModel
from hgraph.planner.memory import ALIGN, budget_below
from hgraph.core.degrees import Degrees
from hgraph.planner.proposal import propose
from hgraph.planner.terms import terms_of
from hgraph.program.options import CompileOptions, OverlapConfig, ScheduleConfig
from hgraph.runtime.launch import launch
from hgraph.runtime.timeline import exposed_communication
from hgraph.schedule.lowerings import PLACEMENTS
from hgraph.training.configs import AdamWConfig, RunConfig
from hgraph.training.trainer import Trainer

__all__ = ["add_arguments", "rank_train", "run", "write_artifacts"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=WORLD_SIZE, help=f"local gloo ranks (default {WORLD_SIZE})")
    parser.add_argument("--iterations", type=int, default=30, help="training iterations (default 30)")
    parser.add_argument("--out", default="runs/demo", help="run folder for plots, trace, plans (default runs/demo)")
    parser.add_argument("--model-size", choices=sorted(SIZES), default="tiny", help="model size (default tiny)")
    parser.add_argument("--tokens-per-iteration", type=int, default=TOKENS_PER_ITERATION)
    parser.add_argument("--max-len", type=int, default=MAX_LEN, help=f"context (default {MAX_LEN})")
    parser.add_argument("--long-documents", choices=("cut", "split"), default="cut",
                        help="files longer than --max-len: cut (one sequence per file, default) or split into pieces")
    parser.add_argument("--eval-interval", type=int, default=10, help="held-out loss every N iterations (0: never)")
    parser.add_argument("--memory-binds", type=int, default=MEMORY_BINDS, metavar="TOKENS",
                        help="a per-rank memory budget under which documents longer than TOKENS do not fit a tp1 "
                             f"pipeline, so the longest need tp/pp ranks (default {MEMORY_BINDS}; 0: the profiled "
                             "memory, where every strategy takes every document)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="then train the planner and the best homogeneous strategies on the same batches, "
                             "interleaved and repeated, and print the ratio (default: on; --no-compare skips it)")
    parser.add_argument("--compare-batches", type=int, default=6, help="batches of the comparison (default 6)")
    parser.add_argument("--compare-repeats", type=int, default=3, help="repetitions of the comparison (default 3)")
    parser.add_argument("--schedule", choices=PLACEMENTS, default="overlap",
                        help="overlap Pull/Push/activation communication with compute (default) or not")
    parser.add_argument("--fresh-profile", action="store_true", help="measure the cost model again")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are stopped")


def run(args: argparse.Namespace) -> int:
    if args.world_size < 1 or args.iterations < 1:
        raise HGraphError(f"--world-size {args.world_size} and --iterations {args.iterations} must be >= 1")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise HGraphError(f"--timeout {args.timeout}: expected a finite number of seconds > 0")
    if args.eval_interval < 0:
        raise HGraphError(f"--eval-interval {args.eval_interval}: expected N >= 0 (0: never)")
    if args.compare_batches < 1 or args.compare_repeats < 1:
        raise HGraphError(f"--compare-batches {args.compare_batches} and --compare-repeats {args.compare_repeats} "
                          "must be >= 1")
    if args.memory_binds < 0 or 0 < args.memory_binds <= ALIGN:
        raise HGraphError(f"--memory-binds {args.memory_binds}: expected 0 (off) or a length > {ALIGN} tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = DemoConfig(size=args.model_size, world_size=args.world_size, iterations=args.iterations,
                     tokens_per_iteration=args.tokens_per_iteration, max_len=args.max_len, seed=args.seed,
                     long_documents=args.long_documents,
                     schedule=args.schedule, eval_interval=args.eval_interval)
    batches = corpus_batches(cfg)
    print(f"hgraph demo: {SIZES[cfg.size]} model, {cfg.world_size} gloo ranks, {cfg.iterations} iterations, "
          f"<= {cfg.tokens_per_iteration} tokens/iteration of the Python standard library (BPE 512, one "
          f"sequence per file, {cfg.long_documents} at {cfg.max_len} tokens)")
    t0 = time.perf_counter()
    table = profiled_cost_table(cfg, fresh=args.fresh_profile)
    cost_model = CostModel.from_table(table).with_world_size(cfg.world_size)
    budget = None
    if args.memory_binds:
        budget = budget_below(cost_model.memory, 1, 1, 1, cfg.world_size, args.memory_binds)
        cost_model = cost_model.with_gpu_memory(budget)
    print(f"[1/4] cost model for {', '.join(str(s) for s in cost_model.schemes)} ({time.perf_counter() - t0:.1f}s)"
          + (f"; memory budget {budget / 2**20:.1f} MiB per rank: a tp1 pipeline takes at most "
             f"{cost_model.max_len(Degrees(1, 1))} tokens" if budget is not None else ""))
    flat = [n for b in batches for n in b]
    fitting = homogeneous_arms(cost_model, cfg.world_size, batches, most=None)
    if not fitting:
        raise HGraphError(f"--memory-binds {args.memory_binds}: no homogeneous strategy of {cfg.world_size} ranks "
                          f"takes a {max(flat)}-token file under that budget; raise it or lower --max-len")
    proposed = [str(s) for s in propose(cost_model, cfg.world_size, flat, cfg.max_len,
                                        tokens_per_iteration=cfg.tokens_per_iteration, max_candidates=6)]
    candidates = list(dict.fromkeys(proposed + fitting))  # the homogeneous strategies are always candidates
    t2 = time.perf_counter()
    table = with_iteration_terms(cfg, table, candidates, batches[:3], fresh=args.fresh_profile)
    costed = CostModel.from_table(table).with_world_size(cfg.world_size)
    if budget is not None:
        costed = costed.with_gpu_memory(budget)
    arms = homogeneous_arms(costed, cfg.world_size, batches, most=2, schedule=cfg.schedule)
    print(f"[2/4] {len(candidates)} candidate strategies: " + "; ".join(candidates)
          + f" (iteration terms measured {time.perf_counter() - t2:.1f}s)")
    cfg = DemoConfig(**{**asdict(cfg), "candidates": tuple(candidates), "cost_table": json.dumps(table),
                        "gpu_memory": budget})
    print(f"[3/4] training on {cfg.world_size} ranks (each compiles the candidates first)")
    t1 = time.perf_counter()
    result = launch(rank_train, cfg.world_size, args=(cfg,), timeout=args.timeout)[0]
    train_s = time.perf_counter() - t1
    comparison = None
    if args.compare:
        train, _ = corpus_loaders(cfg)
        warmup = 1 + probing_batches(costed, cfg.candidates)
        measured = [tuple(b) for b in train.first_batches(args.compare_batches + warmup)]
        spec = CompareSpec(model_factory=factory_of(cfg), candidates=cfg.candidates, homogeneous=tuple(arms),
                           cost_table=cfg.cost_table, batches=tuple(measured[warmup:]), warmup=tuple(measured[:warmup]),
                           repeats=args.compare_repeats, gpu_memory=budget, schedule=cfg.schedule, lr=cfg.lr)
        print(f"      --compare: {spec}, interleaved")
        t3 = time.perf_counter()
        comparison = ratios(launch(rank_compare, cfg.world_size, args=(spec,), timeout=args.timeout)[0])
        comparison["wall_s"] = time.perf_counter() - t3
        comparison.pop("iterations", None)
        print(f"      --compare took {comparison['wall_s']:.1f} s (start, compile, train)")
    print("[4/4] writing the run folder")
    summary = write_artifacts(out, cfg, cost_model, result, comparison, train_s)
    print(_summary_text(summary))
    return 0


def rank_train(cfg: DemoConfig) -> dict[str, Any]:
    """Runs on every rank: compile all candidates, then train with the planner choosing."""
    rank = dist.get_rank()
    model = model_factory(cfg.size)
    start = time.perf_counter()
    compiled = entry.compile(model, list(cfg.candidates), example_inputs=torch.randint(0, 8, (1, 16)),
                                      options=CompileOptions(schedule=ScheduleConfig(
                                          overlap=OverlapConfig() if cfg.schedule == "overlap" else None)))
    compile_s = time.perf_counter() - start
    cost_model = CostModel.from_table(json.loads(cfg.cost_table))
    if cfg.gpu_memory is not None:
        cost_model = cost_model.with_gpu_memory(cfg.gpu_memory)
    planner = Planner(cost_model, compiled.strategies, terms=terms_of(cost_model), schedule=cfg.schedule,
                      correction=OnlineCorrection())
    trainer = Trainer(compiled, optimizer=AdamWConfig(lr=cfg.lr, weight_decay=0.01, grad_clip=1.0),
                      run=RunConfig(timeline=cfg.timeline), planner=planner)
    train, held = corpus_loaders(cfg)
    held_batches = held.first_batches(cfg.eval_batches) if rank == 0 else None
    evals: list[dict[str, Any]] = []

    def evaluate() -> None:
        evals.append({"iteration": trainer.iteration, "loss": trainer.evaluate(held_batches)})
        if rank == 0:
            print(f"iter {trainer.iteration:3d}  held-out loss {evals[-1]['loss']:7.4f}", flush=True)

    for i in range(cfg.iterations):  # one console line per iteration (rank 0)
        if cfg.eval_interval and i % cfg.eval_interval == 0:
            evaluate()
        loss = trainer.step_data(train)
        rec = trainer.history[-1]
        if rank == 0:
            exposed = _exposed_ms(trainer, i)
            print(
                f"iter {i:3d}  loss {loss:7.4f}  longest {max(rec['lengths']):5d} of {len(rec['lengths']):2d}  "
                f"{rec['strategy']:<22} predicted {rec['predicted_ms'] or 0:7.1f} ms"
                f" (uncorrected {rec['predicted_raw_ms'] or 0:7.1f})  measured {rec['measured_ms']:7.1f} ms"
                + (f"  exposed comm (rank 0) {exposed:6.1f} ms" if exposed is not None else ""), flush=True
            )
    if cfg.eval_interval:
        evaluate()
    events = trainer.gather_timeline() if cfg.timeline else []
    return {"history": trainer.history, "evals": evals, "compile_s": compile_s, "events": events,
            "strategies": [str(s) for s in compiled.strategies]}


def _exposed_ms(trainer: Any, iteration: int) -> Optional[float]:
    """This rank's communication time not hidden behind compute in ``iteration`` (ms)."""
    if trainer.timeline is None:
        return None
    per_rank = exposed_communication(trainer.timeline.events)
    return 1000 * per_rank.get(trainer.rank, {}).get(iteration, 0.0)


def write_artifacts(out: Path, cfg: DemoConfig, cost_model: Any, result: dict, comparison: Optional[dict],
                    train_s: float) -> dict[str, Any]:
    """Plots, trace, plans and summary into ``out``; returns the summary."""
    history = result["history"]
    plans = [
        {"iteration": h["iteration"], "strategy": h["strategy"], "predicted_ms": h["predicted_ms"],
         "predicted_raw_ms": h["predicted_raw_ms"], "measured_ms": h["measured_ms"], "loss": h["loss"],
         "pipelines": [[[h["lengths"][i] for i in mb] for mb in p] for p in h["dispatch"]]}
        for h in history
    ]
    atomic_files.write_text(out / "plans.json", json.dumps(plans, indent=1))
    plots.loss_curve(out / "loss.png", history, None, result.get("evals"))
    plots.strategy_and_loads(out / "strategies.png", history)
    plots.predicted_vs_measured(out / "predicted_vs_measured.png", history)
    trace_files = plots.timeline_files(out, result.get("events") or [])
    steady = history[1:] if len(history) > 1 else history
    measured = sum(h["seconds"] for h in steady)
    summary: dict[str, Any] = {
        "model": SIZES[cfg.size],
        "world_size": cfg.world_size,
        "iterations": cfg.iterations,
        "candidates": list(cfg.candidates),
        "strategies_used": sorted({h["strategy"] for h in history}),
        "strategy_counts": {name: sum(h["strategy"] == name for h in history)
                            for name in sorted({h["strategy"] for h in history})},
        "longest_per_iteration": [max(h["lengths"]) for h in history],
        "loss_first": history[0]["loss"],
        "loss_last": history[-1]["loss"],
        "heldout": result.get("evals") or [],
        "compile_s": result["compile_s"],
        "train_wall_s": train_s,
        "step_s_total_after_first": measured,
        "predicted_ms_total_after_first": sum(h["predicted_ms"] or 0 for h in steady),
        "measured_ms_total_after_first": sum(h["measured_ms"] for h in steady),
        "fidelity": _fidelity(history),
        "exposed_comm_s": _exposed_total(result.get("events") or []),
        "artifacts": sorted(p.name for p in out.iterdir()) + trace_files,
    }
    if comparison is not None:
        summary["comparison"] = comparison
        summary["measured_speedup"] = comparison["ratio_median"]
    atomic_files.write_text(out / "summary.json", json.dumps(summary, indent=1))
    atomic_files.write_text(out / "summary.md", _summary_text(summary) + "\n")
    return summary


FIDELITY_SKIP = 3  # the correction's first iterations are not counted in the "after" figures


def _fidelity(history: list[dict]) -> dict[str, Any]:
    """Predicted vs measured (ms) over the run: uncorrected, corrected, and corrected after the first
    ``FIDELITY_SKIP`` iterations."""
    rows = [h for h in history if h.get("predicted_raw_ms") is not None]
    if len(rows) < 1:
        return {}
    measured = [h["measured_ms"] for h in rows]
    out = {"uncorrected": fidelity([h["predicted_raw_ms"] for h in rows], measured),
           "corrected": fidelity([h["predicted_ms"] for h in rows], measured)}
    late = rows[FIDELITY_SKIP:]
    if late:
        out["corrected_after_first_iterations"] = fidelity([h["predicted_ms"] for h in late], [h["measured_ms"] for h in late])
    return out


def _exposed_total(events: list) -> Optional[float]:
    """Sum over iterations of the slowest rank's exposed communication (seconds)."""
    if not events:
        return None
    per_rank = exposed_communication(events)
    iterations = {it for by_it in per_rank.values() for it in by_it}
    return sum(max(by_it.get(it, 0.0) for by_it in per_rank.values()) for it in iterations)


def _summary_text(s: dict[str, Any]) -> str:
    lines = [
        f"loss {s['loss_first']:.3f} -> {s['loss_last']:.3f} over {s['iterations']} iterations on {s['world_size']} ranks",
    ]
    if s.get("heldout"):
        lines.append("held-out loss " + " -> ".join(f"{e['loss']:.3f} (it {e['iteration']})" for e in s["heldout"]))
    lines += [
        "strategies used: " + ", ".join(f"{k} ({n} iterations)" for k, n in s["strategy_counts"].items()),
        f"step time (iterations 2..): {s['step_s_total_after_first']:.2f} s with planning; without it measured "
        f"{s['measured_ms_total_after_first'] / 1000:.2f} s, predicted {s['predicted_ms_total_after_first'] / 1000:.2f} s; "
        f"compile {s['compile_s']:.1f} s per rank",
    ]
    fid = s.get("fidelity") or {}
    if fid:
        late = fid.get("corrected_after_first_iterations", fid["corrected"])
        lines.append(
            f"prediction error (median |pred - meas| / meas): uncorrected {fid['uncorrected']['median_rel_error']:.1%}, "
            f"corrected {fid['corrected']['median_rel_error']:.1%}, corrected after iteration {FIDELITY_SKIP} "
            f"{late['median_rel_error']:.1%} (rank correlation {late['rank_correlation']:.2f})")
    if s.get("exposed_comm_s"):
        lines.append(f"exposed communication: {s['exposed_comm_s']:.2f} s")
    if "comparison" in s:
        c = s["comparison"]
        reps = len(c["ratio_per_repetition"])
        lines += [f"interleaved on the same batches, {reps} repetitions: best homogeneous {c['best_homogeneous']} "
                  "(seconds per repetition: " + "; ".join(f"{k} " + ", ".join(f"{v:.2f}" for v in vs)
                                                          for k, vs in c["seconds"].items()) + ")",
                  f"measured speedup (best homogeneous / hgraph): {c['ratio_median']:.2f}x median "
                  f"(range {c['ratio_min']:.2f}-{c['ratio_max']:.2f})"]
    lines.append("artifacts: " + ", ".join(s["artifacts"]))
    return "\n".join(lines)

