"""The planner settles on the best homogeneous strategy where no strategy is really faster, and
switches where one is: planted machines (the measured time of each plan is a function given here,
not the cost model) feed the online correction, as ``Trainer.step`` does."""

import random

import pytest

from hgraph.core.strategy import Strategy
from hgraph.planner.assign import Planner
from hgraph.planner.settling import EXPLORE_EVERY, PROBE_ROUNDS
from hgraph.planner.correction import OnlineCorrection
from hgraph.planner.terms import AlphaBeta, IterationTerms, StrategyTerms
from tests.planner.test_fidelity import cost_model

CANDIDATES = ["4x tp1", "2x tp2", "tp2 + 2x tp1", "2x tp1,pp2"]
HOMOGENEOUS = {"4x tp1", "2x tp2", "2x tp1,pp2"}


def _planner() -> Planner:
    terms = IterationTerms(AlphaBeta(0.1, 1e-6), 64.0, 2, {
        (str(Strategy.parse(s)), "none"): StrategyTerms(str(Strategy.parse(s)), "none", 1.0, 1.0, 1.0, 0.5, 0.5)
        for s in CANDIDATES})
    return Planner(cost_model(), CANDIDATES, terms=terms, correction=OnlineCorrection())


def _batches(n: int = 80) -> list[list[int]]:
    rng = random.Random(0)  # lengths over 1.5 orders of magnitude: the cost model predicts gains from mixing
    return [[rng.choice([50, 100, 200, 400, 800, 1600]) for _ in range(rng.randint(2, 8))] for _ in range(n)]


def _run(planner: Planner, measure) -> list[str]:
    picks = []
    for lengths in _batches():
        plan = planner.plan(lengths)
        picks.append(str(plan.strategy))
        planner.observe(plan.prediction, measure(lengths, plan))
    return picks


def _equal(lengths, plan) -> float:
    return 0.01 * sum(lengths) + 5.0  # every strategy takes the same time on a batch


def test_every_strategy_measured_equal_settles_on_one_homogeneous_strategy():
    picks = _run(_planner(), _equal)
    late = picks[10:]
    settled = max(set(late), key=late.count)
    assert settled in HOMOGENEOUS
    # the rest are the runner-up's measurements, EXPLORE_EVERY batches after settling, then after doubling gaps
    assert len(late) - late.count(settled) <= len(late) // EXPLORE_EVERY + 1, picks


def test_without_settling_the_same_planner_would_switch_on_predicted_gains():
    """The control: the cost model alone (no correction, so no settling) mixes strategies on these batches."""
    p = _planner()
    p.correction = None
    assert len({str(p.plan(b).strategy) for b in _batches()}) > 1


@pytest.mark.parametrize("planted", ["2x tp2", "4x tp1"])
def test_a_strategy_planted_2x_slower_than_predicted_is_left(planted):
    """The machine runs every plan in its predicted time, except ``planted``, which takes twice as long."""
    fair = _run(_planner(), lambda lengths, plan: plan.prediction.total_ms)
    slowed = _run(_planner(), lambda lengths, plan: plan.prediction.total_ms * (2 if str(plan.strategy) == planted else 1))
    assert fair.count(planted) >= 5  # a strategy the fair machine uses
    assert slowed[10:].count(planted) <= 0.15 * len(slowed[10:]), slowed
    assert slowed[10:].count(planted) < fair[10:].count(planted)


def test_an_incumbent_planted_2x_slower_on_an_equal_machine_is_left_after_exploring():
    """Every strategy takes the same time except the one settled on, which takes twice as long: only
    the runner-up's occasional measurements can show it; the run moves off within the 80 batches."""
    picks = _run(_planner(), _equal)
    settled = max(set(picks), key=picks.count)
    slowed = _run(_planner(), lambda lengths, plan: _equal(lengths, plan) * (2 if str(plan.strategy) == settled else 1))
    assert settled not in slowed[-10:], slowed


def test_the_settling_state_resumes():
    p = _planner()
    for lengths in _batches(12):
        plan = p.plan(lengths)
        p.observe(plan.prediction, _equal(lengths, plan))
    q = _planner()
    q.load_state_dict(p.state_dict())
    assert q.homogeneous_ms == p.homogeneous_ms and q.incumbent == p.incumbent
    assert q.switch_margin() == p.switch_margin()
    for lengths in _batches(20)[12:]:
        a, b = p.plan(lengths), q.plan(lengths)
        assert str(a.strategy) == str(b.strategy) and a.predicted_ms == b.predicted_ms
        p.observe(a.prediction, _equal(lengths, a))
        q.observe(b.prediction, _equal(lengths, b))


def _as_predicted_for(reference: str, faster: str):
    """A machine where every plan takes what the model predicts for ``reference`` on the batch, and
    ``faster``'s plans 20 % less."""
    model = _planner()
    model.correction = None
    ref = model.candidates.index(Strategy.parse(reference))
    return lambda lengths, plan: model.plan(lengths, only=[ref]).predicted_ms * (0.8 if str(plan.strategy) == faster else 1)


@pytest.mark.parametrize("faster", sorted(HOMOGENEOUS))
def test_probing_finds_the_strategy_that_measures_fastest_whatever_the_model_ranks_first(faster):
    """Every strategy takes the same time except ``faster``, 20 % quicker: after probing (each
    homogeneous candidate measured ``PROBE_ROUNDS`` times) the run settles on it, whichever the
    profiled model ranked first."""
    p = _planner()
    picks = _run(p, _as_predicted_for("2x tp2", faster))
    assert p.probe_iterations == PROBE_ROUNDS * len(HOMOGENEOUS)
    assert sorted(set(picks[:p.probe_iterations])) == sorted(HOMOGENEOUS)  # probing measures each
    late = picks[p.probe_iterations + 12:]
    assert late.count(faster) >= 0.85 * len(late), picks


def test_without_probing_the_model_first_choice_stays_longer():
    """The control: with ``probe_rounds=0`` only the runner-up's exploration every ``EXPLORE_EVERY``
    batches can show that another strategy is faster."""
    fair = _run(_planner(), _equal)
    first = fair[0]
    faster = next(s for s in sorted(HOMOGENEOUS) if s != first)
    p = _planner()
    p.settling.probe_rounds = 0
    picks = _run(p, _as_predicted_for("2x tp2", faster))
    assert picks[:EXPLORE_EVERY].count(faster) <= 2, picks



def test_exploration_gaps_double_so_its_cost_fades_over_a_long_run():
    settling = _planner().settling
    due = []
    for n in range(1, 20 * EXPLORE_EVERY):
        settling.settled_batches = n
        if settling.exploring():
            due.append(n)
    assert due == [EXPLORE_EVERY * 2**j for j in range(5)]  # 16, 32, 64, 128, 256
    settling.explore_every = 0
    assert not settling.exploring()
