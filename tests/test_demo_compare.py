"""The interleaved comparison's figures (``hgraph.cli.demo_compare.ratios``) from a rank-0 result
written here by hand: the ratio per repetition and the measured gain bound."""

import pytest

from hgraph.cli.demo_compare import PLANNER, ratios


def _rows(strategy, seconds_per_batch, repeats=2):
    return [{"strategy": strategy, "seconds": s, "measured_ms": 1e3 * s, "predicted_ms": None,
             "predicted_raw_ms": None, "loss": 1.0, "lengths": [8], "batch": b}
            for _ in range(repeats) for b, s in seconds_per_batch.items()]


def test_ratio_and_gain_bound_come_from_measured_seconds_only():
    # batch 0 has a long document: only A and B take it; C (an oracle arm) is fast on batch 1 only
    a, b, c = {0: 1.0, 1: 1.0}, {0: 1.2, 1: 0.9}, {1: 0.5}
    result = {"seconds": {PLANNER: [1.6, 1.6], "A": [2.0, 2.0], "B": [2.1, 2.1], "C": [0.5, 0.5]},
              "rows": {PLANNER: _rows("A", {0: 1.0, 1: 0.6}), "A": _rows("A", a), "B": _rows("B", b),
                       "C": _rows("C", c)},
              "oracle": ["C"]}
    out = ratios(result)
    assert out["best_homogeneous"] == "A"  # C is not a homogeneous arm: it does not take every batch
    assert out["ratio_median"] == pytest.approx(2.0 / 1.6)
    # per batch the fastest arm that took it: A on batch 0 (1.0), C on batch 1 (0.5)
    assert out["gain_bound"] == pytest.approx(2.0 / 1.5)
    assert out["fastest_per_batch"] == ["A", "C"]
    assert out["planner_strategies"] == {"A": 4}


def test_gain_bound_is_one_where_the_best_homogeneous_arm_is_fastest_on_every_batch():
    result = {"seconds": {PLANNER: [2.0], "A": [2.0], "B": [3.0]},
              "rows": {PLANNER: _rows("A", {0: 1.0, 1: 1.0}, 1), "A": _rows("A", {0: 1.0, 1: 1.0}, 1),
                       "B": _rows("B", {0: 1.5, 1: 1.5}, 1)}}
    assert ratios(result)["gain_bound"] == pytest.approx(1.0)
