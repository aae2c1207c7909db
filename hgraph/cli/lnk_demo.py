"""``hgraph lnk-demo``: the LNK layout solver on 4 local CPU ranks.

It shows a few layout changes (same group, across groups of different
sizes, and between a heterogeneous strategy's union and a ZeRO layout) planned, printed, executed on
4 local gloo processes and checked against the global tensor.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from hgraph.core.layout import Layout, LayoutUnion, replicated, sharded
from hgraph.errors import CommunicationError
from hgraph.lnk import assemble, is_partial, local_shards, solve
from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm
from hgraph.runtime.kernels.reshard import execute
from hgraph.runtime.launch import launch

WORLD = (0, 1, 2, 3)
_TP2_1_1 = (sharded((8, 4), (0, 1)), replicated((8, 4), (2,)), replicated((8, 4), (3,)))

TRANSITIONS = [
    ("gradients P -> S(0) (reduce_scatter)", Layout((8, 6), WORLD, (4,), ("P",)), sharded((8, 6), WORLD)),
    ("S(0) -> S(1) (all_to_all)", sharded((8, 6), WORLD), sharded((8, 6), WORLD, 1)),
    ("2 ranks -> 4 ranks", sharded((8, 6), (0, 1)), sharded((8, 6), WORLD, 1)),
    ("3 ranks partial -> 2 other ranks", Layout((6, 4), (0, 1, 2), (3,), ("P",)), sharded((6, 4), (1, 3))),
    ("ZeRO -> weights of TP2 + TP1 + TP1 (pull)", sharded((8, 4), WORLD), LayoutUnion(_TP2_1_1, "duplicate")),
    ("gradients of TP2 + TP1 + TP1 -> ZeRO (push)", LayoutUnion(_TP2_1_1, "partial"), sharded((8, 4), WORLD)),
]


def _global_value(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape)


def _rank_main(transitions: list) -> list:
    """Every rank: execute each plan on its shard of the global value."""
    rank, comm = dist.get_rank(), ProcessGroupComm()
    out = []
    for _, src, dst in transitions:
        plan = solve(src, dst, itemsize=8)
        shards = local_shards(src, _global_value(src.shape))
        out.append(execute(plan, shards.get(rank), comm, dtype=torch.float64))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before the ranks are stopped")


def run(args: argparse.Namespace) -> int:
    print(f"LNK demo: {len(TRANSITIONS)} layout changes on {len(WORLD)} local gloo ranks (float64)\n")
    for name, src, dst in TRANSITIONS:
        plan = solve(src, dst, itemsize=8)
        print(f"== {name}\n{plan}\n   predicted {plan.predicted_time_s() * 1e6:.1f} us on {plan.topology}\n")
    start = time.perf_counter()
    per_rank = launch(_rank_main, len(WORLD), args=(TRANSITIONS,), timeout=args.timeout)
    elapsed = time.perf_counter() - start
    failures = 0
    for i, (name, src, dst) in enumerate(TRANSITIONS):
        got = {r: per_rank[r][i] for r in dst.ranks}
        value = _global_value(src.shape)
        if is_partial(dst):
            ok = torch.equal(assemble(dst, got), value)
        else:
            want = local_shards(dst, value)
            ok = all(torch.equal(got[r], want[r]) for r in dst.ranks)
        plan = solve(src, dst, itemsize=8)
        verdict = "ok" if ok and plan.bytes_moved == plan.lower_bound_bytes else "FAILED"
        failures += verdict != "ok"
        print(f"{verdict:6} {name}: {plan.bytes_moved} bytes moved, lower bound {plan.lower_bound_bytes}")
    print(f"\nexecuted on {len(WORLD)} gloo processes in {elapsed:.1f}s (including start-up)")
    if failures:
        raise CommunicationError(
            f"{failures} layout change(s) produced wrong values or missed the lower bound"
        )
    return 0
