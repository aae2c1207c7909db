"""Pipeline time under each schedule (the timed replay) against hand-computed timelines and the 1F1B
formula."""

import pytest

from hgraph.errors import PlanError
from hgraph.schedule.bubble import replay_time


def test_one_f_one_b_two_stages_by_hand():
    # F = 1, B = 2 on both stages, 2 micro-batches: stage 1 runs F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7];
    # stage 0 then B0 [4,6], B1 [7,9]
    t = replay_time([[1, 1], [1, 1]], [[2, 2], [2, 2]])
    assert t.total == 9 and t.busy == (6, 6)
    assert t.bubble == pytest.approx(1 - 6 / 9)


def test_zero_bubble_two_stages_by_hand():
    # I = W = 1: stage 1 F0 [1,2] I0 [2,3] W0 [3,4] F1 [4,5] I1 [5,6] W1 [6,7];
    # stage 0 F0 F1 [0,2], I0 [3,4], W0 fills [4,5], I1 [6,7], W1 [7,8]
    assert replay_time([[1, 1], [1, 1]], [[2, 2], [2, 2]], schedule="zb1p").total == 8


def test_interleaved_two_stages_two_chunks_by_hand():
    # each chunk half a stage: F = 0.5, B = 1 per virtual stage; worked out step by step: 7.5 (1F1B: 9)
    t = replay_time([[0.5] * 2] * 4, [[1.0] * 2] * 4, pp=2, schedule="interleaved")
    assert t.total == 7.5 and t.busy == (6, 6)


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 5), (3, 4), (4, 8)])
def test_equal_stages_follow_the_one_f_one_b_formula(pp, m):
    # C * (pp - 1 + V) with C = F + B (DESIGN A5)
    assert replay_time([[1.0] * m] * pp, [[2.0] * m] * pp).total == pytest.approx(3.0 * (pp - 1 + m))
    assert replay_time([[1.0] * m] * pp, [[2.0] * m] * pp, schedule="zb1p").total <= 3.0 * (pp - 1 + m)


def test_p2p_latency_adds_to_every_hop():
    assert replay_time([[1], [1]], [[2], [2]], p2p=0.5).total == 6 + 2 * 0.5


def test_bad_inputs_are_plan_errors():
    with pytest.raises(PlanError, match="interleaved"):
        replay_time([[1]] * 4, [[1]] * 4, pp=2)
    with pytest.raises(PlanError, match="at least one micro-batch"):
        replay_time([[]] * 4, [[]] * 4, pp=2, schedule="interleaved")
    with pytest.raises(PlanError, match="schedule 'gpipe'"):
        replay_time([[1]], [[1]], schedule="gpipe")
