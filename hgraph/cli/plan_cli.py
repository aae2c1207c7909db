"""``hgraph plan``: plan iterations of a length file with a cost model, next to the baselines.

Candidates come from ``proposal.propose`` for the length file's distribution; every batch is planned
by hgraph's planner and by the baselines (``megatron``, ``homogeneous-tuned``; ``--baselines`` adds
the slow ``hydraulis-reference``) and predicted by the same simulator. ``--json`` prints one object::

    {"iterations": [{"strategy", "lengths", ["sources"], "pipelines": [{"tp", "pp", "cp", "ranks",
                     "max_len", "micro_batches"}], "predicted_ms", "plan_ms",
                     "lower_bound": {"ms", "longest_ms", "gpu_time_ms", "gpus"}, "ratio_to_bound"}],
     "summary": {"predicted_ms_total", "baseline": {"name": "megatron", "predicted_ms_total"},
                 "baselines": [{"name", "predicted_ms_total", "plan_ms_median"}],
                 "speedup", "plan_ms_median", "plan_ms_max", "lower_bound_ms_total", "ratio_to_bound_max"}}

``--max-len`` is the context: the longest piece of a sequence an iteration holds. Longer sequences
are truncated to it, or with ``--split-long`` cut into pieces of at most ``--max-len`` tokens (and of
at most the largest MaxLen, the longest sequence any candidate pipeline fits in memory).
``micro_batches`` hold indices into ``lengths`` (the planned pieces; ``sources`` maps each piece to
``[sequence, first token]`` when ``--split-long`` cut a sequence). ``lower_bound`` is
``hgraph.planner.bound``: computed from the batch and the cost model alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Sequence

from hgraph.planner import baselines
from hgraph.planner.assign import Planner
from hgraph.planner.batches import make_batches, read_lengths, sample_path
from hgraph.planner.context import parse_degrees, with_context_parallel
from hgraph.planner.cost import PRESETS, load_cost_model
from hgraph.planner.plan import IterationPlan
from hgraph.planner.proposal import propose


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost-table", default="llama7b_a800",
                        help=f"a preset ({', '.join(PRESETS)}) or a cost table JSON file (default: %(default)s)")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument("--lengths", default=None, help="length file, one integer per line (default: bundled Wikipedia sample)")
    parser.add_argument("--tokens-per-iteration", type=int, default=200_000,
                        help="tokens per global batch (default: %(default)s)")
    parser.add_argument("--max-len", type=int, default=32_768,
                        help="context length (default: %(default)s): longer sequences are truncated to it, or "
                        "with --split-long cut into pieces of at most this many tokens")
    parser.add_argument("--iterations", type=int, default=1, help="number of batches to plan (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the length-file shuffle (default: %(default)s)")
    parser.add_argument("--exact", action="store_true", help="solve each iteration exactly by MILP (small batches only)")
    parser.add_argument("--split-long", action="store_true",
                        help="cut sequences longer than --max-len, or than every candidate's MaxLen (the longest "
                        "sequence it fits in memory), into pieces instead of truncating them")
    parser.add_argument("--baselines", action="store_true", help="also run the slow hydraulis-reference baseline")
    parser.add_argument(
        "--context-parallel", default=None, metavar="1,2,4",
        help="cp degrees the plan may use; cp schemes the table lacks are derived analytically (hgraph.planner.context)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def plan_run(args: argparse.Namespace) -> tuple[list[IterationPlan], dict[str, list[IterationPlan]]]:
    """hgraph's plans and each baseline's plans for the batches ``args`` describes."""
    cost_model = load_cost_model(args.cost_table)
    if args.context_parallel is not None:
        cost_model = with_context_parallel(cost_model, parse_degrees(args.context_parallel))
    lengths = read_lengths(args.lengths or sample_path())
    cut = max(lengths) if args.split_long else args.max_len  # --split-long: sequences kept whole, cut below
    batches = make_batches(lengths, args.tokens_per_iteration, cut, args.iterations, args.seed)
    candidates = propose(cost_model, args.gpus, lengths, max_len=args.max_len, tokens_per_iteration=args.tokens_per_iteration)
    planner = Planner(cost_model, candidates)
    ours = [planner.plan(b, split_long=args.split_long, exact=args.exact, max_piece=args.max_len) for b in batches]
    if args.split_long:  # the baselines plan the same pieces
        batches = [list(p.lengths) for p in ours]
    others = {
        "megatron": baselines.megatron(cost_model, args.gpus, batches, args.max_len),
        "homogeneous-tuned": baselines.homogeneous_tuned(cost_model, args.gpus, batches),
    }
    if args.baselines:
        others["hydraulis-reference"] = baselines.hydraulis_reference(cost_model, candidates, batches)
    return ours, others


def summary(ours: Sequence[IterationPlan], others: dict[str, list[IterationPlan]]) -> dict[str, Any]:
    """The ``summary`` object of the JSON output."""
    total = sum(p.predicted_ms for p in ours)
    rows = [
        {
            "name": name,
            "predicted_ms_total": round(sum(p.predicted_ms for p in plans), 3),
            "plan_ms_median": round(statistics.median(p.plan_ms for p in plans), 3),
        }
        for name, plans in others.items()
    ]
    megatron = next(r for r in rows if r["name"] == "megatron")
    return {
        "predicted_ms_total": round(total, 3),
        "baseline": {"name": "megatron", "predicted_ms_total": megatron["predicted_ms_total"]},
        "baselines": rows,
        "speedup": round(megatron["predicted_ms_total"] / total, 4),
        "plan_ms_median": round(statistics.median(p.plan_ms for p in ours), 3),
        "plan_ms_max": round(max(p.plan_ms for p in ours), 3),
        "lower_bound_ms_total": round(sum(p.bound.ms for p in ours if p.bound), 3),
        "ratio_to_bound_max": max(round(p.ratio_to_bound or 1.0, 4) for p in ours),
    }


def run(args: argparse.Namespace) -> int:
    ours, others = plan_run(args)
    result = {"iterations": [p.to_json() for p in ours], "summary": summary(ours, others)}
    if args.json:
        print(json.dumps(result))
        return 0
    for k, plan in enumerate(ours):
        print(f"iteration {k}: {plan}")
    s = result["summary"]
    print(f"total predicted {s['predicted_ms_total']:.1f} ms, {s['speedup']:.2f}x over megatron; "
          f"plan time median {s['plan_ms_median']:.1f} ms, max {s['plan_ms_max']:.1f} ms; "
          f"lower bound {s['lower_bound_ms_total']:.1f} ms, worst iteration {s['ratio_to_bound_max']:.3f}x its bound")
    for row in s["baselines"]:
        print(f"  {row['name']:<20} {row['predicted_ms_total']:.1f} ms (plan median {row['plan_ms_median']:.1f} ms)")
    return 0
