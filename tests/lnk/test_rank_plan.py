"""Per-rank plans (``solve_rank``) equal the full plan's steps of that rank, for every rank: order,
peers, boxes, first-round membership and byte totals. The oracle is the full solver's plan (built
over all ranks); the cases are the LNK generators of ``lnk_cases`` and the compile-scale Pull/Push
shapes, where the local rules (not the fallback to the full plan) must answer."""

import pytest
from hypothesis import HealthCheck, given, settings

from hgraph.core.layout import Layout, LayoutUnion
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.errors import LayoutError
from hgraph.lnk import solve, solve_rank
from hgraph.core.zero import optimizer_layout
from lnk_cases import one_dim_changes, transitions


def check_every_rank(src, dst, itemsize: int = 8) -> list[bool]:
    full = solve(src, dst, itemsize=itemsize)
    local = []
    for rank in range(max(full.ranks, default=-1) + 2):  # one rank past the plan takes no part
        view = solve_rank(src, dst, rank, itemsize=itemsize)
        indexed = full.indexed_steps_for(rank)
        assert view.steps == tuple(s for _, s in indexed), f"rank {rank}\n{view}\n{full}"
        assert view.first_round == {i for i, (k, _) in enumerate(indexed) if k in full.first_round}
        assert (view.bytes_moved, view.lower_bound_bytes, view.noop) == (
            full.bytes_moved, full.lower_bound_bytes, full.noop)
        local.append(view.local)
    return local


_settings = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=300, **_settings)
@given(transitions())
def test_rank_views_equal_the_full_plan(case):
    check_every_rank(*case)


@settings(max_examples=150, **_settings)
@given(one_dim_changes())
def test_rank_views_equal_the_full_plan_one_dim(case):
    check_every_rank(*case)


@pytest.mark.slow
@settings(max_examples=3000, **_settings)
@given(transitions())
def test_rank_views_equal_the_full_plan_many(case):
    check_every_rank(*case)


WORLD = 64


def pipelines(shape, tp: int, spec) -> LayoutUnion:
    parts = [Layout(shape, tuple(range(r, r + tp)), (1, tp), spec) for r in range(0, WORLD, tp)]
    return LayoutUnion(tuple(parts), "duplicate" if not any(isinstance(p, Partial) for p in spec) else "partial")


@pytest.mark.parametrize("shape", [(24, 16), (96, 8), (8,)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_compile_scale_pull_and_push_answer_locally(shape, tp):
    opt = optimizer_layout(shape, WORLD)
    shard = (Replicate(), Shard(len(shape) - 1))
    assert all(check_every_rank(opt, pipelines(shape, tp, shard), 4))  # Pull to sharded tp copies
    assert all(check_every_rank(opt, pipelines(shape, tp, (Replicate(), Replicate())), 4))  # replicated
    assert all(check_every_rank(pipelines(shape, tp, (Replicate(), Partial())), opt, 4))  # Push of partial sums
    grads = LayoutUnion(pipelines(shape, tp, shard).layouts, "partial")
    assert all(check_every_rank(grads, opt, 4))  # Push of sharded gradients


@pytest.mark.parametrize("world, tp, shape", [(64, 2, (8,)), (64, 4, (8,)), (64, 2, (96, 8)), (16, 8, (5, 3))])
def test_replicated_gradients_tied_on_load_are_replayed_per_group(world, tp, shape):
    """tp ranks holding the same gradient on one node: the solver sends from the least loaded of
    them, which each rank's view replays from its group's loads alone (and still equals the plan)."""
    parts = [Layout(shape, tuple(range(r, r + tp)), (1, tp), (Replicate(), Replicate())) for r in range(0, world, tp)]
    assert all(check_every_rank(LayoutUnion(tuple(parts), "partial"), optimizer_layout(shape, world), 4))


def test_load_ties_that_need_other_ranks_loads_fall_back_to_the_full_plan():
    """A Pull from a replicated source with several holders per node: the sender is the least loaded
    over the whole plan, so the views are cut from the full plan (and equal it)."""
    src = Layout((8, 4), tuple(range(4)), (4,), (Replicate(),))
    dst = LayoutUnion(tuple(Layout((8, 4), (r,), (1,), (Replicate(),)) for r in range(4, 8)), "duplicate")
    assert not any(check_every_rank(src, dst, 4))


def test_a_rank_view_answers_only_for_its_rank():
    opt = optimizer_layout((24, 16), WORLD)
    view = solve_rank(opt, pipelines((24, 16), 2, (Replicate(), Replicate())), 3)
    with pytest.raises(LayoutError, match="rank 3's steps"):
        view.indexed_steps_for(4)
