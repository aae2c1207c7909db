"""The simulator: 1F1B pipeline time, Pull/Push exposure, plan checks."""

import pytest

from hgraph.errors import PlanError
from hgraph.core.strategy import Strategy
from hgraph.planner.plan import IterationPlan, PipelinePlan
from hgraph.planner.timing import AlphaBetaComm, PipelineCost, check_plan, exposed_comm_ms, predict


def test_pipeline_time_is_sum_plus_bubble_of_the_heaviest_micro_batch():
    cost = PipelineCost(a=0.0, b=1.0, c=10.0, pp=3, max_len=100)
    # micro-batch times 5+5+10 = 20 and 20+10 = 30: 50 + (3-1)*30
    assert cost.time([[5, 5], [20]]) == pytest.approx(110.0)
    assert cost.time([]) == 0.0


def test_quadratic_term_is_per_sequence():
    cost = PipelineCost(a=1.0, b=0.0, c=0.0, pp=1, max_len=100)
    assert cost.micro_batch_time([3, 4]) == pytest.approx(25.0)  # 9 + 16, not 49


def test_exposed_comm_is_one_layer_or_what_compute_cannot_hide():
    assert exposed_comm_ms(100.0, 1000.0, 10) == pytest.approx(10.0)
    assert exposed_comm_ms(100.0, 50.0, 10) == pytest.approx(50.0)
    assert exposed_comm_ms(0.0, 50.0, 10) == 0.0


def test_alpha_beta_comm_scales_with_the_stage_shard():
    comm = AlphaBetaComm.for_model(4096, 32, 32000, alpha_ms=0.0)
    s = Strategy.parse("tp4 + 2x tp2")
    assert comm.pull_push_ms(s, 1) == pytest.approx(2 * comm.pull_push_ms(s, 0))
    expected = 2 * 2.0 * comm.param_count / 4 / 300e9 * 1e3  # one node: NVLink figure
    assert comm.pull_push_ms(s, 0) == pytest.approx(expected)
    assert comm.pull_push_ms(Strategy.parse("tp1"), 0) == 0.0


def _plan(micro_batches, lengths, cost):
    s = Strategy.parse("tp1")
    pp = PipelinePlan(s.pipelines[0], cost, micro_batches, tuple(tuple(lengths[i] for i in mb) for mb in micro_batches))
    return IterationPlan(s, (pp,), tuple(lengths), tuple((i, 0) for i in range(len(lengths))), 0.0, 0.0)


def test_predict_and_check_plan():
    cost = PipelineCost(a=0.0, b=1.0, c=1.0, pp=1, max_len=10)
    plan = _plan(((0, 1), (2,)), [4, 5, 7], cost)
    assert predict(plan) == pytest.approx(9 + 1 + 7 + 1)
    check_plan(plan, [4, 5, 7])
    with pytest.raises(PlanError, match="more than its MaxLen 10"):
        check_plan(_plan(((0, 1, 2),), [4, 5, 7], cost), [4, 5, 7])
    with pytest.raises(PlanError, match="each must appear once"):
        check_plan(_plan(((0, 1), (1,)), [4, 5, 7], cost), [4, 5, 7])


def test_pipeline_cost_follows_the_pipeline_schedule_through_the_bubble_replay():
    from hgraph.schedule.bubble import replay_time as replay

    mbs = [[10]] * 4  # four micro-batches of one 10-token sequence, stage time 10 + 2 = 12 ms
    one_f_one_b = PipelineCost(a=0.0, b=1.0, c=2.0, pp=2, max_len=100)
    zero_bubble = PipelineCost(a=0.0, b=1.0, c=2.0, pp=2, max_len=100, schedule="zb1p")
    interleaved = PipelineCost(a=0.0, b=1.0, c=2.0, pp=2, max_len=100, vpp=2)
    assert one_f_one_b.time(mbs) == 4 * 12 + 12  # Σ T + (pp − 1)·max T
    # hand-computed from the replay's inputs: forward 4 ms, backward 8 ms per micro-batch and stage
    fwd, bwd = [[4.0] * 4] * 2, [[8.0] * 4] * 2
    assert zero_bubble.time(mbs) == replay(fwd, bwd, pp=2, schedule="zb1p").total < one_f_one_b.time(mbs)
    half_f, half_b = [[2.0] * 4] * 4, [[4.0] * 4] * 4
    assert interleaved.time(mbs) == replay(half_f, half_b, pp=2, schedule="interleaved").total < one_f_one_b.time(mbs)
    # three micro-batches: the runtime's schedule of four with the last left out, no longer refused
    odd = interleaved.time([[10]] * 3)
    assert odd == replay([[2.0] * 3] * 4, [[4.0] * 3] * 4, pp=2, schedule="interleaved").total
    assert interleaved.time([[10]] * 2) < odd < interleaved.time(mbs)
