"""Solver behaviour beyond the golden plans: validation, caching, sender choice, costs, helpers."""

import pytest
import torch
from hgraph.runtime.kernels.simulate import simulate

from hgraph.errors import CommunicationError, LayoutError
from hgraph.core.layout import Layout, LayoutUnion, replicated, sharded
from hgraph.lnk import LocalCopy, Topology, Transfer, assemble, local_shards, solve

W = (0, 1, 2, 3)


def test_shape_mismatch_names_both_layouts():
    src, dst = sharded((8, 8), W), sharded((8, 6), W)
    with pytest.raises(LayoutError, match=r"\(8, 8\).*\(8, 6\)"):
        solve(src, dst)


def test_partial_destination_needs_partial_source():
    src = sharded((4, 4), W)
    dst = Layout((4, 4), W, (4,), ("P",))
    with pytest.raises(LayoutError, match="Partial destination needs a Partial source"):
        solve(src, dst)


def test_rejects_non_layouts():
    with pytest.raises(LayoutError, match="must be a Layout or LayoutUnion"):
        solve(sharded((4,), W), "S(0)")


def test_plans_are_cached():
    src, dst = sharded((8, 8), W), replicated((8, 8), (4, 5))
    assert solve(src, dst) is solve(src, dst)
    assert solve(src, dst, Topology(ranks_per_node=2)) is not solve(src, dst)


def test_reduce_scatter_not_used_when_result_is_also_replicated():
    # P on mesh dim 1, R on mesh dim 0: reducing once and copying beats two reduce_scatters.
    # Per chunk: reduce_scatter on both replica groups moves 2 * (3 - 1) chunks, the bound 2 + 1.
    six = tuple(range(6))
    src = Layout((6,), six, (2, 3), ("R", "P"))
    dst = Layout((6,), six, (2, 3), ("R", "S(0)"))
    plan = solve(src, dst)
    assert all(isinstance(step, (Transfer, LocalCopy)) for step in plan.steps)
    assert plan.bytes_moved == plan.lower_bound_bytes == 3 * 6 * 4
    same_cost = solve(Layout((6,), W, (2, 2), ("R", "P")), Layout((6,), W, (2, 2), ("R", "S(0)")))
    assert [str(s) for s in same_cost.steps] == [
        "reduce_scatter dim0 group(0,1)",
        "reduce_scatter dim0 group(2,3)",
    ]


def test_sender_on_the_same_node_is_preferred():
    topo = Topology(ranks_per_node=2)
    src = replicated((4, 4), (0, 2))
    dst = replicated((4, 4), (1, 3))
    plan = solve(src, dst, topo)
    assert {(s.src, s.dst) for s in plan.steps} == {(0, 1), (2, 3)}
    assert plan.inter_node_bytes == 0
    far = solve(src, replicated((4, 4), (3, 1)), Topology(ranks_per_node=1))
    assert far.inter_node_bytes == far.bytes_moved == 2 * 4 * 4 * 4


def test_load_is_balanced_across_replicas():
    src = replicated((8, 8), (0, 1))
    dst = sharded((8, 8), (2, 3, 4, 5))
    plan = solve(src, dst)
    senders = sorted(s.src for s in plan.steps)
    assert senders == [0, 0, 1, 1]
    assert plan.max_rank_bytes == 2 * 2 * 8 * 4


def test_reduction_happens_at_a_destination_that_holds_a_term():
    src = Layout((4,), (0, 1, 2), (3,), ("P",))
    dst = replicated((4,), (2, 5))
    plan = solve(src, dst)
    # k = 3 terms, |D| = 2, rank 2 holds a term: (3 - 1) + 2 - 1 = 3 messages of 4 floats.
    assert plan.lower_bound_bytes == plan.bytes_moved == 3 * 4 * 4
    reducer = {s.dst for s in plan.steps if isinstance(s, Transfer) and s.phase == "A"}
    assert reducer == {2}


def test_predicted_time_follows_alpha_beta():
    topo = Topology(ranks_per_node=1, inter_bandwidth=1e9, inter_latency=1e-3)
    plan = solve(sharded((1000,), (0,)), replicated((1000,), (1,)), topo, itemsize=4)
    assert plan.predicted_time_s() == pytest.approx(1e-3 + 4000 / 1e9)
    ag = solve(sharded((1000,), W), replicated((1000,), W), topo)
    # ring all_gather: 3 rounds, each rank sends 750 elements over the slowest link
    assert ag.predicted_time_s() == pytest.approx(3 * 1e-3 + 750 * 4 / 1e9)


def test_local_shards_and_assemble_round_trip():
    value = torch.arange(20.0).reshape(4, 5)
    for layout in (
        Layout((4, 5), W, (2, 2), ("S(1)", "P")),
        LayoutUnion((sharded((3, 5), (0, 1)), replicated((1, 5), (2,))), "split"),
        LayoutUnion((sharded((4, 5), (0, 1), 1), replicated((4, 5), (2,))), "duplicate"),
    ):
        assert torch.equal(assemble(layout, local_shards(layout, value)), value)


def test_simulate_example_zero_pull_and_push():
    tp2_1_1 = (sharded((8, 4), (0, 1)), replicated((8, 4), (2,)), replicated((8, 4), (3,)))
    zero = sharded((8, 4), W)
    weights = torch.arange(32.0).reshape(8, 4)
    pulled = simulate(solve(zero, LayoutUnion(tp2_1_1, "duplicate")), local_shards(zero, weights))
    assert torch.equal(pulled[0], weights[:4]) and torch.equal(pulled[3], weights)
    grads = LayoutUnion(tp2_1_1, "partial")
    shards = {0: weights[:4], 1: weights[4:], 2: weights, 3: 2 * weights}
    pushed = simulate(solve(grads, zero), shards)
    for r in W:
        assert torch.equal(pushed[r], 4 * weights[2 * r : 2 * r + 2])


def test_executor_rejects_a_wrong_local_shape():
    plan = solve(sharded((8,), (0, 1)), replicated((8,), (0, 1)))
    with pytest.raises(CommunicationError, match=r"rank 1 holds .* \(shape \(4,\)\) but was given \(3,\)"):
        simulate(plan, {0: torch.zeros(4), 1: torch.zeros(3)}, timeout=5)


def test_ranks_without_source_get_dtype_of_the_shards():
    plan = solve(sharded((4,), (0,)), replicated((4,), (1, 2)))
    out = simulate(plan, {0: torch.arange(4, dtype=torch.int64)})
    assert out[2].dtype == torch.int64 and out[2].tolist() == [0, 1, 2, 3]


def test_a_reduction_for_several_ranks_is_spread_over_them():
    # P on 4 ranks -> R on 4 others: each destination reduces a quarter and shares it, as a ring would.
    plan = solve(Layout((8, 8), W, (4,), ("P",)), replicated((8, 8), (4, 5, 6, 7)))
    quarter = 2 * 8 * 4
    assert plan.bytes_moved == plan.lower_bound_bytes == (4 - 1 + 4) * 4 * quarter
    assert plan.max_rank_bytes == (4 + 3 + 3) * quarter
    reducers = {s.box: s.dst for s in plan.steps if isinstance(s, Transfer) and s.phase == "A"}
    assert sorted(reducers.values()) == [4, 5, 6, 7]
