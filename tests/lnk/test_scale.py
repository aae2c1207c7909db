"""Pull and Push plans at data-parallel scale (the shapes ``hgraph.compile`` plans at 64 ranks): the
fixed ZeRO layout to a "duplicate" union of many tensor-parallel pipelines and back from their
"partial" gradients. Checked against the independent lower bound and by running the plan on 64
simulated ranks; the plan's cached byte counts must equal those summed from its steps here."""

import torch

from hgraph.core.layout import Layout, LayoutUnion
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.lnk import AllGather, Transfer, is_partial, solve
from hgraph.runtime.kernels.simulate import simulate
from hgraph.core.zero import optimizer_layout
from lnk_cases import check_destination, source_shards
from lower_bound import lower_bound

WORLD, TP, SHAPE = 64, 2, (24, 16)


def pipelines(spec) -> list[Layout]:
    return [Layout(SHAPE, tuple(range(r, r + TP)), (1, TP), spec) for r in range(0, WORLD, TP)]


def check(src, dst) -> None:
    plan = solve(src, dst, itemsize=4)
    bound, exact = lower_bound(src, dst, itemsize=4)
    assert exact and plan.bytes_moved == bound
    moved = 0
    for step in plan.steps:
        if isinstance(step, Transfer):
            moved += torch.Size([b - a for a, b in step.box]).numel()
        assert not isinstance(step, AllGather)
    assert plan.bytes_moved == 4 * moved  # cached on the plan; summed here from its steps
    load = {}
    for step in plan.steps:
        if isinstance(step, Transfer):
            n = torch.Size([b - a for a, b in step.box]).numel()
            load[step.src] = load.get(step.src, 0) + n
            load[step.dst] = load.get(step.dst, 0) + n
    assert plan.max_rank_bytes == 4 * max(load.values())
    gen = torch.Generator().manual_seed(0)
    value = torch.randint(-50, 51, SHAPE, generator=gen).double()
    check_destination(dst, value, simulate(plan, source_shards(src, value, gen)), is_partial(dst))


def test_pull_zero_shard_to_many_pipelines():
    opt = optimizer_layout(SHAPE, WORLD)
    check(opt, LayoutUnion(tuple(pipelines((Replicate(), Shard(1)))), "duplicate"))


def test_push_partial_pipelines_to_zero_shard():
    opt = optimizer_layout(SHAPE, WORLD)
    check(LayoutUnion(tuple(pipelines((Replicate(), Partial()))), "partial"), opt)
    check(LayoutUnion(tuple(pipelines((Replicate(), Replicate()))), "partial"), opt)


def test_rank_index_equals_a_scan_of_the_plan():
    opt = optimizer_layout(SHAPE, WORLD)
    plan = solve(opt, LayoutUnion(tuple(pipelines((Replicate(), Shard(1)))), "duplicate"))
    for rank in range(WORLD):
        scan = tuple((k, s) for k, s in enumerate(plan.steps) if rank in s.ranks)
        assert plan.indexed_steps_for(rank) == scan
        assert plan.steps_for(rank) == tuple(s for _, s in scan)
    phase_a = {k for k, s in enumerate(plan.steps) if isinstance(s, Transfer) and s.phase == "A"}
    assert plan.first_round == frozenset(phase_a)  # one phase of sends: all of them start at once
