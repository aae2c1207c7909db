"""Timeline: exposed-communication arithmetic, Chrome trace JSON, Gantt PNG, Trainer recording."""

import json

import pytest
import torch

import hgraph
from hgraph.errors import InputError
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.timeline import (
    Event,
    Timeline,
    chrome_trace,
    exposed_communication,
    plot_gantt,
    summary,
    write_chrome_trace,
)
from hgraph.training.trainer import Trainer
from hgraph.program.options import OverlapConfig
from hgraph.training.configs import RunConfig


def ev(rank, kind, start, end, iteration=0):
    return Event(rank, kind, kind, float(start), float(end), iteration)


def test_exposed_communication_on_hand_made_intervals():
    events = [
        # rank 0, iteration 0: compute [0,4) and [6,8); comm [3,7) and [7.5,10) -> exposed [4,6) + [8,10)
        ev(0, "forward", 0, 4),
        ev(0, "backward", 6, 8),
        ev(0, "pull_parameter", 3, 7),
        ev(0, "push_gradient", 7.5, 10),
        ev(0, "wait", 8, 10),  # a wait is neither compute nor communication
        # rank 0, iteration 1: overlapping comm intervals count once: [0,5) minus compute [1,2)
        ev(0, "pull_parameter", 0, 3, 1),
        ev(0, "communicate_activation", 2, 5, 1),
        ev(0, "forward", 1, 2, 1),
        # rank 1: comm entirely inside compute
        ev(1, "forward", 0, 10),
        ev(1, "push_gradient", 2, 3),
        ev(1, "push_gradient", 4, 9),
    ]
    got = exposed_communication(events)
    assert got == {0: {0: pytest.approx(4.0), 1: pytest.approx(4.0)}, 1: {0: pytest.approx(0.0)}}
    # only pulls: [3,7) minus compute -> [4,6) on iteration 0; [0,3) minus [1,2) on iteration 1
    pulls = exposed_communication(events, ("pull_parameter",))
    assert pulls[0] == {0: pytest.approx(2.0), 1: pytest.approx(2.0)}
    with pytest.raises(InputError, match="forward"):
        exposed_communication(events, ("forward",))
    row = summary(events)[0][0]
    assert row["span"] == pytest.approx(10.0)
    assert row["compute"] == pytest.approx(6.0)
    assert row["communication"] == pytest.approx(6.5)
    assert row["wait"] == pytest.approx(2.0)


def test_bad_kind_is_rejected():
    with pytest.raises(InputError, match="kind"):
        Timeline(0).add("sleep", "x", 0.0, 1.0)
    with pytest.raises(InputError, match="no timeline events"):
        chrome_trace([])


@pytest.fixture(scope="module")
def trainer_events():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=2, kv_heads=4))
    example = torch.randint(0, 256, (1, 16))
    compiled = hgraph.compile(model, ["tp2,pp2"], example_inputs=example,
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig())))
    batch = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 17, 30, 12)]

    def body(comm):
        trainer = Trainer(compiled, comm=comm, run=RunConfig(micro_batch_tokens=32, timeline=True))
        trainer.step(batch)
        trainer.step(batch)
        return trainer.gather_timeline()

    return run_threads(body, 4)


def test_trainer_records_every_rank_and_kind(trainer_events):
    events = trainer_events[0]
    assert all(not e for e in trainer_events[1:])  # gathered on rank 0 only
    assert {e.rank for e in events} == {0, 1, 2, 3}
    assert {e.iteration for e in events} == {0, 1}
    kinds = {e.kind for e in events}
    assert {"forward", "backward", "pull_parameter", "push_gradient", "communicate_activation"} <= kinds
    assert all(e.end >= e.start for e in events)
    exposed = exposed_communication(events)
    assert set(exposed) == {0, 1, 2, 3} and all(set(v) == {0, 1} for v in exposed.values())


def test_chrome_trace_is_valid_json_with_every_rank(trainer_events, tmp_path):
    path = write_chrome_trace(trainer_events[0], str(tmp_path / "trace.json"))
    with open(path) as f:
        trace = json.load(f)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert {e["tid"] for e in spans} == {0, 1}  # compute and comm tracks
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [e["args"]["name"] for e in names] == ["rank 0", "rank 1", "rank 2", "rank 3"]


def test_gantt_png(trainer_events, tmp_path):
    path = plot_gantt(trainer_events[0], str(tmp_path / "gantt.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_blocking_schedule_records_too():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=2, kv_heads=4))
    compiled = hgraph.compile(model, ["2x tp1"], example_inputs=torch.randint(0, 256, (1, 16)))
    batch = [torch.arange(12) % 256, torch.arange(20) % 256]

    def body(comm):
        trainer = Trainer(compiled, comm=comm, run=RunConfig(timeline=True))
        trainer.step(batch)
        return trainer.timeline.events

    events = run_threads(body, 2)
    for evs in events:
        assert {e.kind for e in evs} >= {"forward", "backward", "pull_parameter", "push_gradient"}
        # blocking: pulls end before the first forward starts and pushes start after the last backward
        first_f = min(e.start for e in evs if e.kind == "forward")
        last_b = max(e.end for e in evs if e.kind == "backward")
        assert max(e.end for e in evs if e.kind == "pull_parameter") <= first_f
        assert min(e.start for e in evs if e.kind == "push_gradient") >= last_b
    with pytest.raises(InputError, match="timeline=True"):
        run_threads(lambda comm: Trainer(compiled, comm=comm).gather_timeline(), 2)
