"""Context parallelism in the cost model: analytic cp entries by hand, MaxLen per cp, profiled entries win."""

import json
import math
from importlib import resources

import pytest

from hgraph.cli.command import main
from hgraph.errors import CostModelError
from hgraph.planner.context import ANALYTIC, parse_degrees, with_context_parallel
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel


def preset_table(name: str) -> dict:
    return json.loads(resources.files("hgraph.planner").joinpath("presets", f"{name}.json").read_text())


def entry(table: dict, tp: int, pp: int) -> dict:
    return next(e for e in table["strategies"] if e["tp"] == tp and e["pp"] == pp and e.get("cp", 1) == 1)


def test_analytic_cp_entry_by_hand_across_nodes():
    # 32B, tp8 cp2: 16 GPUs, the cp ring crosses nodes (NIC: 25 GB/s, 10 us in the LNK topology model)
    table = preset_table("llama32b_a800")
    base = entry(table, 8, 1)
    model = with_context_parallel(CostModel.preset("llama32b_a800"), (1, 2))
    cost = model.stage_cost(Degrees(tp=8, cp=2))
    layers, hidden = 60, 6656
    ring_bytes_per_token = layers * 3 * (1 / 2) * 2 * 2 * hidden / 8  # fwd K,V once; bwd K,V,dK,dV
    assert cost.a == pytest.approx(base["a"] / 2)
    assert cost.b == pytest.approx(base["b"] / 2 + ring_bytes_per_token / 25e9 * 1e3)
    assert cost.c == pytest.approx(base["c"] + layers * 3 * 1 * 10e-6 * 1e3)
    assert model.source(Degrees(tp=8, cp=2)) == ANALYTIC and model.source(Degrees(tp=8)) is None
    # the floor, one 32K sequence: tp16 alone 4.98 s; tp8 cp2 on the same 16 GPUs is faster
    l = 32768
    assert model.stage_cost(Degrees(tp=16)).micro_batch_time([l]) == pytest.approx(4982, abs=1)
    assert cost.micro_batch_time([l]) < 0.8 * model.stage_cost(Degrees(tp=16)).micro_batch_time([l])


def test_analytic_cp_entry_inside_a_node_uses_nvlink():
    table = preset_table("llama7b_a800")
    base = entry(table, 2, 2)
    model = with_context_parallel(CostModel.preset("llama7b_a800"), (1, 4))
    cost = model.stage_cost(Degrees(tp=2, pp=2, cp=4))  # a stage is 8 GPUs: one node
    stage_layers = 16
    ring = stage_layers * 3 * (3 / 4) * 2 * 2 * 4096 / 2
    assert cost.b == pytest.approx(base["b"] / 4 + ring / 150e9 * 1e3)
    assert cost.c == pytest.approx(base["c"] + stage_layers * 3 * 3 * 3e-6 * 1e3)


def test_max_len_per_cp_degree_by_hand():
    # MaxLen = align128((mem - safe - gap - states) / (L * H/tp * A_tp / cp)): states do not shrink with
    # cp (weights are replicated over the cp ranks), activations do
    t = preset_table("llama13b_a800")
    reg, mem = t["memory_regression"], t["cluster_config"]["gpu_memory_bound"]
    model = with_context_parallel(CostModel.preset("llama13b_a800"), (1, 2, 4)).with_world_size(128)
    h, layers, vocab = 5120, 40, 30592
    for tp, cp in ((8, 1), (8, 2), (4, 4), (2, 2)):
        states = (1 - 0.75) * (layers * reg["B"] * h * h + 2 * 16 * vocab * h) / tp
        states += 0.75 * (layers * reg["B"] * h * h + 2 * 16 * vocab * h) / 128
        free = mem - reg["safe_bound"] - 5242880000 - states
        expected = int(free // (layers * (h / tp) * reg["A"][f"tp{tp}"] / cp)) // 128 * 128
        assert model.max_len(Degrees(tp=tp, cp=cp)) == expected
    assert model.max_len(Degrees(tp=8, cp=2)) > 1.9 * model.max_len(Degrees(tp=8))


def test_degrees_select_schemes_and_profiled_entries_win():
    table = preset_table("llama7b_a800")
    table["strategies"].append({"tp": 2, "pp": 1, "cp": 2, "a": 1e-6, "b": 0.05, "c": 60.0, "source": "profiled"})
    model = CostModel.from_table(table)
    both = with_context_parallel(model, (1, 2))
    assert both.stage_cost(Degrees(tp=2, cp=2)).b == 0.05 and both.source(Degrees(tp=2, cp=2)) == "profiled"
    assert {s.cp for s in both.schemes} == {1, 2}
    only_cp = with_context_parallel(model, (2, 4))
    assert {s.cp for s in only_cp.schemes} == {2, 4}
    plain = with_context_parallel(model, (1,))
    assert all(s.cp == 1 for s in plain.schemes)
    assert len(both.schemes) == 2 * len(plain.schemes)


def test_cp_table_round_trips_with_its_sources_and_says_it_is_analytic():
    model = with_context_parallel(CostModel.preset("llama7b_a800"), (1, 2))
    table = model.to_table()
    assert "analytic" in table["_context_parallel"]
    assert sum(e.get("source") == ANALYTIC for e in table["strategies"]) == len(model.schemes) // 2
    again = CostModel.from_table(json.loads(json.dumps(table)))
    assert again.to_table() == table
    assert all(again.source(s) == model.source(s) for s in model.schemes)
    assert f"[{ANALYTIC}]" in str(model)


def test_bad_degrees_are_named():
    with pytest.raises(CostModelError, match="1,2,4"):
        parse_degrees("2,x")
    with pytest.raises(CostModelError, match="integers >= 1"):
        with_context_parallel(CostModel.preset("llama7b_a800"), (0, 2))
    assert parse_degrees("4, 1,2") == (1, 2, 4)


def test_plan_cli_rejects_a_bad_context_parallel_flag(capsys):
    assert main(["plan", "--gpus", "8", "--context-parallel", "two"]) == 1
    assert "--context-parallel 'two'" in capsys.readouterr().err


def test_ring_bandwidth_is_the_slowest_link():
    from hgraph.lnk.topology import Topology
    from hgraph.planner.context import ring_link

    topo = Topology(ranks_per_node=8)
    assert ring_link(topo, 2, 4) == (topo.intra_latency, topo.intra_bandwidth)  # ranks 0,2,4,6
    assert ring_link(topo, 4, 4) == (topo.inter_latency, topo.inter_bandwidth)  # ranks 0,4,8,12
    assert math.isclose(ring_link(topo, 1, 8)[1], topo.intra_bandwidth)


def _long_tail_batch(seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [32768] + [rng.randint(200, 3000) for _ in range(150)]


def test_the_long_sequence_goes_to_a_cp_pipeline_and_beats_every_plan_without_cp():
    from hgraph.planner.assign import Planner
    from hgraph.planner.bound import lower_bound
    from hgraph.planner.proposal import propose

    plain = CostModel.preset("llama13b_a800")
    model = with_context_parallel(plain, (1, 2, 4))
    batch = _long_tail_batch()
    sample = batch * 3  # a sample of three iterations' worth
    plan = Planner(model, propose(model, 64, sample, tokens_per_iteration=sum(batch))).plan(batch)
    holder = next(p for p in plan.pipelines if any(0 in mb for mb in p.micro_batches))
    assert holder.pipeline.cp > 1
    # short sequences fill data-parallel pipelines without cp
    assert any(p.pipeline.cp == 1 and p.micro_batches for p in plan.pipelines)
    # the oracle: no plan without cp can beat the longest sequence alone on its fastest cp = 1 scheme
    assert plan.predicted_ms < 0.8 * lower_bound(plain, 64, batch).ms


def test_plan_cli_with_context_parallel_mixes_cp_degrees(capsys, tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, _long_tail_batch(1) * 4)) + "\n")
    argv = ["plan", "--cost-table", "llama13b_a800", "--gpus", "64", "--lengths", str(lengths),
            "--tokens-per-iteration", str(sum(_long_tail_batch(1))), "--iterations", "2", "--json"]
    assert main(argv) == 0
    without = json.loads(capsys.readouterr().out)
    assert main(argv + ["--context-parallel", "1,2,4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any(32768 in it["lengths"] for it in data["iterations"])
    for it in data["iterations"]:
        if 32768 in it["lengths"]:  # the long sequences on cp pipelines, the rest without cp
            long_ones = {i for i, l in enumerate(it["lengths"]) if l == 32768}
            for p in it["pipelines"]:
                held = {i for mb in p["micro_batches"] for i in mb}
                assert p["cp"] > 1 or not held & long_ones, it["strategy"]
            assert any(p["cp"] == 1 and p["micro_batches"] for p in it["pipelines"]), it["strategy"]
        for p in it["pipelines"]:
            assert len(p["ranks"]) == p["tp"] * p["pp"] * p["cp"]
            assert all(sum(it["lengths"][i] for i in mb) <= p["max_len"] for mb in p["micro_batches"])
    for cp_it, plain_it in zip(data["iterations"], without["iterations"]):
        assert cp_it["lengths"] == plain_it["lengths"]
        if 32768 in cp_it["lengths"]:
            assert cp_it["predicted_ms"] < 0.8 * plain_it["predicted_ms"], (cp_it["strategy"], plain_it["strategy"])


def test_profile_measures_cp_schemes_on_gloo_ranks(tmp_path, monkeypatch):
    from hgraph.profiling.profile_ranks import profile_ranks

    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path))
    profile = profile_ranks("hgraph.cli.demo:tiny_model", 2, ["tp1", "tp1,cp2"], [64, 128, 256], repeats=2, memory_gb=0.05)
    model = profile.cost_model
    cp2 = Degrees(tp=1, cp=2)
    assert set(profile.fits) == {Degrees(1, 1), cp2}
    assert all(t > 0 for t in profile.times_ms[cp2]) and model.source(cp2) == "profiled"
    # each cp rank keeps half the activations of a micro-batch: about twice the MaxLen
    assert 1.5 * model.max_len(Degrees(1, 1)) < model.max_len(cp2)
    # the profiled cp entry wins over the analytic one
    extended = with_context_parallel(model, (1, 2, 4))
    assert extended.stage_cost(cp2) == model.stage_cost(cp2) and extended.source(cp2) == "profiled"
    assert extended.source(Degrees(tp=1, cp=4)) == ANALYTIC
