"""Property tests: on random layouts and unions, simulate produces a valid destination (checked from
the layouts' definition) and every plan moves exactly the independent lower bound of
``lower_bound.py`` (computed from the two layouts alone, not by the solver)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from hgraph.lnk import is_partial, solve
from hgraph.runtime.kernels.simulate import simulate
from lnk_cases import check_destination, one_dim_changes, source_shards, transitions
from lower_bound import lower_bound


def check_transition(src, dst, seed: int) -> None:
    plan = solve(src, dst, itemsize=8)
    bound, exact = lower_bound(src, dst, itemsize=8)
    assert plan.bytes_moved >= bound, f"below the lower bound {bound}: the bound or the plan is wrong\n{plan}"
    if exact:
        assert plan.bytes_moved == bound, f"independent lower bound {bound}\n{plan}"
    # consistency check only: the solver's own accounting agrees with the bytes its steps move
    assert plan.bytes_moved == plan.lower_bound_bytes, str(plan)
    gen = torch.Generator().manual_seed(seed)
    value = torch.randint(-50, 51, src.shape, generator=gen).double()
    shards = source_shards(src, value, gen)
    check_destination(dst, value, simulate(plan, shards), is_partial(dst))


_settings = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=300, **_settings)
@given(transitions())
def test_simulate_matches_and_bytes_hit_lower_bound(case):
    check_transition(*case, seed=0)


@settings(max_examples=300, **_settings)
@given(one_dim_changes())
def test_one_mesh_dim_changes(case):
    check_transition(*case, seed=2)


@pytest.mark.slow
@settings(max_examples=3000, **_settings)
@given(transitions())
def test_simulate_matches_and_bytes_hit_lower_bound_many(case):
    check_transition(*case, seed=1)


@pytest.mark.slow
@settings(max_examples=3000, **_settings)
@given(one_dim_changes())
def test_one_mesh_dim_changes_many(case):
    check_transition(*case, seed=3)
