"""MaxLen (DESIGN.md A5) against hand computations and the issue's facts."""

import math

import pytest

from hgraph.errors import CostModelError
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel
from hgraph.planner.memory import MemoryRegression


def test_max_len_by_hand_7b_tp8_on_64_gpus():
    # 7B table: H 4096, L 32, V 30592, A_tp8 48, B 210, alpha 0.75, gap 5242880000 ("node"),
    # safe 6442450944, memory 85198897152.
    h, layers, v = 4096, 32, 30592
    layer = 210 * h * h
    vocab = 16 * v * h
    stage0 = 32 * layer + 2 * vocab  # pp1: all layers, embedding and LM head
    states = 0.25 * stage0 / 8 + 0.75 * (layers * layer + 2 * vocab) / 64
    free = 85198897152 - 6442450944 - 5242880000 - states
    tokens = free / (layers * (h / 8) * 48)
    expected = int(tokens) // 128 * 128
    model = CostModel.preset("llama7b_a800")
    assert model.max_len(Degrees(8), world_size=64) == expected == 87040
    assert model.with_world_size(64).max_len(Degrees(8)) == expected
    # without a world size the ZeRO share is left out: a little more room
    assert model.max_len(Degrees(8)) > expected


def test_max_len_with_pipeline_stages_by_hand():
    h, layers, v = 4096, 32, 30592
    layer = 210 * h * h
    stage0 = 8 * layer + 16 * v * h  # pp4: 8 layers and the embedding only
    states = 0.25 * stage0 / 4 + 0.75 * (layers * layer + 32 * v * h) / 64
    free = 85198897152 - 6442450944 - 5242880000 - states
    expected = int(free / (layers * (h / 4) * 42)) // 128 * 128
    assert CostModel.preset("llama7b_a800").max_len(Degrees(4, 4), 64) == expected


def test_issue_facts():
    big = CostModel.preset("llama32b_a800").with_world_size(1024)
    holds_32k = [s for s in big.schemes if big.max_len(s) >= 32768]
    assert holds_32k == [Degrees(16)]
    seven = CostModel.preset("llama7b_a800").with_world_size(64)
    assert seven.max_len(Degrees(8)) > 28 * 1024 > seven.max_len(Degrees(2, 2))
    assert all(seven.max_len(s) % 128 == 0 for s in seven.schemes)
    # more TP or PP never lowers MaxLen
    assert seven.max_len(Degrees(4, 2)) >= seven.max_len(Degrees(4, 1))
    assert seven.max_len(Degrees(8, 1)) >= seven.max_len(Degrees(4, 1))


def regression(**changes):
    values = {
        "activation": ((1, 40.0), (2, 40.0), (8, 50.0)),
        "bytes_per_layer_h2": 200.0,
        "alpha": 0.75,
        "gap": (("gpu1", 1e9), ("gpu2", 2e9), ("node", 4e9)),
        "safe_bound": 1e9,
        "gpu_memory": 80e9,
        "hidden": 1024,
        "layers": 10,
        "vocab": 1000,
    }
    values.update(changes)
    return MemoryRegression(**values)


def test_zero_when_model_states_do_not_fit():
    # 40000 B per H^2 per layer: 10 layers hold 420 GB of model states, more than the 80 GB device
    mem = regression(bytes_per_layer_h2=40000.0)
    assert mem.model_state_bytes(1, 1) > 80e9
    assert mem.max_len(1, 1) == 0


def test_gap_key_is_chosen_by_stage_size():
    mem = regression()
    assert mem.gap_bytes(1) == 1e9 and mem.gap_bytes(2) == 2e9 and mem.gap_bytes(8) == 4e9
    no_node = regression(gap=(("gpu1", 1e9),))
    with pytest.raises(CostModelError, match="add 'node'"):
        no_node.gap_bytes(2)


def test_small_case_exactly():
    mem = regression()
    layer = 200 * 1024**2
    vocab = 16 * 1000 * 1024
    states = 0.25 * (10 * layer + 2 * vocab) / 2 + 0.75 * (10 * layer + 2 * vocab) / 16
    free = 80e9 - 1e9 - 2e9 - states
    per_token = 10 * 512 * 40.0
    assert mem.max_len(2, 1, world_size=16) == math.floor(free / per_token) // 128 * 128
    # cp splits tokens over the stage mesh: per-token bytes halve, gap follows tp*cp = 4 -> "node"
    free_cp = 80e9 - 1e9 - 4e9 - states
    assert mem.max_len(2, 1, cp=2, world_size=16) == math.floor(free_cp / (per_token / 2)) // 128 * 128
    with pytest.raises(CostModelError, match="no entry for tp4"):
        mem.max_len(4, 1)
    with pytest.raises(CostModelError, match="world_size=2 is smaller"):
        mem.max_len(2, 2, world_size=2)
