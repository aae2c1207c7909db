"""Recomputation in the planner: MaxLen and T(l) per recompute mode, by hand from the 7B table."""

import json
import math
from importlib import resources

import pytest
import torch

import hgraph
from hgraph.errors import CostModelError
from hgraph.models import Llama, LlamaConfig
from hgraph.passes.recompute import regions
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel, choose_recompute
from hgraph.planner.memory import MemoryRegression

TABLE = json.loads(resources.files("hgraph.planner").joinpath("presets/llama7b_a800.json").read_text())


def by_hand_max_len(tp, pp, mode):
    reg, model = TABLE["memory_regression"], TABLE["model_config"]
    H, L, V = model["H"], model["L"], model["V"]
    stage0 = math.ceil(L / pp) * reg["B"] * H * H + 16 * V * H * (2 if pp == 1 else 1)
    states = (1 - reg["alpha"]) * stage0 / tp
    free = TABLE["cluster_config"]["gpu_memory_bound"] - reg["safe_bound"] - reg["gap"]["node"] - states
    layer = H / tp * reg["A"][f"tp{tp}"]
    kept = {"none": layer, "selective": 0.53 * layer, "full": min(layer, 2 * H * (3 if tp > 1 else 1))}[mode]
    per_token = L * layer if mode == "none" else L * kept + layer - kept
    return int(free // per_token) // 128 * 128


@pytest.mark.parametrize("scheme", ["tp1,pp2", "tp2,pp2", "tp8,pp1"])
def test_max_len_per_mode_matches_the_formula(scheme):
    s = Degrees.parse(scheme)
    base = CostModel.preset("llama7b_a800")
    got = {m: base.with_recompute(m).max_len(s) for m in ("none", "selective", "full")}
    assert got == {m: by_hand_max_len(s.tp, s.pp, m) for m in got}
    assert got["none"] < got["selective"]
    # tp1 keeps only layer inputs; a TP layer also keeps its two all-reduced outputs (not reissued),
    # which at tp8 are as large as everything else the layer keeps
    assert got["full"] > {1: 8, 2: 2.5, 8: 0.99}[s.tp] * got["none"]
    reissued = MemoryRegression.from_table(TABLE).max_len(s.tp, s.pp, recompute="full", keep_communication=False)
    assert (reissued > got["full"]) if s.tp > 1 else (reissued == got["full"])


def test_recompute_time_is_added():
    s = Degrees(2, 2)
    base = CostModel.preset("llama7b_a800")
    entry = next(e for e in TABLE["strategies"] if e["tp"] == 2 and e["pp"] == 2)
    full = base.with_recompute("full").stage_cost(s)
    assert full.a == pytest.approx(entry["a"] * 1.25) and full.b == pytest.approx(entry["b"] * 4 / 3)
    assert full.c == pytest.approx(entry["c"])
    assert base.with_recompute({s: "selective"}).stage_cost(Degrees(1, 2)).b == pytest.approx(
        next(e for e in TABLE["strategies"] if e["tp"] == 1 and e["pp"] == 2)["b"])
    assert base.with_recompute("full").with_world_size(64).recompute(s) == "full"
    with pytest.raises(CostModelError, match="recompute='some'"):
        base.with_recompute("some")


def test_planner_picks_the_fastest_mode_that_fits():
    base = CostModel.preset("llama7b_a800")
    s = Degrees(1, 2)
    limits = {m: base.with_recompute(m).max_len(s) for m in ("none", "selective", "full")}
    assert choose_recompute(base, s, limits["none"]) == "none"
    assert choose_recompute(base, s, limits["none"] + 128) == "selective"
    assert choose_recompute(base, s, limits["selective"] + 128) == "full"
    assert choose_recompute(base, s, limits["full"] + 128) is None


def test_compile_takes_a_mode_per_scheme():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=2))
    ids = torch.randint(0, 256, (2, 16))
    compiled = hgraph.compile(model, ["tp2", "2x tp1"], example_inputs=ids,
                              options=hgraph.CompileOptions(recompute={"tp2": "full", Degrees(1, 1): "none"}))
    assert [r.mode for r in regions(compiled.program(0, 0).stage_graph.gm)] == ["full", "full"]
    assert regions(compiled.program(1, 0).stage_graph.gm) == []
