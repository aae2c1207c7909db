"""Cost tables: presets, round trips, strict validation, the analytic model."""

import copy
import json
import math
from importlib import resources

import pytest

from hgraph.errors import CostModelError, StrategyError
from hgraph.planner.analytic import HardwareSpec, ModelConfig, analytic_cost_model, stage_cost
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import PRESETS, CostModel, StageCost, load_cost_model


def preset_table(name: str) -> dict:
    return json.loads(resources.files("hgraph.planner").joinpath("presets", f"{name}.json").read_text())


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_round_trip(name):
    model = CostModel.preset(name)
    table = preset_table(name)
    assert [(s.tp, s.pp) for s in model.schemes] == [(e["tp"], e["pp"]) for e in table["strategies"]]
    assert model.gpus_per_node == 8
    assert model.to_table() == table
    again = CostModel.from_table(model.to_table())
    assert again.to_table() == table
    assert all(again.stage_cost(s) == model.stage_cost(s) for s in model.schemes)


def test_preset_values_and_times():
    model = load_cost_model("llama7b_a800")
    cost = model.stage_cost(Degrees(tp=8))
    assert cost == StageCost(5.06885473e-07, 0.0366182377, 44.317477753058256)
    assert cost.seq_time(1000) == pytest.approx(5.06885473e-07 * 1e6 + 36.6182377)
    assert cost.micro_batch_time([1000, 24]) == pytest.approx(
        cost.seq_time(1000) + cost.seq_time(24) + 44.317477753058256
    )
    # the floor: a 32K sequence on 32B tp16 takes about 4.98 s
    big = load_cost_model("llama32b_a800").stage_cost(Degrees(tp=16))
    assert big.micro_batch_time([32768]) == pytest.approx(4981.7, abs=0.1)


def test_load_cost_model_from_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(preset_table("llama13b_a800")))
    model = load_cost_model(str(path))
    assert model.name == "mine"
    assert Degrees(1, 1) in model.schemes
    with pytest.raises(CostModelError, match="not a preset"):
        load_cost_model(str(tmp_path / "absent.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CostModelError, match="not valid JSON"):
        load_cost_model(str(tmp_path / "bad.json"))


def test_unknown_scheme_and_preset_are_named():
    model = CostModel.preset("llama7b_a800")
    with pytest.raises(CostModelError, match=r"no scheme tp1; known: tp1,pp2"):
        model.stage_cost(Degrees(1, 1))
    with pytest.raises(CostModelError, match="no scheme tp8,cp2"):
        model.max_len(Degrees(8, 1, 2))
    with pytest.raises(CostModelError, match="llama70b"):
        CostModel.preset("llama70b")


def mutate(path, value=None, delete=False):
    table = preset_table("llama7b_a800")
    target = table
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return table


@pytest.mark.parametrize(
    "table, message",
    [
        (mutate(["strategies", 0, "a"], delete=True), r"strategies\[0\]\.a is missing"),
        (mutate(["strategies", 2, "b"], -0.5), r"strategies\[2\]\.b: expected a finite number >= 0"),
        (mutate(["strategies", 1, "c"], "fast"), r"strategies\[1\]\.c: expected a number, got 'fast'"),
        (mutate(["strategies", 1, "c"], True), r"strategies\[1\]\.c: expected a number"),
        (mutate(["strategies", 0, "a"], math.nan), r"strategies\[0\]\.a"),
        (mutate(["strategies", 0, "tp"], 0), r"strategies\[0\]\.tp: expected an integer >= 1"),
        (mutate(["strategies", 0, "sp"], 2), r"strategies\[0\] has unknown keys \['sp'\]"),
        (mutate(["strategies"], []), "non-empty list"),
        (mutate(["strategies", 1], {"tp": 1, "pp": 2, "a": 0, "b": 0, "c": 0}), "tp1,pp2 appears twice"),
        (mutate(["memory_regression"], delete=True), "memory_regression is missing"),
        (mutate(["memory_regression", "alpha"], 1.5), "alpha"),
        (mutate(["memory_regression", "A", "tp16"], delete=True), "no entry for tp16"),
        (mutate(["memory_regression", "gap", "gpu3x"], 1), "gap key 'gpu3x'"),
        (mutate(["model_config", "H"], 0), r"model_config\.H: expected an integer >= 1"),
        (mutate(["cluster_config", "gpus_per_node"], delete=True), "gpus_per_node is missing"),
        (mutate(["cluster_config", "gpu_memory_bound"], 0), "gpu_memory_bound"),
        (mutate(["extra"], 1), r"unknown keys \['extra'\]"),
        ({}, "strategies is missing"),
        ([], "JSON object"),
    ],
)
def test_bad_tables_raise_cost_model_error(table, message):
    with pytest.raises(CostModelError, match=message):
        CostModel.from_table(copy.deepcopy(table))


def test_context_parallel_entries_are_read_and_written():
    table = preset_table("llama7b_a800")
    table["strategies"].append({"tp": 8, "pp": 1, "cp": 2, "a": 2.6e-7, "b": 0.02, "c": 40.0})
    model = CostModel.from_table(table)
    scheme = Degrees.parse("tp8,cp2")
    assert scheme.size == 16 and str(scheme) == "tp8,cp2"
    assert model.stage_cost(scheme).c == 40.0
    # cp splits the tokens: twice the MaxLen of tp8 (up to alignment)
    assert abs(model.max_len(scheme) - 2 * model.max_len(Degrees(8))) <= 128
    assert CostModel.from_table(model.to_table()).to_table() == model.to_table()


def test_scheme_parse_and_errors():
    assert Degrees.parse("(tp2,pp4)") == Degrees(2, 4)
    assert str(Degrees(2, 4)) == "tp2,pp4" and Degrees(2, 4).size == 8
    with pytest.raises(StrategyError, match="cannot parse degrees 'dp4'"):
        Degrees.parse("tp2,dp4")
    with pytest.raises(StrategyError, match="tp=0"):
        Degrees(0)
    with pytest.raises(CostModelError, match=r"strategies\[0\]: Degrees ep=3 does not divide"):
        CostModel.from_table({**CostModel.preset("llama7b_a800").to_table(),
                              "strategies": [{"tp": 2, "pp": 1, "ep": 3, "a": 0, "b": 0, "c": 0}]})


LLAMA7B = ModelConfig(hidden=4096, layers=32, heads=32, ffn=11008, vocab=30592)


def test_analytic_flop_count_by_hand():
    spec = HardwareSpec(
        "unit", peak_flops=1e15, memory_bytes=80e9, intra_bw=1e11, inter_bw=1e10, mfu=0.5, layer_overhead=0.0
    )
    cost = stage_cost(LLAMA7B, spec, Degrees(1, 1))
    h, f, v, layers = 4096, 11008, 30592, 32
    speed = 0.5e15
    assert cost.a == pytest.approx(3 * 2 * h * layers / speed * 1e3)
    linear = 2 * (4 * h * h + 3 * h * f)
    assert cost.b == pytest.approx(3 * (layers * linear + 2 * h * v) / speed * 1e3)
    assert cost.c == 0.0
    # tp2 inside a node: half the compute plus 4 all-reduces per layer of 2*H bytes per token
    tp2 = stage_cost(LLAMA7B, spec, Degrees(2, 1))
    assert tp2.a == pytest.approx(cost.a / 2)
    assert tp2.b == pytest.approx(cost.b / 2 + layers * 4 * 2 * (1 / 2) * 2 * h / 1e11 * 1e3)
    assert tp2.c == pytest.approx(layers * 4 * 2 * spec.intra_latency * 1e3)
    # pp2: half the layers (the last stage keeps the LM head) plus two activation sends
    pp2 = stage_cost(LLAMA7B, spec, Degrees(1, 2))
    assert pp2.a == pytest.approx(cost.a / 2)
    assert pp2.b == pytest.approx(3 * (16 * linear + 2 * h * v) / speed * 1e3 + 2 * 2 * h / 1e11 * 1e3)


def test_analytic_model_is_close_to_the_a800_table_and_round_trips():
    model = analytic_cost_model(
        LLAMA7B, "a100-80gb", [Degrees(1, 2), Degrees(4, 1), Degrees(8, 1), Degrees(8, 1, 2)]
    )
    table = CostModel.preset("llama7b_a800")
    for scheme in (Degrees(1, 2), Degrees(4, 1), Degrees(8, 1)):
        ours, measured = model.stage_cost(scheme), table.stage_cost(scheme)
        assert 0.5 < ours.micro_batch_time([8192]) / measured.micro_batch_time([8192]) < 2.0
        assert 0.8 < model.max_len(scheme, 64) / table.max_len(scheme, 64) < 1.4
    # context parallelism: attention and linear work halve, ring traffic is added
    cp2, tp8 = model.stage_cost(Degrees(8, 1, 2)), model.stage_cost(Degrees(8, 1))
    assert cp2.a == pytest.approx(tp8.a / 2) and tp8.b / 2 < cp2.b < tp8.b
    assert CostModel.from_table(model.to_table()).to_table() == model.to_table()


def test_analytic_inputs_are_checked():
    with pytest.raises(CostModelError, match="heads=3"):
        ModelConfig(hidden=64, layers=2, heads=3, ffn=128, vocab=10)
    with pytest.raises(CostModelError, match="kv_heads=3"):
        ModelConfig(hidden=64, layers=2, heads=4, ffn=128, vocab=10, kv_heads=3)
    with pytest.raises(CostModelError, match="tpu"):
        HardwareSpec.preset("tpu")
    with pytest.raises(CostModelError, match="more stages"):
        stage_cost(ModelConfig(64, 2, 4, 128, 10), HardwareSpec.preset("h100-80gb"), Degrees(1, 4))
