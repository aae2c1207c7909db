"""The planner knows expert parallelism: ep schemes in cost tables, the all-to-all and load-imbalance
terms of the analytic model, proposals and dispatch that choose ep pipelines, and ``hgraph profile``
measuring ep schemes on local gloo ranks."""

from __future__ import annotations

import math

import pytest

from hgraph.errors import CostModelError, StrategyError
from hgraph.core.strategy import Pipeline
from hgraph.models.zoo import ZooFactory
from hgraph.planner.analytic import HardwareSpec, ModelConfig, analytic_cost_model, default_schemes, stage_cost
from hgraph.planner.assign import pipeline_costs
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel
from hgraph.planner.experts import MoELayerShape, all_to_all_bytes_per_token, expert_imbalance, layer_imbalance
from hgraph.planner.proposal import propose
from hgraph.planner.timing import AlphaBetaComm
from hgraph.profiling.profile_ranks import parse_schemes, profile_ranks

MIXTRAL_8X7B = ModelConfig(hidden=4096, layers=32, heads=32, ffn=14336, vocab=32000, kv_heads=8, experts=8, top_k=2)
H100 = HardwareSpec.preset("h100-80gb")


def test_ep_schemes_parse_print_and_round_trip_through_tables():
    assert Degrees.parse("tp4,ep4") == Degrees(4, ep=4) and str(Degrees(4, ep=4)) == "tp4,ep4"
    assert parse_schemes("tp2ep2,tp4ep4,tp4") == [Degrees(2, ep=2), Degrees(4, ep=4), Degrees(4)]
    assert Pipeline(tp=2, cp=2, ep=4).stage_key == Degrees(2, 1, 2, ep=4)
    with pytest.raises(StrategyError, match="ep=4 does not divide"):
        Degrees(2, ep=4)
    model = analytic_cost_model(MIXTRAL_8X7B, H100, [Degrees(4), Degrees(4, ep=4)])
    again = CostModel.from_table(model.to_table())
    assert again.schemes == model.schemes and again.stage_cost(Degrees(4, ep=4)) == model.stage_cost(Degrees(4, ep=4))
    assert model.max_len(Degrees(4, ep=4)) == model.max_len(Degrees(4))  # no more expert bytes per rank under ep


def test_expert_imbalance_from_router_counts():
    assert expert_imbalance([5, 5, 5, 5], 2) == 1.0
    assert expert_imbalance([8, 4, 2, 2], 2) == pytest.approx(12 / 8)  # groups {0,1}: 12 rows, {2,3}: 4
    assert expert_imbalance([8, 4, 2, 2], 4) == pytest.approx(8 / 4)
    assert layer_imbalance([[1, 1, 1, 1], [3, 1, 0, 0]], 2) == pytest.approx(2.0)
    with pytest.raises(CostModelError, match="ep=3"):
        expert_imbalance([1, 1, 1, 1], 3)


def test_analytic_ep_terms():
    """tp4,ep4 against tp4 (Mixtral-8x7B shapes, H100): the MLP's two all-reduces per layer leave, four
    all-to-alls of each rank's quarter of the tokens' off-group rows and the tp gather come in; an
    imbalance scales exactly the experts' FLOP term."""
    moe = MIXTRAL_8X7B.moe(32)
    assert all_to_all_bytes_per_token(moe, 1, 4, 4) == 4 * 32 * 2 * 3 / 4 / 4 * 4096 * 2
    assert all_to_all_bytes_per_token(moe, 1, 4, 1) == 0
    even, skewed = stage_cost(MIXTRAL_8X7B, H100, Degrees(4, ep=4)), stage_cost(MIXTRAL_8X7B, H100, Degrees(4, ep=4), 1.5)
    speed = H100.peak_flops * H100.mfu
    assert skewed.b - even.b == pytest.approx(0.5 * 3 * 32 * moe.expert_flops_per_token() / 4 / speed * 1e3)
    assert skewed.a == even.a and skewed.c == even.c
    tp = stage_cost(MIXTRAL_8X7B, H100, Degrees(4))
    bw = H100.intra_bw
    reduces = 32 * 2 * 2 * 3 / 4 * 2 * 4096 / bw
    moved = (all_to_all_bytes_per_token(moe, 1, 4, 4) + 2 * 32 * 3 / 4 * 4096 * 2) / bw
    assert even.b - tp.b == pytest.approx((moved - reduces) * 1e3)
    assert Degrees(4, ep=4) in default_schemes(MIXTRAL_8X7B, H100)
    six = ModelConfig(hidden=4096, layers=32, heads=32, ffn=14336, vocab=32000, kv_heads=8, experts=6, top_k=2)
    assert Degrees(4, ep=2) in default_schemes(six, H100) and Degrees(4, ep=4) not in default_schemes(six, H100)
    with pytest.raises(CostModelError, match="has none"):
        stage_cost(ModelConfig(hidden=64, layers=2, heads=4, ffn=128, vocab=256), H100, Degrees(2, ep=2))


def test_pull_push_model_counts_the_expert_share_an_ep_pipeline_holds():
    comm = AlphaBetaComm(param_count=1e9, layers=32, expert_param_count=8e8)
    from hgraph.core.strategy import Strategy

    dense = comm.pull_push_ms(Strategy.parse("cp2,tp2"), 0)
    ep = comm.pull_push_ms(Strategy.parse("cp2,tp2,ep4"), 0)
    alpha = 2 * math.ceil(math.log2(4)) * comm.alpha_ms
    assert (ep - alpha) / (dense - alpha) == pytest.approx((2e8 + 8e8 / 2) / 1e9)


def _table(ep_b: float) -> CostModel:
    """tp2 and tp2,ep2 measured, ep2 cheaper per token when ``ep_b`` < 0.2."""
    return CostModel.from_table({
        "strategies": [dict(tp=2, pp=1, a=1e-4, b=0.2, c=1.0), dict(tp=2, pp=1, ep=2, a=1e-4, b=ep_b, c=1.0)],
        "memory_regression": {"A": {"tp2": 1}, "B": 1, "alpha": 0.75, "gap": {"node": 0}, "safe_bound": 0},
        "model_config": {"H": 64, "L": 2, "V": 256},
        "cluster_config": {"gpus_per_node": 8, "gpu_memory_bound": 1e15},
    }, name="moe")


def test_proposal_and_dispatch_choose_ep_pipelines_when_they_are_faster():
    lengths = [512] * 16
    faster = propose(_table(0.1), 4, lengths)
    assert any(p.ep == 2 for s in faster for p in s.pipelines)
    assert all(p.ep == 1 for s in propose(_table(10.0), 4, lengths)[:1] for p in s.pipelines)
    costs = pipeline_costs(_table(0.1), faster[0])
    assert {c.b for c in costs} == {0.1}  # the ep pipelines are costed with the ep entry


@pytest.mark.slow
def test_profile_measures_ep_schemes_on_gloo_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    profile = profile_ranks(ZooFactory("mixtral"), 2, ["tp2", "tp2ep2"], [32, 64, 128], repeats=1, memory_gb=0.05)
    assert set(profile.fits) == {Degrees(2), Degrees(2, ep=2)}
    assert all(t > 0 for times in profile.times_ms.values() for t in times)
    table = profile.cost_model.to_table()
    assert {"tp": 2, "pp": 1, "ep": 2} in [{k: e[k] for k in ("tp", "pp", "ep") if k in e} for e in table["strategies"]]


def test_moe_layer_shape_flops():
    shape = MoELayerShape(hidden=64, experts=4, top_k=2, expert_ffn=128, layers=2)
    assert shape.expert_flops_per_token() == 2 * 2 * 3 * 64 * 128
