"""Planner benchmark: hgraph's planner and every baseline on the same batches of real lengths.

Settings (issue 6): 7B on 64 GPUs, 200K tokens per iteration, max length 32K; 32B on 1024 GPUs,
1.6M tokens; 7B on 64 GPUs with max length 128K, all on Wikipedia lengths. Issue 17 adds context
parallelism (``_cp``: cp degrees 1, 2, 4, 8, analytic cp entries from ``hgraph.planner.context``):
32B on 1024 GPUs with and without CP; 13B on 128 GPUs, 400K tokens, on code lengths (the files of
this Python's standard library, tokens estimated as bytes / 3.5) with and without CP; and 32B on
4096 GPUs with CP, 6.4M tokens (plan time; baselines skipped). Every plan carries its lower bound
(``hgraph.planner.bound``); ``goals`` checks the issue's targets. Prints one JSON object. The reference baseline
solves MILPs (6-20 minutes per iteration here), so it runs on the first ``--reference-iterations``
batches of the ``--reference-settings`` only (default: one batch of the first setting, so the default
run takes about 7 minutes), and every comparison with it uses those batches. The full comparison:

    python benchmarks/planner_bench.py --iterations 5 --reference-iterations 1 \
        --reference-settings 7b_64gpu_32k 32b_1024gpu_32k 7b_64gpu_128k      # about 40 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from hgraph.planner import baselines
from hgraph.planner.assign import Planner
from hgraph.planner.batches import make_batches, read_lengths, sample_path
from hgraph.planner.context import with_context_parallel
from hgraph.planner.cost import CostModel
from hgraph.planner.proposal import propose

CP = (1, 2, 4, 8)
CODE_BYTES_PER_TOKEN = 3.5
# name: (table, gpus, tokens per iteration, max length, cp degrees or None, lengths, run baselines)
SETTINGS = {
    "7b_64gpu_32k": ("llama7b_a800", 64, 200_000, 32_768, None, "wikipedia", True),
    "32b_1024gpu_32k": ("llama32b_a800", 1024, 1_600_000, 32_768, None, "wikipedia", True),
    "7b_64gpu_128k": ("llama7b_a800", 64, 200_000, 131_072, None, "wikipedia", True),
    "32b_1024gpu_32k_cp": ("llama32b_a800", 1024, 1_600_000, 32_768, CP, "wikipedia", True),
    "13b_128gpu_code": ("llama13b_a800", 128, 400_000, 32_768, None, "code", True),
    "13b_128gpu_code_cp": ("llama13b_a800", 128, 400_000, 32_768, CP, "code", True),
    "32b_4096gpu_32k_cp": ("llama32b_a800", 4096, 6_400_000, 32_768, CP, "wikipedia", False),
}


def code_lengths() -> list[int]:
    """Real code lengths: every ``.py`` file of this Python's standard library (sorted paths), in
    tokens estimated as bytes / 3.5 (BPE tokenizers give 3-4 bytes per token on source code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return [max(2, round(p.stat().st_size / CODE_BYTES_PER_TOKEN)) for p in files]


def _stats(plans) -> dict:
    return {
        "predicted_ms": [round(p.predicted_ms, 1) for p in plans],
        "predicted_ms_total": round(sum(p.predicted_ms for p in plans), 1),
        "plan_ms_median": round(statistics.median(p.plan_ms for p in plans), 2),
        "plan_ms_max": round(max(p.plan_ms for p in plans), 2),
        "strategies": sorted({str(p.strategy) for p in plans}),
        "lower_bound_ms": [round(p.bound.ms, 1) for p in plans],
        "ratio_to_bound": [round(p.ratio_to_bound, 4) for p in plans],
        "ratio_to_bound_max": round(max(p.ratio_to_bound for p in plans), 4),
    }


def run_setting(name: str, iterations: int, ref_iterations: int, ref_time_limit: float, seed: int) -> dict:
    table, gpus, tokens, max_len, cp, source, with_baselines = SETTINGS[name]
    cost_model = CostModel.preset(table)
    if cp:
        cost_model = with_context_parallel(cost_model, cp)
    lengths = code_lengths() if source == "code" else read_lengths(sample_path())
    batches = make_batches(lengths, tokens, max_len, iterations, seed)
    start = time.perf_counter()
    candidates = propose(cost_model, gpus, lengths, max_len=max_len, tokens_per_iteration=tokens)
    propose_s = time.perf_counter() - start
    planner = Planner(cost_model, candidates)
    ours, cpu_ms = [], []
    for b in batches:  # CPU time too: wall time on a shared machine counts other programs' load
        begin = time.process_time()
        ours.append(planner.plan(b))
        cpu_ms.append((time.process_time() - begin) * 1e3)
    runs = {}
    if with_baselines:
        homogeneous = baselines.homogeneous_strategies(cost_model, gpus)
        per_iteration_homogeneous = Planner(cost_model, homogeneous)
        runs = {
            "megatron": baselines.megatron(cost_model, gpus, batches, max_len),
            "homogeneous-tuned": baselines.homogeneous_tuned(cost_model, gpus, batches),
            "homogeneous-per-iteration": [per_iteration_homogeneous.plan(b) for b in batches],
        }
    if ref_iterations:
        runs["hydraulis-reference"] = baselines.hydraulis_reference(
            cost_model, candidates, batches[:ref_iterations], time_limit=ref_time_limit
        )
    costs = {c for cs in planner.pipeline_costs for c in cs}
    floor = []  # the longest sequence alone on the fastest pipeline that can hold it (compute only)
    for b in batches:
        longest = max(b)
        floor.append(min(c.pp * (c.seq_time(longest) + c.c) for c in costs if c.max_len >= longest))
    out = {
        "setting": {"cost_table": table, "gpus": gpus, "tokens_per_iteration": tokens, "max_len": max_len,
                    "context_parallel": list(cp or (1,)), "lengths": source, "sample_size": len(lengths),
                    "iterations": iterations, "seed": seed, "candidates": len(candidates),
                    "propose_s": round(propose_s, 3)},
        "hgraph": {**_stats(ours), "plan_cpu_ms_median": round(statistics.median(cpu_ms), 2),
                   "plan_cpu_ms_max": round(max(cpu_ms), 2)},
        "baselines": {k: _stats(v) for k, v in runs.items()},
        "longest_sequence_floor_ms": [round(f, 1) for f in floor],
    }
    total = sum(p.predicted_ms for p in ours)
    comparison = {}
    for k, plans in runs.items():
        mine = sum(p.predicted_ms for p in ours[: len(plans)])
        theirs = sum(p.predicted_ms for p in plans)
        comparison[k] = {
            "speedup": round(theirs / mine, 4),
            "hgraph_never_slower": all(o.predicted_ms <= t.predicted_ms * (1 + 1e-9) for o, t in zip(ours, plans)),
            "plan_time_ratio": round(
                statistics.median(p.plan_ms for p in plans) / statistics.median(p.plan_ms for p in ours[: len(plans)]), 2
            ),
        }
    out["comparison"] = comparison
    out["heterogeneous_iterations"] = sum(len({p.stage_key for p in plan.pipelines}) > 1 for plan in ours)
    out["cp_iterations"] = sum(any(p.pipeline.cp > 1 for p in plan.pipelines) for plan in ours)
    out["hgraph_predicted_ms_total"] = round(total, 1)
    # best plan per iteration over hgraph and every baseline run here (the no-CP reference of a _cp setting)
    out["best_predicted_ms"] = [
        round(min([ours[i].predicted_ms] + [plans[i].predicted_ms for plans in runs.values() if i < len(plans)]), 1)
        for i in range(len(ours))
    ]
    return out


def goals(result: dict) -> dict:
    """The issue's targets, for the settings that ran: CP gain, plan time at 4096 GPUs, plan / bound."""
    out: dict = {}
    for name, r in result.items():
        plain = result.get(name.removesuffix("_cp")) if name.endswith("_cp") else None
        if plain is not None:
            best_plain = sum(plain["best_predicted_ms"])
            out[f"{name}:speedup_over_best_no_cp"] = round(best_plain / r["hgraph_predicted_ms_total"], 3)
    if "32b_1024gpu_32k_cp:speedup_over_best_no_cp" in out:
        out["cp_speedup_32b_1024_at_least_1.5"] = out["32b_1024gpu_32k_cp:speedup_over_best_no_cp"] >= 1.5
    if "32b_4096gpu_32k_cp" in result:
        big = result["32b_4096gpu_32k_cp"]["hgraph"]
        out["plan_ms_max_4096_gpus"] = big["plan_ms_max"]
        out["plan_cpu_ms_max_4096_gpus"] = big["plan_cpu_ms_max"]
        out["plan_time_4096_at_most_1s"] = big["plan_ms_max"] <= 1000
        out["plan_cpu_time_4096_at_most_1s"] = big["plan_cpu_ms_max"] <= 1000
    ratios = {name: r["hgraph"]["ratio_to_bound_max"] for name, r in result.items()}
    out["ratio_to_bound_max"] = ratios
    out["ratio_to_bound_at_most_1.10"] = all(v <= 1.10 for v in ratios.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--reference-iterations", type=int, default=1, help="0 skips hydraulis-reference")
    parser.add_argument("--reference-time-limit", type=float, default=0.5, help="seconds per packing MILP")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--reference-settings", nargs="*", default=["7b_64gpu_32k"], choices=list(SETTINGS),
        help="settings that also run hydraulis-reference (minutes per iteration)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = {}
    for name in args.settings:
        start = time.perf_counter()
        ref_iterations = args.reference_iterations if name in args.reference_settings else 0
        result[name] = run_setting(name, args.iterations, ref_iterations, args.reference_time_limit, args.seed)
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    result["goals"] = goals(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
