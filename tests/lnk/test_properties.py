"""Property tests: on random layouts and unions, simulate reproduces every destination shard exactly
and every plan moves exactly the lower-bound bytes."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from hgraph.lnk import is_partial, simulate, solve
from lnk_cases import expected_destination, one_dim_changes, source_segments, transitions


def check_transition(src, dst, seed: int) -> None:
    plan = solve(src, dst, itemsize=8)
    assert plan.bytes_moved == plan.lower_bound_bytes, str(plan)
    gen = torch.Generator().manual_seed(seed)
    value = torch.randint(-50, 51, src.shape, generator=gen).double()
    shards, segments = source_segments(src, value, gen)
    got = simulate(plan, shards)
    want = expected_destination(dst, value, segments, is_partial(dst))
    assert set(got) == set(want)
    for rank, tensor in want.items():
        assert torch.equal(got[rank], tensor), f"rank {rank}\n{plan}\ngot {got[rank]}\nwant {tensor}"


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
