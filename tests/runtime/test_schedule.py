"""1F1B schedules: golden action lists, deadlock-free dry runs, and detection of a broken order."""

import pytest

from hgraph.runtime.schedule import ScheduleError, dry_run, format_schedule, one_f_one_b, parse_step


def test_golden_two_stages_four_micro_batches():
    assert format_schedule(one_f_one_b(2, 0, 4)) == (
        "0F SEND_F0 1F SEND_F1+RECV_B0 0B 2F SEND_F2+RECV_B1 1B 3F SEND_F3+RECV_B2 2B RECV_B3 3B"
    )
    assert format_schedule(one_f_one_b(2, 1, 4)) == (
        "RECV_F0 0F 0B SEND_B0+RECV_F1 1F 1B SEND_B1+RECV_F2 2F 2B SEND_B2+RECV_F3 3F 3B SEND_B3"
    )


def test_single_stage_alternates_forward_and_backward():
    assert format_schedule(one_f_one_b(1, 0, 3)) == "0F 0B 1F 1B 2F 2B"


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_every_schedule_runs_to_completion(pp, m):
    schedules = [one_f_one_b(pp, s, m) for s in range(pp)]
    dry_run(schedules)
    for steps in schedules:
        forwards = [a.mb for st in steps for a in st.actions if a.kind == "F"]
        backwards = [a.mb for st in steps for a in st.actions if a.kind == "B"]
        assert forwards == list(range(m)) and backwards == list(range(m))
    for stage, steps in enumerate(schedules):
        # 1F1B memory bound: stage s holds at most pp - s micro-batches whose forward ran and whose
        # backward has not (their activations), and reaches that bound when there are enough
        in_flight, peak = 0, 0
        for action in (a for st in steps for a in st.actions if a.kind in "FB"):
            in_flight += 1 if action.kind == "F" else -1
            peak = max(peak, in_flight)
            assert 0 <= in_flight <= pp - stage, f"stage {stage}: {format_schedule(steps)}"
        assert peak == min(pp - stage, m), f"stage {stage}: {format_schedule(steps)}"


def test_string_form_round_trips():
    steps = one_f_one_b(4, 1, 6)
    assert [parse_step(str(s)) for s in steps] == steps


def test_dry_run_catches_a_deadlock():
    good = one_f_one_b(2, 0, 2)
    bad = [parse_step(x) for x in "RECV_F1 1F RECV_F0 0F 0B SEND_B0 1B SEND_B1".split()]
    with pytest.raises(ScheduleError, match="deadlock"):
        dry_run([good, bad])


def test_bad_step_text_is_rejected():
    with pytest.raises(ScheduleError):
        parse_step("SEND_X1")
