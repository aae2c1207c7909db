"""Per-iteration assignment: packing, dispatch, candidate choice, exact mode and its gap."""

import random
import statistics

import pytest
from hypothesis import given, settings, strategies as st

from hgraph.errors import CostModelError, PlanError
from hgraph.planner.assign import Planner
from hgraph.planner.cost import CostModel
from hgraph.planner.dispatch import Assigner, lower_bound
from hgraph.planner.exact import solve_joint
from hgraph.planner.packing import pack
from hgraph.planner.timing import PipelineCost, check_plan, predict


@pytest.fixture(scope="module")
def llama7b():
    return CostModel.preset("llama7b_a800")


def test_pack_pp1_uses_as_few_micro_batches_as_fit():
    cost = PipelineCost(a=0.0, b=1.0, c=10.0, pp=1, max_len=100)
    bins, t = pack(cost, [60, 40, 50, 50, 30])
    assert sorted(sorted(sum([60, 40, 50, 50, 30][i] for i in b) for b in bins)) == [30, 100, 100]
    assert t == pytest.approx(230 + 3 * 10)


def test_pack_pp4_trades_micro_batch_overhead_against_the_bubble():
    # 8 sequences of work 10, c = 10, pp = 4: V=1 -> 360, V=2 -> 250, V=4 -> 210, V=8 -> 220
    cost = PipelineCost(a=0.0, b=1.0, c=10.0, pp=4, max_len=1000)
    bins, t = pack(cost, [10] * 8)
    assert t == pytest.approx(210.0)
    assert sorted(len(b) for b in bins) == [2, 2, 2, 2]


def test_pack_respects_max_len_and_rejects_longer_sequences():
    cost = PipelineCost(a=1e-6, b=0.01, c=1.0, pp=2, max_len=100)
    bins, _ = pack(cost, [90, 20, 80, 10, 50])
    assert all(sum([90, 20, 80, 10, 50][i] for i in b) <= 100 for b in bins)
    with pytest.raises(PlanError, match="101 tokens exceeds this pipeline's MaxLen 100"):
        pack(cost, [101])


def test_dispatch_balances_identical_pipelines_exactly():
    cost = PipelineCost(a=0.0, b=1.0, c=0.0, pp=1, max_len=100)
    packs, times = Assigner([cost, cost], [50, 30, 20, 40, 60]).run()
    assert times == [pytest.approx(100.0), pytest.approx(100.0)]


def test_dispatch_puts_the_long_sequence_on_the_pipeline_that_can_hold_it():
    wide = PipelineCost(a=1e-6, b=0.01, c=5.0, pp=1, max_len=10_000)
    narrow = PipelineCost(a=2e-6, b=0.02, c=5.0, pp=1, max_len=1_000)
    lengths = [8_000, 900, 800, 700]
    packs, _ = Assigner([narrow, wide, narrow], lengths).run()
    assert any(0 in mb for mb in packs[1])


def test_lower_bound_never_exceeds_the_packed_time():
    rng = random.Random(1)
    for _ in range(200):
        cost = PipelineCost(rng.uniform(0, 2e-6), rng.uniform(0.01, 0.1), rng.uniform(0, 50), rng.choice([1, 2, 4, 8]), 4096)
        lengths = [rng.randint(1, 4096) for _ in range(rng.randint(1, 12))]
        times = [cost.seq_time(l) for l in lengths]
        bound = lower_bound(cost, sum(times), sum(lengths), max(times), len(lengths))
        assert bound <= pack(cost, lengths)[1] + 1e-6


def test_planner_chooses_among_candidates_and_checks_its_plan(llama7b):
    lengths = [30_000] + [500] * 40
    planner = Planner(llama7b, ["4x tp1,pp2", "tp4 + 2x tp1,pp2", "2x tp4"])
    plan = planner.plan(lengths)
    check_plan(plan, lengths)
    assert str(plan.strategy) in {"tp4 + 2x tp1,pp2", "2x tp4"}  # tp1,pp2 cannot hold 30K tokens
    assert predict(plan, planner.comm) == pytest.approx(plan.predicted_ms)
    assert "IterationPlan" in str(plan) and "MaxLen" in str(plan)


def test_sequence_longer_than_every_max_len_names_length_and_largest(llama7b):
    planner = Planner(llama7b, ["4x tp1,pp2"])
    with pytest.raises(PlanError, match=rf"200000 tokens exceeds the largest MaxLen {planner.largest_max_len}"):
        planner.plan([200_000, 10])


def test_split_long_cuts_pieces_that_fit(llama7b):
    planner = Planner(llama7b, ["4x tp1,pp2"])
    cap = planner.largest_max_len
    plan = planner.plan([2 * cap + 5, 10], split_long=True)
    assert sorted(plan.lengths) == sorted([cap, cap, 5, 10])
    assert sorted(plan.sources) == [(0, 0), (0, cap), (0, 2 * cap), (1, 0)]
    check_plan(plan, [2 * cap + 5, 10])


def test_bad_inputs_give_clear_errors(llama7b):
    planner = Planner(llama7b, ["4x tp1,pp2"])
    with pytest.raises(PlanError, match="empty batch"):
        planner.plan([])
    with pytest.raises(PlanError, match="sequence 1 has length 0"):
        planner.plan([5, 0])
    with pytest.raises(CostModelError, match="no scheme tp3"):
        Planner(llama7b, ["tp3"])
    with pytest.raises(PlanError, match="at least one candidate"):
        Planner(llama7b, [])


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20_000), min_size=1, max_size=40),
    strategy=st.sampled_from(["4x tp1,pp2", "tp4 + 2x tp1,pp2", "2x tp2,pp2", "tp2,pp2 + tp2 + tp1,pp2"]),
)
def test_every_sequence_is_placed_once_within_max_len(llama7b, lengths, strategy):
    planner = Planner(llama7b, [strategy], comm=None)
    if max(lengths) > planner.largest_max_len:
        with pytest.raises(PlanError):
            planner.plan(lengths)
        return
    plan = planner.plan(lengths)
    check_plan(plan, lengths)  # each once, every micro-batch within its MaxLen
    assert predict(plan) == pytest.approx(plan.predicted_ms)


def _instance(seed):
    rng = random.Random(seed)
    costs = [
        PipelineCost(rng.uniform(0, 2e-6), rng.uniform(0.01, 0.1), rng.uniform(5, 60), rng.choice([1, 2, 4]),
                     rng.choice([4096, 8192, 16384]))
        for _ in range(rng.randint(1, 3))
    ]
    return costs, [rng.randint(100, 4096) for _ in range(rng.randint(3, 7))]


def test_heuristic_within_two_percent_of_the_milp_optimum():
    """The heuristic against the MILP of exact.py (itself checked against exhaustive search in
    test_optimum_oracle.py)."""
    gaps = []
    for seed in range(20):
        costs, lengths = _instance(seed)
        _, heuristic = Assigner(costs, lengths).run()
        _, optimum = solve_joint(costs, lengths)
        assert max(heuristic) >= optimum * (1 - 1e-6)  # the MILP is a true optimum
        gaps.append(max(heuristic) / optimum - 1)
    print(f"gap: max {max(gaps):.4%}, mean {statistics.mean(gaps):.4%}, zero in {gaps.count(0.0)}/{len(gaps)}")
    assert max(gaps) <= 0.02


def test_exact_mode_matches_the_milp(llama7b):
    """Consistency check only: exact mode calls solve_joint; the independent optimum is in
    test_optimum_oracle.py."""
    lengths = [9000, 3000, 2500, 700, 400]
    planner = Planner(llama7b, ["tp2 + tp1,pp2"], comm=None)
    exact = planner.plan(lengths, exact=True)
    check_plan(exact, lengths)
    _, optimum = solve_joint(planner.pipeline_costs[0], lengths)
    assert exact.predicted_ms == pytest.approx(optimum)
    assert planner.plan(lengths).predicted_ms <= optimum * 1.02
    with pytest.raises(PlanError, match="exact mode needs"):
        planner.plan([100] * 60, exact=True)


def test_a_plan_is_the_dispatch_the_runtime_runs(llama7b):
    """One dispatch type: the plan's micro-batches, as sequence indices, survive rank 0's broadcast."""
    from hgraph.planner.plan import Dispatch

    lengths = [random.Random(1).randint(100, 4000) for _ in range(24)]
    plan = Planner(llama7b, ["4x tp1,pp2", "2x tp4"]).plan(lengths)
    d = plan.dispatch(strategy_index=1)
    assert Dispatch.decode(d.encode()) == d and d.strategy_index == 1 and d.predicted_ms == plan.predicted_ms
    for p, mbs in zip(plan.pipelines, d.micro_batches):
        assert [[lengths[i] for i in mb] for mb in mbs] == [list(x) for x in p.micro_batch_lengths]
    assert sorted(i for mbs in d.micro_batches for mb in mbs for i in mb) == list(range(len(lengths)))
    cap = Planner(llama7b, ["4x tp1,pp2"]).largest_max_len
    split = Planner(llama7b, ["4x tp1,pp2"]).plan([2 * cap + 5, 10], split_long=True)
    with pytest.raises(PlanError, match="split sequences"):
        split.dispatch(0)


def test_default_dispatch_packs_first_fit_decreasing():
    from hgraph.planner.dispatch import default_dispatch
    from hgraph.core.strategy import Strategy

    (mbs,) = default_dispatch(Strategy.parse("tp1").pipelines, [5, 30, 12, 20, 8], micro_batch_tokens=40)
    assert mbs == ((1, 4), (3, 2, 0))  # 30+8, then 20+12+5: by hand, longest first into the first bin with room


def test_default_dispatch_gives_an_interleaved_pipeline_whole_rounds_where_it_can():
    from hgraph.planner.dispatch import default_dispatch
    from hgraph.core.strategy import Strategy

    (mbs,) = default_dispatch(Strategy.parse("tp1,pp2,vpp2").pipelines, [30, 10, 10, 10, 10, 9], 32)
    assert len(mbs) == 4 and sorted(i for mb in mbs for i in mb) == list(range(6))  # [10,10,10] was cut
    (mbs,) = default_dispatch(Strategy.parse("tp1,pp2,vpp2").pipelines, [20, 25, 30], 32)
    assert len(mbs) == 3  # one sequence each: the schedule leaves the fourth micro-batch out
    (mbs,) = default_dispatch(Strategy.parse("tp1,pp2").pipelines, [30, 10, 10, 10, 10, 9], 32)
    assert len(mbs) == 3  # 1F1B takes any number: first-fit decreasing as before
