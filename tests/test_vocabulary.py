"""One vocabulary on the command line: every strategy string hgraph prints (``str`` of a strategy,
pipeline or degrees; ``hgraph plan``'s text and JSON; the profile's schemes) parses back to the same
thing; ``hgraph --version`` prints the installed version; ``plan --max-len`` bounds every planned
piece, also with ``--split-long``; help texts name the defaults and the cost-table presets."""

import json
import re
import subprocess
import sys
from importlib import metadata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hgraph.cli.command import main
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import PRESETS
from hgraph.profiling.profile_ranks import parse_schemes
from hgraph.core.strategy import Pipeline, Strategy

pipelines = st.builds(
    lambda tp, pp, cp, vpp: Pipeline(tp=tp, pp=pp, cp=cp, vpp=vpp if pp > 1 else 1),
    st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(pipelines, min_size=1, max_size=6))
def test_every_printed_strategy_parses_back(pipes):
    strategy = Strategy(tuple(pipes))
    text = str(strategy)
    assert Strategy.parse(text) == strategy, text
    assert "×" not in text and "(" not in text  # the syntax users write: "tp2,pp2 + 2x tp1"
    for p in strategy.pipelines:
        assert Strategy.parse(str(p)).pipelines[0].degrees == p.degrees == Degrees.parse(str(p))
        scheme = p.stage_key
        assert Degrees.parse(str(scheme)) == scheme and Strategy.parse(str(scheme)).pipelines[0].stage_key == scheme


def test_the_written_and_the_older_printed_forms_parse():
    assert str(Strategy.parse("tp2,pp2 + 2x tp1")) == "tp2,pp2 + 2x tp1"
    # one string form for degrees, pipelines and cost-table schemes: tp always, then ep, pp, vpp, cp above 1
    assert str(Degrees(2, 4, 2, vpp=2, ep=2)) == str(Pipeline(2, 4, 2, vpp=2, ep=2)) == "tp2,ep2,pp4,vpp2,cp2"
    assert str(Degrees(4, ep=4)) == "tp4,ep4" and str(Degrees(1)) == "tp1"
    # the form cost tables and profiles printed before (pp always, ep last) reads as the same degrees
    assert Degrees.parse("tp1,pp1") == Degrees(1) and Degrees.parse("tp4,pp1,ep4") == Degrees(4, ep=4)
    assert Degrees.parse("tp8,pp1,cp2") == Degrees(8, cp=2) == Pipeline(8, cp=2).stage_key
    assert str(Strategy.parse("(tp4) + 2×(tp2)")) == "tp4 + 2x tp2"
    assert parse_schemes("tp1; tp2; tp1,pp2") == parse_schemes("tp1,tp2,tp1pp2")


def test_strategies_hgraph_plan_prints_parse_back(capsys):
    argv = ["plan", "--gpus", "16", "--iterations", "2", "--tokens-per-iteration", "40000", "--max-len", "8192"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for it in data["iterations"]:
        strategy = Strategy.parse(it["strategy"])
        assert strategy.world_size == 16
        assert [(p.tp, p.pp, p.cp) for p in strategy.pipelines] == [(p["tp"], p["pp"], p["cp"]) for p in it["pipelines"]]
    assert main(argv) == 0
    printed = re.findall(r"^iteration \d+: IterationPlan (.+?): \d+ sequences", capsys.readouterr().out, re.M)
    assert printed == [it["strategy"] for it in data["iterations"]]


@pytest.mark.parametrize("split", [False, True])
def test_plan_max_len_bounds_every_piece_with_or_without_split_long(capsys, tmp_path, split):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, [30_000, 9_000, 700, 300, 5_000, 120] * 3)))
    argv = ["plan", "--gpus", "16", "--lengths", str(lengths), "--tokens-per-iteration", "40000",
            "--max-len", "4096", "--json"] + (["--split-long"] if split else [])
    assert main(argv) == 0
    for it in json.loads(capsys.readouterr().out)["iterations"]:
        assert max(it["lengths"]) <= 4096  # truncated, or cut into pieces of at most --max-len
        if split:  # pieces of a sequence add up to it: nothing was truncated
            sources = it.get("sources", [[i, 0] for i in range(len(it["lengths"]))])
            whole: dict[int, int] = {}
            for (seq, _), n in zip(sources, it["lengths"]):
                whole[seq] = whole.get(seq, 0) + n
            assert 30_000 in whole.values() or 9_000 in whole.values()


def test_version():
    out = subprocess.run([sys.executable, "-m", "hgraph", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"hgraph {metadata.version('hgraph')}"


def test_help_texts_name_defaults_and_presets():
    out = subprocess.run([sys.executable, "-m", "hgraph", "plan", "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    assert all(name in out for name in PRESETS) and "(default: 32768)" in out
    out = subprocess.run([sys.executable, "-m", "hgraph", "train", "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    assert "docs/config.md" in out and "default: none, run until" in " ".join(out.split())
    assert all(name in " ".join(out.split()) for name in PRESETS)
