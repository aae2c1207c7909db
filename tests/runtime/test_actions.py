"""The action IR: golden pipeline lowerings, string round-trip, and the dry run catching a deadlock
and a mismatched order."""

import pytest

from hgraph.schedule.actions import Action, Kind, ScheduleError, format_actions, parse
from hgraph.schedule.lowerings import (
    LOWERINGS,
    PIPELINE_SCHEDULES,
    PLACEMENTS,
    PullPushOrder,
    blocking_order,
    interleaved_1f1b,
    lowering_name,
    one_f_one_b,
    place,
    zero_bubble_h1,
)
from hgraph.schedule.replay import dry_run, dry_run_pipeline


def line(actions):
    return " ".join(map(str, actions))


def test_golden_one_f_one_b_two_stages_four_micro_batches():
    assert line(one_f_one_b(2, 1, 0, 4)) == (
        "0.0F 0.0SEND_ACT>1 0.1F 0.1SEND_ACT>1 0.0RECV_GRAD<1 0.0B 0.2F 0.2SEND_ACT>1 0.1RECV_GRAD<1 0.1B "
        "0.3F 0.3SEND_ACT>1 0.2RECV_GRAD<1 0.2B 0.3RECV_GRAD<1 0.3B"
    )
    assert line(one_f_one_b(2, 1, 1, 4)) == (
        "0.0RECV_ACT<0 0.0F 0.0B 0.0SEND_GRAD>0 0.1RECV_ACT<0 0.1F 0.1B 0.1SEND_GRAD>0 0.2RECV_ACT<0 0.2F 0.2B "
        "0.2SEND_GRAD>0 0.3RECV_ACT<0 0.3F 0.3B 0.3SEND_GRAD>0"
    )


def test_golden_zero_bubble_h1_fills_the_cool_down_with_weight_steps():
    # stage 0 of 2: W of micro-batch 0 waits until the memory of 1F1B is reached; in the cool-down a
    # W runs before waiting for the next gradient (where 1F1B idles)
    assert line(zero_bubble_h1(2, 1, 0, 3)) == (
        "0.0F 0.0SEND_ACT>1 0.1F 0.1SEND_ACT>1 0.0RECV_GRAD<1 0.0I 0.0W 0.2F 0.2SEND_ACT>1 0.1RECV_GRAD<1 0.1I "
        "0.1W 0.2RECV_GRAD<1 0.2I 0.2W"
    )


def test_listing_puts_one_exchange_on_one_line():
    listing = format_actions(one_f_one_b(2, 1, 0, 2)).splitlines()
    assert listing[3].split(None, 1) == ["3", "0.1SEND_ACT>1 + 0.0RECV_GRAD<1"]


SCHEDULES = [("1f1b", 1), ("zb1p", 1), ("1f1b", 2), ("1f1b", 3)]


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_lowering_completes_and_bounds_memory(schedule, vpp, pp, m):
    dry_run_pipeline(schedule, pp, vpp, m)
    for stage in range(pp):
        actions = LOWERINGS[lowering_name(schedule, vpp)](pp, vpp, stage, m)
        for chunk in range(vpp):
            for kinds in ([Kind.FORWARD], [Kind.BACKWARD, Kind.BACKWARD_INPUT], [Kind.BACKWARD, Kind.BACKWARD_WEIGHT]):
                mbs = [a.mb for a in actions if a.kind in kinds and a.chunk == chunk]
                assert mbs == list(range(m)), (stage, chunk, kinds, line(actions))
        if vpp == 1:  # 1F1B memory: at most pp - stage micro-batches between forward and (weight) backward
            held, peak = 0, 0
            for a in actions:
                held += {Kind.FORWARD: 1, Kind.BACKWARD: -1, Kind.BACKWARD_WEIGHT: -1}.get(a.kind, 0)
                peak = max(peak, held)
            assert peak == min(pp - stage, m), (stage, line(actions))


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
def test_string_form_round_trips(schedule, vpp):
    actions = interleaved_1f1b(2, vpp, 1, 4) if vpp > 1 else LOWERINGS[schedule](4, 1, 1, 6)
    actions += [Action(Kind.PULL_START, group="layers.0.q.weight"), Action(Kind.PULL_WAIT, group="layers.0.q.weight"),
                Action(Kind.PUSH_START, group="w"), Action(Kind.PUSH_WAIT, group="w"), Action(Kind.OPTIMIZER)]
    assert [parse(str(a)) for a in actions] == actions


@pytest.mark.parametrize("text", ["SEND_X1", "0.1F>2", "0.1SEND_ACT<2", "0.1RECV_GRAD", "PULL_BEGIN:w", "F3"])
def test_bad_action_text_is_rejected(text):
    with pytest.raises(ScheduleError, match="action"):
        parse(text)


def _stages(*lines):
    return {s: [parse(x) for x in text.split()] for s, text in enumerate(lines)}


def test_dry_run_catches_a_deadlock_and_names_rank_action_and_peer():
    programs = _stages(line(one_f_one_b(2, 1, 0, 2)), "0.1RECV_ACT<0 0.1F 0.0RECV_ACT<0 0.0F 0.0B 0.0SEND_GRAD>0 0.1B 0.1SEND_GRAD>0")
    with pytest.raises(ScheduleError, match="order mismatch: rank 1 waits at 0.1RECV_ACT<0 but rank 0 sent 0.0SEND_ACT>1"):
        dry_run(programs, first=lambda r, c: r == 0, last=lambda r, c: r == 1)
    # stage 0 waits for the gradient before it sends the activation stage 1 needs to make it
    programs = _stages("0.0F 0.0RECV_GRAD<1 0.0B 0.0SEND_ACT>1", "0.0RECV_ACT<0 0.0F 0.0B 0.0SEND_GRAD>0")
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 waits at 0.0RECV_GRAD<1 \(peer rank 1\); "
                                            r"rank 1 waits at 0.0RECV_ACT<0 \(peer rank 0\)"):
        dry_run(programs, first=lambda r, c: r == 0, last=lambda r, c: r == 1)


def test_dry_run_catches_swapped_collectives():
    members = lambda rank, group: (0, 1)  # noqa: E731
    good = [parse(x) for x in "PULL_START:a PULL_WAIT:a PULL_START:b PULL_WAIT:b".split()]
    dry_run({0: good, 1: good}, members)
    swapped = [parse(x) for x in "PULL_START:b PULL_WAIT:b PULL_START:a PULL_WAIT:a".split()]
    with pytest.raises(ScheduleError, match="collective order mismatch on ranks \\[0, 1\\] at position 0: rank 1 "
                                            "starts PULL_START:b, rank 0 starts PULL_START:a"):
        dry_run({0: good, 1: swapped}, members)


def test_dry_run_waits_of_plans_with_later_rounds_need_the_peer_at_its_wait():
    """Two pulls started on both ranks, waited in opposite orders: fine if their plans finish at the
    start, a deadlock when the waits still exchange with the peer (rounds issued by ``wait``)."""
    members = lambda rank, group: (0, 1)  # noqa: E731
    rank0 = [parse(x) for x in "PULL_START:a PULL_START:b PULL_WAIT:a PULL_WAIT:b".split()]
    rank1 = [parse(x) for x in "PULL_START:a PULL_START:b PULL_WAIT:b PULL_WAIT:a".split()]
    dry_run({0: rank0, 1: rank1}, members)
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits at PULL_WAIT:a; rank 1 waits at PULL_WAIT:b"):
        dry_run({0: rank0, 1: rank1}, members, late=lambda rank, a: (1 - rank,))


def test_attached_actions_round_trip_and_list():
    text = "PULL_START:embed.weight 0.0F PULL_WAIT:embed.weight@embed.weight 0.0B PUSH_START:w@w PUSH_WAIT:w"
    actions = [parse(x) for x in text.split()]
    assert actions[2] == Action(Kind.PULL_WAIT, group="embed.weight", at="embed.weight")
    assert line(actions) == text


def test_interleaved_takes_any_number_of_micro_batches():
    """Three micro-batches on pp=2: the schedule of four with micro-batch 3 left out on both stages."""
    for stage in range(2):
        four = [a for a in interleaved_1f1b(2, 2, stage, 4) if a.mb != 3]
        assert [str(a) for a in interleaved_1f1b(2, 2, stage, 3)] == [str(a) for a in four]
    assert line(interleaved_1f1b(2, 2, 1, 1)) == (
        "0.0RECV_ACT<0 0.0F 0.0SEND_ACT>0 1.0RECV_ACT<0 1.0F 1.0B 1.0SEND_GRAD>0 0.0RECV_GRAD<0 0.0B 0.0SEND_GRAD>0"
    )
    with pytest.raises(ScheduleError, match="at least one micro-batch; got 0"):
        interleaved_1f1b(2, 2, 0, 0)


def test_one_vocabulary_of_schedules():
    """The config, the planner's terms and the bubble read the one registry's names."""
    from hgraph.errors import CostModelError
    from hgraph.planner.terms import StrategyTerms
    from hgraph.cli.command import build_parser
    from hgraph.program.options import ScheduleConfig

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    assert next(a for a in train._actions if "--schedule" in a.option_strings).choices == PLACEMENTS
    for name in PIPELINE_SCHEDULES:
        assert ScheduleConfig(pipeline=name).pipeline == name  # the [compile.schedule] key takes every schedule
    assert set(PIPELINE_SCHEDULES) < set(LOWERINGS) and lowering_name("1f1b", 2) == "interleaved"
    assert [lowering_name(s, 1) for s in PIPELINE_SCHEDULES] == list(PIPELINE_SCHEDULES)
    with pytest.raises(ScheduleError, match="pipeline_schedule='gpipe'; expected one of 1f1b, zb1p"):
        lowering_name("gpipe", 1)
    with pytest.raises(ScheduleError, match="vpp > 1 runs 'interleaved'"):
        LOWERINGS["zb1p"](2, 2, 0, 4)
    with pytest.raises(CostModelError, match="expected one of none, overlap"):
        StrategyTerms("tp1", "fast", 1.0, 1.0, 1.0, 0.0, 0.0)


def test_placing_the_blocking_order_is_pulls_pipeline_pushes_optimizer():
    pipeline = one_f_one_b(2, 1, 0, 2)
    out = place(pipeline, blocking_order(["a", "b"], ["g"]))
    assert line(out) == "PULL_START:a PULL_WAIT:a PULL_START:b PULL_WAIT:b " + line(pipeline) + \
        " PUSH_START:g PUSH_WAIT:g OPTIMIZER"


def test_placing_an_overlap_order_attaches_to_the_first_forward_and_the_last_backward():
    order = PullPushOrder(
        prelude=(parse("PULL_START:a"),),
        forward=(parse("PULL_START:b@a"), parse("PULL_WAIT:a@a"), parse("PULL_WAIT:b")),
        backward=(parse("PUSH_START:g@g"),),
        end=(parse("PUSH_WAIT:g"),),
    )
    out = place(one_f_one_b(1, 1, 0, 2), order)
    assert line(out) == ("PULL_START:a 0.0F PULL_START:b@a PULL_WAIT:a@a PULL_WAIT:b 0.0B 0.1F 0.1B "
                         "PUSH_START:g@g PUSH_WAIT:g OPTIMIZER")
    # no forward or backward on this rank: those actions run detached after the pipeline
    detached = "PULL_START:a PULL_START:b PULL_WAIT:a PULL_WAIT:b PUSH_START:g PUSH_WAIT:g OPTIMIZER"
    assert line(place([], order)) == detached
