"""Bad configs stop in the parent before any rank starts: one line naming the key, the value and what
would be valid, within 2 s (starting the ranks alone takes 10 s or more)."""

import json
import subprocess
import sys
import time

import pytest

import hgraph.cli.train_cli  # noqa: F401 - imported at collection, so the 2 s measure the check alone
from hgraph.cli.command import main

TINY = {"model": "hgraph.cli.demo:tiny_model", "strategies": ["tp2", "2x tp1"], "world_size": 2,
        "iterations": 1, "data": {"lengths": "wikipedia", "tokens_per_iteration": 512, "max_len": 128}}


def train(capsys, tmp_path, config, *flags):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"out": str(tmp_path / "run"), **config}))
    return refuses(capsys, tmp_path, ["train", str(path), *flags])


def refuses(capsys, tmp_path, argv):
    """``hgraph ARGV`` fails in the parent with one line, within 2 s, and writes no run folder."""
    start = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert seconds < 2.0 and not (tmp_path / "run").exists(), (seconds, err)
    return err


@pytest.mark.parametrize("strategies, match", [
    (["tpx + ?"], "strategies[0] = 'tpx + ?': cannot parse 'tpx'"),
    (["2x tp2", "tp2,tp4"], "strategies[1] = 'tp2,tp4': degree tp is named twice"),
    (["tp3 + tp1"], "strategies[0] = 'tp3 + tp1': "),
])
def test_bad_strategies_stop_before_ranks_start(capsys, tmp_path, strategies, match):
    err = train(capsys, tmp_path, {**TINY, "strategies": strategies, "world_size": 4})
    assert match in err


@pytest.mark.parametrize("section, key, value", [("optimizer", "lr", float("nan")), ("optimizer", "lr", float("inf")),
                                                  ("optimizer", "weight_decay", float("-inf"))])
def test_non_finite_numbers_stop_before_ranks_start(capsys, tmp_path, section, key, value):
    err = train(capsys, tmp_path, {**TINY, section: {key: value}})
    assert f"{section}.{key}" in err and "expected a finite number" in err


@pytest.mark.parametrize("flags, match", [
    (["--world-size", "0"], "--world_size: 0 is below the minimum 1"),
    (["--data.max_len", "1"], "--data.max_len: 1 is below the minimum 2"),
    (["--optimizer.lr", "nan"], "--optimizer.lr: nan; expected a finite number"),
    (["--optimizer.lr", "-1"], "config .*: optimizer: invalid AdamW settings lr=-1.0"),
    (["--compile.compute_dtype", "float64"], None),  # argparse's own choices: exit 2
])
def test_bad_key_flags_are_refused(capsys, tmp_path, flags, match):
    import re

    if match is None:
        with pytest.raises(SystemExit) as stop:
            train(capsys, tmp_path, TINY, *flags)
        assert stop.value.code == 2 and "invalid choice: 'float64'" in capsys.readouterr().err
        return
    assert re.search(match, train(capsys, tmp_path, TINY, *flags))


@pytest.mark.slow
def test_a_bad_strategy_on_four_ranks_is_one_line_from_the_command(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"out": str(tmp_path / "run"), **TINY, "strategies": ["tpx + ?"], "world_size": 4}))
    out = subprocess.run([sys.executable, "-m", "hgraph", "train", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "rank" not in out.stderr, out.stderr


def command_refuses(capsys, tmp_path, argv):
    return refuses(capsys, tmp_path, [*argv, "--out", str(tmp_path / "run")])


@pytest.mark.parametrize("flags, match", [
    (["--world-size", "0"], "--world-size 0"),
    (["--timeout", "nan"], "--timeout nan: expected a finite number"),
    (["--timeout", "-1"], "--timeout -1.0: expected a finite number"),
    (["--eval-interval", "-3"], "--eval-interval -3: expected N >= 0"),
])
def test_bad_demo_flags_stop_before_ranks_start(capsys, tmp_path, flags, match):
    assert match in command_refuses(capsys, tmp_path, ["demo", *flags])


@pytest.mark.parametrize("flags, match", [
    (["--world-size", "0"], "world_size=0"),
    (["--schemes", "tpx"], "cannot parse scheme 'tpx'"),
    (["--world-size", "4", "--schemes", "tp3"], "does not divide world size 4"),
    (["--memory-gb", "nan"], "--memory-gb nan: expected a finite number"),
    (["--timeout", "inf"], "--timeout inf: expected a finite number"),
    (["--repeats", "0"], "--repeats 0"),
])
def test_bad_profile_flags_stop_before_ranks_start(capsys, tmp_path, flags, match):
    assert match in command_refuses(capsys, tmp_path, ["profile", *flags])
