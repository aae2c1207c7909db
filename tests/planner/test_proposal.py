"""Strategy proposal: the DP on hand-checked instances, coverage of the long tail, homogeneous candidates."""

import time
from importlib import resources

import numpy as np
import pytest

from hgraph.errors import PlanError
from hgraph.core.strategy import Strategy
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel
from hgraph.planner.proposal import propose, propose_candidates


def toy_model(entries, gpus_per_node=8, memory=1e15):
    """A table whose MaxLen is effectively unbounded unless ``memory`` is small."""
    tps = sorted({e["tp"] for e in entries})
    return CostModel.from_table(
        {
            "strategies": [dict(pp=1, a=0.0, c=0.0, **e) for e in entries],
            "memory_regression": {
                "A": {f"tp{t}": 1 for t in tps},
                "B": 1,
                "alpha": 0.75,
                "gap": {"node": 0},
                "safe_bound": 0,
            },
            "model_config": {"H": 64, "L": 1, "V": 1},
            "cluster_config": {"gpus_per_node": gpus_per_node, "gpu_memory_bound": memory},
        },
        name="toy",
    )


def by_strategy(candidates):
    return {str(c.strategy): c for c in candidates}


def test_dp_picks_the_faster_wide_pipeline_by_hand():
    # 2 GPUs; sequences of 2000 and 200 tokens.
    # 2 x tp1 (b=1): the 2000-token sequence alone takes 2000 ms.
    # 1 x tp2 (b=0.6): both sequences on one pipeline, 2200 * 0.6 = 1320 ms.
    model = toy_model([{"tp": 1, "b": 1.0}, {"tp": 2, "b": 0.6}])
    cands = propose_candidates(model, 2, [2000, 200])
    assert str(cands[0].strategy) == "tp2"
    assert cands[0].predicted_ms == pytest.approx(1320.0)
    assert cands[0].covers == 2000
    assert by_strategy(cands)["2x tp1"].predicted_ms == pytest.approx(2000.0)


def test_long_sequence_gets_a_fast_pipeline_and_the_rest_stays_cheap():
    # 8 GPUs; one 8000-token sequence and 40 of 200 tokens (8000 tokens).
    # tp1 (b=1) is the cheapest per GPU, tp4 (b=0.3) the fastest per sequence.
    # 8 x tp1: 8000 ms (the long one alone). tp4 + 4 x tp1: max(8000*0.3, 8000/4) = 2400 ms.
    # 2 x tp4 also reaches 2400 ms but keeps 8 GPUs busy for it; the DP's tie-break prefers less load.
    model = toy_model([{"tp": 1, "b": 1.0}, {"tp": 4, "b": 0.3}])
    cands = propose_candidates(model, 8, [8000] + [200] * 40)
    best = cands[0]
    assert str(best.strategy) == "tp4 + 4x tp1"
    assert best.predicted_ms == pytest.approx(2400.0)
    found = by_strategy(cands)
    assert found["8x tp1"].predicted_ms == pytest.approx(8000.0)
    assert found["8x tp1"].origin == "homogeneous"
    assert found["2x tp4"].predicted_ms == pytest.approx(2400.0)


def test_reference_flaw_is_fixed():
    # Dividing a band's cost over its replicas (DESIGN.md A6) would put the 8000-token sequence in a
    # band with the short ones on 8 x tp1 and predict 16000/8 = 2000 ms < 2400 ms. We predict 8000.
    model = toy_model([{"tp": 1, "b": 1.0}, {"tp": 4, "b": 0.3}])
    cands = propose_candidates(model, 8, [8000] + [200] * 40)
    assert min(c.predicted_ms for c in cands) == pytest.approx(2400.0)


def test_pipeline_band_time_by_hand():
    # One tp1,pp2 pipeline; 4 sequences of 1000 tokens, T(l) = 0.1 l + 10 per stage.
    # Work 400 ms; v* = sqrt(400 * (pp-1) / c) = 6.3, capped at 4 (one sequence per micro-batch):
    # 1F1B time = 4 * 110 + (2 - 1) * 110 = 550 ms.
    model = CostModel.from_table(
        {
            "strategies": [{"tp": 1, "pp": 2, "a": 0.0, "b": 0.1, "c": 10.0}],
            "memory_regression": {
                "A": {"tp1": 1},
                "B": 1,
                "alpha": 0.75,
                "gap": {"node": 0},
                "safe_bound": 0,
            },
            "model_config": {"H": 64, "L": 1, "V": 1},
            "cluster_config": {"gpus_per_node": 8, "gpu_memory_bound": 1e15},
        }
    )
    (only,) = propose_candidates(model, 2, [1000] * 4)
    assert str(only.strategy) == "tp1,pp2"
    assert only.predicted_ms == pytest.approx(550.0)


def test_max_len_limits_which_scheme_takes_long_sequences():
    # tp1 pipelines cannot hold 8000 tokens: MaxLen(tp1) = 4096 with this memory, tp2 twice that.
    model = toy_model([{"tp": 1, "b": 1.0}, {"tp": 2, "b": 0.6}], memory=64 * 4096 + 8 * 64 * 4)
    assert model.max_len(Degrees(1)) == 4096 and model.max_len(Degrees(2)) == 8192
    cands = propose_candidates(model, 4, [8000, 300, 300, 300])
    for c in cands:
        if c.covers == 8000:
            assert any(p.tp == 2 for p in c.strategy.pipelines)
    homogeneous_tp1 = by_strategy(cands)["4x tp1"]
    assert homogeneous_tp1.covers == 300  # listed, but only for batches without the long sequence


def wikipedia_sample():
    text = resources.files("hgraph.data").joinpath("wikipedia_lengths_sample.txt").read_text()
    return np.array(text.split(), dtype=np.int64)


@pytest.mark.parametrize("name, gpus", [("llama7b_a800", 64), ("llama32b_a800", 1024)])
def test_candidates_on_real_lengths(name, gpus):
    model = CostModel.preset(name)
    start = time.perf_counter()
    cands = propose_candidates(model, gpus, wikipedia_sample(), max_len=32768, tokens_per_iteration=200_000)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0  # ~0.2 s (64 GPUs) and ~0.5 s (1024 GPUs) on 2 shared cores
    strategies = [c.strategy for c in cands]
    assert len(set(strategies)) == len(strategies)
    for s in strategies:
        s.check(gpus)
        for p in s.pipelines:
            # TP groups stay inside a node whenever they fit in one
            if p.tp <= model.gpus_per_node:
                for stage in range(p.pp):
                    ranks = p.stage_ranks(stage)
                    assert len({r // model.gpus_per_node for r in ranks[: p.tp]}) == 1
    # every homogeneous strategy of a scheme with a usable MaxLen is there
    world = model.with_world_size(gpus)
    for scheme in model.schemes:
        if gpus % scheme.size == 0 and world.max_len(scheme) >= 128:
            assert Strategy.parse(f"{gpus // scheme.size}x {scheme}") in strategies
    full = [c for c in cands if c.covers == 32768]
    best_homogeneous = min(c.predicted_ms for c in full if c.origin == "homogeneous")
    assert min(c.predicted_ms for c in full) <= best_homogeneous
    # a pipeline fast enough for the 32K sequences is in the best full candidate
    assert max(p.tp for p in min(full, key=lambda c: c.predicted_ms).strategy.pipelines) >= 8


def test_32b_reaches_the_tp16_floor():
    model = CostModel.preset("llama32b_a800")
    cands = propose_candidates(model, 1024, wikipedia_sample(), max_len=32768, tokens_per_iteration=1_600_000)
    best = min((c for c in cands if c.covers == 32768), key=lambda c: c.predicted_ms)
    floor = model.stage_cost(Degrees(16)).micro_batch_time([32768])
    assert best.predicted_ms == pytest.approx(floor)


def test_histogram_input_and_truncation():
    model = toy_model([{"tp": 1, "b": 1.0}, {"tp": 2, "b": 0.6}])
    from_list = propose(model, 2, [2000, 200])
    from_histogram = propose(model, 2, {2000: 1, 200: 1})
    assert from_list == from_histogram
    truncated = propose_candidates(model, 2, [5000, 200], max_len=2000)
    assert max(c.covers for c in truncated) == 2000


@pytest.mark.parametrize(
    "gpus, lengths, kwargs, message",
    [
        (0, [100], {}, "gpus=0"),
        (2, [], {}, "empty length sample"),
        (2, [0, 5], {}, "positive integers"),
        (2, [100], {"max_len": 0}, "max_len=0"),
        (2, [100], {"tokens_per_iteration": -1}, "tokens_per_iteration"),
        (2, [100], {"max_candidates": -1}, "max_candidates=-1"),
    ],
)
def test_bad_inputs(gpus, lengths, kwargs, message):
    model = toy_model([{"tp": 1, "b": 1.0}])
    with pytest.raises(PlanError, match=message):
        propose(model, gpus, lengths, **kwargs)


def test_sequence_longer_than_every_max_len_is_named():
    model = CostModel.preset("llama7b_a800")
    with pytest.raises(
        PlanError, match=r"sequence length 1000000 exceeds the largest MaxLen 140672 \(tp16\)"
    ):
        propose(model, 64, [1_000_000, 100])
