"""Fuzzing: LNK plans on larger random worlds, the planner on random batches, the CLI on garbage files.

Each property has a small default budget and a larger one marked ``slow``.
"""

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hgraph
from hgraph.cli import command as cli
from hgraph.planner import Planner, load_cost_model, propose

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lnk"))
from lnk_cases import transitions  # noqa: E402
from test_properties import check_transition  # noqa: E402

FUZZ = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


# ----------------------------------------------------------------------------- LNK
@settings(max_examples=25, **FUZZ)
@given(transitions(max_ranks=32))
def test_lnk_on_32_rank_worlds(case):
    check_transition(*case, seed=4)


@pytest.mark.slow
@settings(max_examples=400, **FUZZ)
@given(transitions(max_ranks=32))
def test_lnk_on_32_rank_worlds_many(case):
    check_transition(*case, seed=5)


# ----------------------------------------------------------------------------- planner
_COST = load_cost_model("llama7b_a800")
_SAMPLE = [100, 300, 1000, 4000, 16000]
_PLANNERS = {gpus: Planner(_COST, propose(_COST, gpus, _SAMPLE, max_len=16000), refine=1) for gpus in (4, 8)}
_MAX_LEN = {gpus: p.largest_max_len for gpus, p in _PLANNERS.items()}

lengths_lists = st.lists(
    st.one_of(st.integers(1, 512), st.integers(1, 40_000), st.integers(1, 200_000)), min_size=0, max_size=24
)


def check_plan(gpus, lengths, split_long):
    planner = _PLANNERS[gpus]
    try:
        plan = planner.plan(lengths, split_long=split_long)
    except hgraph.errors.PlanError as exc:
        too_long = lengths and max(lengths) > _MAX_LEN[gpus] and not split_long
        assert not lengths or too_long, f"unexpected PlanError for {lengths}: {exc}"
        return
    placed = sorted(i for p in plan.pipelines for mb in p.micro_batches for i in mb)
    assert placed == list(range(len(plan.lengths))), "every piece placed exactly once"
    for p in plan.pipelines:
        for mb, mb_lengths in zip(p.micro_batches, p.micro_batch_lengths):
            assert [plan.lengths[i] for i in mb] == list(mb_lengths)
            assert sum(mb_lengths) <= p.max_len, f"micro-batch {mb_lengths} over MaxLen {p.max_len}"
    covered = {}
    for (seq, start), length in zip(plan.sources, plan.lengths):
        covered.setdefault(seq, []).append((start, length))
    for seq, length in enumerate(lengths):
        pieces = sorted(covered[seq])
        assert pieces[0][0] == 0 and sum(n for _, n in pieces) == length
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:])), "pieces tile the sequence"
    if not split_long:
        assert plan.sources == tuple((i, 0) for i in range(len(lengths)))


@settings(max_examples=30, **FUZZ)
@given(st.sampled_from([4, 8]), lengths_lists, st.booleans())
def test_planner_on_random_batches(gpus, lengths, split_long):
    check_plan(gpus, lengths, split_long)


@pytest.mark.slow
@settings(max_examples=300, **FUZZ)
@given(st.sampled_from([4, 8]), lengths_lists, st.booleans())
def test_planner_on_random_batches_many(gpus, lengths, split_long):
    check_plan(gpus, lengths, split_long)


# ----------------------------------------------------------------------------- CLI
def run_plan_cli(capsys, tmp_path, lengths: bytes = b"100\n2000\n300\n", table=None):
    length_file = tmp_path / "lengths.txt"
    length_file.write_bytes(lengths)
    argv = ["plan", "--gpus", "4", "--lengths", str(length_file), "--tokens-per-iteration", "3000", "--json"]
    if table is not None:
        table_file = tmp_path / "table.json"
        table_file.write_bytes(table)
        argv += ["--cost-table", str(table_file)]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    if code == 0:
        json.loads(out)  # a run that succeeds prints a valid plan
    else:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("hgraph plan: error: "), err
    return code


garbage = st.one_of(
    st.binary(max_size=64),
    st.lists(st.sampled_from([b"12", b"-3", b"0", b"x", b"1e3", b" ", b"\x00", b"\xff", b"1.5", b"\t7",
                              b"99999999999999999999"]), max_size=8).map(lambda parts: b"\n".join(parts)),
)


@settings(max_examples=15, **FUZZ)
@given(garbage)
def test_cli_on_garbage_length_files(capsys, tmp_path_factory, data):
    run_plan_cli(capsys, tmp_path_factory.mktemp("cli"), lengths=data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_TABLE = load_cost_model("llama7b_a800").to_table()


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


_TABLE_PATHS = [p for p in _paths(_TABLE) if p]


@st.composite
def broken_tables(draw):
    """The preset table with a few fields replaced by random JSON (or cut short / not JSON at all)."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "truncate", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    text = json.dumps(_TABLE)
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))].encode()
    table = json.loads(text)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_TABLE_PATHS))
        node = table
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
    return json.dumps(table).encode()


@settings(max_examples=25, **FUZZ)
@given(broken_tables())
def test_cli_on_broken_cost_tables(capsys, tmp_path_factory, table):
    run_plan_cli(capsys, tmp_path_factory.mktemp("cli"), table=table)


@pytest.mark.slow
@settings(max_examples=200, **FUZZ)
@given(broken_tables(), garbage)
def test_cli_on_broken_inputs_many(capsys, tmp_path_factory, table, data):
    run_plan_cli(capsys, tmp_path_factory.mktemp("cli"), lengths=data, table=table)
