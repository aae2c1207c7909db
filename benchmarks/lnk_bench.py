"""LNK benchmark on 4 local gloo ranks; prints one JSON object.

Same-group transitions: hgraph's plan (``execute``) vs ``torch.distributed.tensor`` ``redistribute``
on the same tensors in the same run. DTensor bytes are counted from its algorithm with the same ring
accounting as hgraph's plans: all_gather and reduce_scatter ``(n-1)|T|``, all_reduce ``2(n-1)|T|``,
Shard(i)->Shard(j) on CPU = all_gather then chunk ``(n-1)|T|``, Replicate->Shard a local slice, 0.
Cross-group transitions (DTensor cannot redistribute across meshes): hgraph vs the naive baseline
"every destination rank gathers the whole tensor (one copy of every source piece of the first
representation) and slices", written with the same communicator. Times: median over repetitions of
the slowest rank, each repetition between barriers.

Usage: ``python benchmarks/lnk_bench.py [--size 1024] [--reps 10]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hgraph.core.layout import Layout, LayoutUnion, replicated, sharded
from hgraph.lnk import local_shards, pieces_of, solve

WORLD = (0, 1, 2, 3)


def same_group_cases(n: int):
    shape = (n, n)
    p = Layout(shape, WORLD, (4,), ("P",))
    return [
        ("S(0)->R", sharded(shape, WORLD), replicated(shape, WORLD), 3),
        ("P->S(0)", p, sharded(shape, WORLD), 3),
        ("P->R", p, replicated(shape, WORLD), 6),
        ("S(0)->S(1)", sharded(shape, WORLD), sharded(shape, WORLD, 1), 3),
        ("R->S(0)", replicated(shape, WORLD), sharded(shape, WORLD), 0),
    ]


def cross_group_cases(n: int):
    shape = (n, n)
    tp2_1_1 = (sharded(shape, (0, 1)), replicated(shape, (2,)), replicated(shape, (3,)))
    return [
        ("2->4 S(0)->S(1)", sharded(shape, (0, 1)), sharded(shape, WORLD, 1)),
        ("4->2 S(0)->S(1)", sharded(shape, WORLD), sharded(shape, (0, 1), 1)),
        ("disjoint 2+2 S(0)->S(1)", sharded(shape, (0, 1)), sharded(shape, (2, 3), 1)),
        ("union TP2+1+1 -> ZeRO", LayoutUnion(tp2_1_1, "duplicate"), sharded(shape, WORLD)),
        ("ZeRO -> union TP2+1+1", sharded(shape, WORLD), LayoutUnion(tp2_1_1, "duplicate")),
        ("partial union -> ZeRO", LayoutUnion(tp2_1_1, "partial"), sharded(shape, WORLD)),
    ]


def naive_plan(src, dst):
    """Per destination rank: one holder of every (box, term) of representation 0, and the bytes moved."""
    chosen = {}
    for piece in pieces_of(src):
        if piece.replica == 0 and (piece.box, piece.term) not in chosen:
            chosen[(piece.box, piece.term)] = piece
    sources = sorted(chosen.values(), key=lambda p: (p.box, p.term))
    moved = sum(
        torch.Size([b - a for a, b in p.box]).numel() for d in dst.ranks for p in sources if p.rank != d
    )
    return sources, moved


def naive_execute(src, dst, sources, local, comm):
    """Gather every source piece on every destination rank, sum the terms, slice the region."""
    rank = comm.rank
    sends = [(d, local) for p in sources if p.rank == rank for d in dst.ranks if d != rank]
    recvs, places = [], []
    if rank in dst.ranks:
        for p in sources:
            buf = local if p.rank == rank else torch.empty([b - a for a, b in p.box])
            if p.rank != rank:
                recvs.append((p.rank, buf))
            places.append((p.box, buf))
    comm.exchange(sends, recvs)
    if rank not in dst.ranks:
        return None
    full = torch.zeros(src.shape)
    for box, buf in places:
        full[tuple(slice(a, b) for a, b in box)] += buf
    return full[dst.local_slices(rank)].clone()


def _timed_pair(ours, theirs, reps: int) -> tuple[float, float]:
    """Median over ``reps`` of the slowest rank's time of each function, alternating the two so that
    load from other processes on the machine hits both alike (one warm-up each)."""
    import torch.distributed as dist

    ours()
    theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            out.append(elapsed.item())
    return statistics.median(times[0]), statistics.median(times[1])


def _rank_main(sizes: list[int], reps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm
    from hgraph.runtime.kernels.reshard import execute

    comm = ProcessGroupComm()
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", list(WORLD))
    to_dt = {"R": Replicate(), "P": Partial()}
    rows = {"same_group": [], "cross_group": []}
    for n in sizes:
        value = torch.randint(-8, 9, (n, n), generator=torch.Generator().manual_seed(n)).float()
        for name, src, dst, dtensor_factor in same_group_cases(n):
            plan = solve(src, dst, itemsize=4)
            local = local_shards(src, value)[rank]
            ours = execute(plan, local, comm)
            sp = src.placements[0]
            dp = dst.placements[0]
            src_pl = to_dt.get(str(sp), Shard(getattr(sp, "dim", 0)))
            dst_pl = to_dt.get(str(dp), Shard(getattr(dp, "dim", 0)))
            dt = DTensor.from_local(
                local, mesh, [src_pl], run_check=False, shape=value.shape, stride=value.stride()
            )
            theirs = dt.redistribute(mesh, [dst_pl]).to_local()
            ours_s, theirs_s = _timed_pair(
                lambda: execute(plan, local, comm), lambda: dt.redistribute(mesh, [dst_pl]).to_local(), reps
            )
            row = {
                "transition": name, "shape": [n, n],
                "hgraph_bytes": plan.bytes_moved, "lower_bound_bytes": plan.lower_bound_bytes,
                "dtensor_bytes": dtensor_factor * n * n * 4,
                "hgraph_s": ours_s, "dtensor_s": theirs_s,
                "values_match": bool(torch.equal(ours, theirs)),
                "plan": [str(s) for s in plan.steps[:1]] + (["..."] if len(plan.steps) > 1 else []),
            }
            rows["same_group"].append(row)
        for name, src, dst in cross_group_cases(n):
            plan = solve(src, dst, itemsize=4)
            shards = local_shards(src, value)
            local = shards.get(rank)
            sources, naive_elems = naive_plan(src, dst)
            ours = execute(plan, local, comm, dtype=torch.float32)
            theirs = naive_execute(src, dst, sources, local, comm)
            ours_s, theirs_s = _timed_pair(
                lambda: execute(plan, local, comm, dtype=torch.float32),
                lambda: naive_execute(src, dst, sources, local, comm),
                reps,
            )
            rows["cross_group"].append({
                "transition": name, "shape": [n, n],
                "hgraph_bytes": plan.bytes_moved, "lower_bound_bytes": plan.lower_bound_bytes,
                "naive_bytes": naive_elems * 4,
                "hgraph_max_rank_bytes": plan.max_rank_bytes,
                "hgraph_s": ours_s, "naive_s": theirs_s,
                "values_match": ours is None and theirs is None or bool(torch.equal(ours, theirs)),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs="+", default=[256, 1024], help="square tensor sizes")
    parser.add_argument("--reps", type=int, default=25)
    args = parser.parse_args()
    from hgraph.runtime.launch import launch

    start = time.perf_counter()
    per_rank = launch(_rank_main, len(WORLD), args=(args.size, args.reps), timeout=300)
    rows = per_rank[0]
    for group in ("same_group", "cross_group"):
        for i, row in enumerate(rows[group]):
            row["values_match"] = [other[group][i]["values_match"] for other in per_rank]
    for row in rows["same_group"]:
        row["bytes_ratio_hgraph_over_dtensor"] = _ratio(row["hgraph_bytes"], row["dtensor_bytes"])
        row["time_ratio_hgraph_over_dtensor"] = _ratio(row["hgraph_s"], row["dtensor_s"])
    for row in rows["cross_group"]:
        row["bytes_ratio_hgraph_over_naive"] = _ratio(row["hgraph_bytes"], row["naive_bytes"])
        row["time_ratio_hgraph_over_naive"] = _ratio(row["hgraph_s"], row["naive_s"])
    rows.update({
        "world_size": len(WORLD), "backend": "gloo", "dtype": "float32", "reps": args.reps,
        "torch": torch.__version__, "wall_s": round(time.perf_counter() - start, 1),
    })
    print(json.dumps(rows, indent=1))


def _ratio(a: float, b: float):
    return None if b == 0 else round(a / b, 4)


if __name__ == "__main__":
    main()
