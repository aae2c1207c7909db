"""Profiling: the least-squares fit and the ``hgraph profile`` command on a tiny model."""

import json
import sys

import numpy as np
import pytest

from hgraph.cli.command import main
from hgraph.errors import CostModelError
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import load_cost_model
from hgraph.planner.fit import fit_stage_cost
from hgraph.profiling.profile_single import build_table


def test_fit_recovers_known_coefficients():
    lengths = [64, 128, 256, 512, 1024, 2048]
    a, b, c = 3e-6, 0.05, 12.0
    fit = fit_stage_cost(lengths, [a * l * l + b * l + c for l in lengths])
    assert fit.cost.a == pytest.approx(a, rel=1e-6)
    assert fit.cost.b == pytest.approx(b, rel=1e-6)
    assert fit.cost.c == pytest.approx(c, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel_error < 1e-9


def test_fit_with_noise_reports_its_error():
    rng = np.random.default_rng(0)
    lengths = np.repeat([128, 256, 512, 1024, 2048, 4096], 4)
    a, b, c = 1e-6, 0.1, 20.0
    clean = a * lengths**2 + b * lengths + c
    noisy = clean * (1 + rng.normal(0, 0.02, lengths.size))
    fit = fit_stage_cost(lengths, noisy)
    assert fit.cost.micro_batch_time([3000]) == pytest.approx(a * 9e6 + b * 3000 + c, rel=0.03)
    assert 0.98 < fit.r2 < 1.0
    assert fit.max_rel_error == pytest.approx(
        np.max(np.abs((fit.cost.a * lengths**2 + fit.cost.b * lengths + fit.cost.c) - noisy) / noisy)
    )
    assert "R²" in str(fit)


def test_fit_keeps_coefficients_non_negative():
    lengths = [100, 200, 300, 400]
    fit = fit_stage_cost(lengths, [50.0 - 0.01 * l for l in lengths])  # decreasing: no valid a, b
    assert min(fit.cost.a, fit.cost.b, fit.cost.c) >= 0.0


def test_fit_input_errors():
    with pytest.raises(CostModelError, match="at least 3 distinct lengths"):
        fit_stage_cost([128, 128, 256], [1.0, 1.0, 2.0])
    with pytest.raises(CostModelError, match="as many times"):
        fit_stage_cost([1, 2, 3], [1.0, 2.0])


def test_build_table_approximates_stages_from_block_times():
    lengths = [100, 200, 400]
    raw = {
        "lengths": lengths,
        "model_ms": [10 + 4 * (0.01 * l + 1e-5 * l * l) + 0.002 * l for l in lengths],
        "block_ms": [0.01 * l + 1e-5 * l * l for l in lengths],
        "layers": 4,
        "hidden": 64,
        "vocab": 100,
        "block_params": 64 * 64 * 12,
        "block_saved_bytes_per_token": 64 * 30.0,
        "device_memory": 16e9,
        "device": "cpu",
        "dtype": "float32",
    }
    model, fits = build_table(raw, [1, 2], "unit")
    assert set(fits) == {Degrees(1, 1), Degrees(1, 2)} and fits[Degrees(1, 2)].r2 == pytest.approx(1.0)
    pp2 = model.stage_cost(Degrees(1, 2))
    # 2 of 4 blocks plus everything outside the blocks (10 + 0.002 l)
    assert pp2.c == pytest.approx(10.0, rel=1e-6)
    assert pp2.b == pytest.approx(2 * 0.01 + 0.002, rel=1e-6)
    assert pp2.a == pytest.approx(2e-5, rel=1e-6)
    assert model.memory.activation_bytes(1) == 30.0
    assert model.memory.bytes_per_layer_h2 == 16 * 12
    with pytest.raises(CostModelError, match="pp=8 exceeds"):
        build_table(raw, [8], "unit")


def test_profile_command_writes_a_valid_table_and_caches(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "table.json"
    argv = [
        "profile",
        "--lengths",
        "16,32,64,128",
        "--repeats",
        "1",
        "--schemes",
        "tp1,pp1 tp1,pp2",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "measured 4 lengths" in printed and "R²" in printed and "max relative error" in printed
    model = load_cost_model(str(out))
    assert model.schemes == (Degrees(1, 1), Degrees(1, 2))
    assert model.max_len(Degrees(1, 1)) > 0
    assert json.loads(out.read_text())["model_config"] == {"H": 128, "L": 4, "V": 1024}
    assert len(list((tmp_path / "cache" / "profile").iterdir())) == 1
    assert main(argv) == 0
    assert "using cached measurements" in capsys.readouterr().out


def test_profile_command_rejects_tensor_parallel_schemes(capsys):
    assert main(["profile", "--schemes", "tp2,pp1", "--device", "cpu"]) == 1
    assert "one process per rank" in capsys.readouterr().err


# -- multi-rank profiling (hgraph.profiling.profile_ranks) -------------------------------------------

from dataclasses import dataclass  # noqa: E402

from hgraph.planner.cost import CostModel  # noqa: E402
from hgraph.profiling.profile import profile_cost_model  # noqa: E402
from hgraph.profiling.profile_ranks import factory_name, parse_schemes, profile_ranks  # noqa: E402
from hgraph.profiling.ranks_table import build_ranks_table  # noqa: E402


def tiny_llama():
    """Module level so spawned ranks can import it: 2 layers, hidden 64, heads/kv heads divisible by 2."""
    from hgraph.models import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128))


@dataclass(frozen=True)
class SizedFactory:
    hidden: int

    def __call__(self):
        return tiny_llama()


def test_factory_names_key_the_cache_and_reject_what_cannot_be_sent():
    assert factory_name("pkg.mod:make") == "pkg.mod:make"
    assert factory_name(tiny_llama) == f"{__name__}:tiny_llama"
    assert factory_name(SizedFactory(64)) == f"{__name__}:SizedFactory(hidden=64)"
    with pytest.raises(CostModelError, match="cannot be sent to other processes"):
        factory_name(lambda: None)
    with pytest.raises(CostModelError, match="not callable"):
        factory_name(3)


def test_parse_schemes_compact_and_spaced():
    assert parse_schemes("tp1,tp2,tp4,tp1pp2,tp2pp2,tp1pp4") == [
        Degrees(1, 1), Degrees(2, 1), Degrees(4, 1), Degrees(1, 2), Degrees(2, 2), Degrees(1, 4)
    ]
    assert parse_schemes("tp1,pp1 tp2,pp2") == [Degrees(1, 1), Degrees(2, 2)]
    assert parse_schemes("tp2,pp1") == [Degrees(2, 1)]  # one scheme in the spaced format
    assert parse_schemes("tp1; tp2; tp1,pp2") == [Degrees(1, 1), Degrees(2, 1), Degrees(1, 2)]  # the strategy syntax
    with pytest.raises(CostModelError, match="cannot parse scheme"):
        parse_schemes("tp2,xx3")


def _synthetic_raw():
    """World 2; tp1,pp1 (2 replicas) and tp1,pp2 (stage 0 on rank 0, stage 1 on rank 1)."""
    lengths = [100, 200, 400]
    t = lambda l, k=1.0: k * (2e-4 * l * l + 0.05 * l + 3.0)  # noqa: E731
    pp1_r0 = [[t(l) for l in lengths]] * 3
    pp1_r1 = [[t(l) for l in lengths], [t(l, 1.5) for l in lengths], [t(l) for l in lengths]]
    pp2_r0 = [[t(l, 0.5) for l in lengths]] * 3
    pp2_r1 = [[t(l, 0.6) for l in lengths]] * 3  # the slower stage sets T
    return {
        "model": "x:y", "world_size": 2, "schemes": ["tp1,pp1", "tp1,pp2"], "lengths": lengths,
        "repeats": 3, "hidden": 64, "layers": 2, "vocab": 256, "block_params": 64 * 64 * 12,
        "seconds": 1.0,
        "per_rank": [
            {"compute_ms": {"tp1,pp1": pp1_r0, "tp1,pp2": pp2_r0},
             "saved_bytes": {"tp1,pp1": [1000 + 256 * l for l in lengths],
                             "tp1,pp2": [900 + 128 * l for l in lengths]}},
            {"compute_ms": {"tp1,pp1": pp1_r1, "tp1,pp2": pp2_r1},
             "saved_bytes": {"tp1,pp1": [1000 + 256 * l for l in lengths],
                             "tp1,pp2": [700 + 160 * l for l in lengths]}},
        ],
    }


def test_build_ranks_table_aggregates_ranks_stages_and_memory():
    model, fits, times = build_ranks_table(_synthetic_raw(), memory_gb=1.0, name="unit")
    pp1 = model.stage_cost(Degrees(1, 1))
    # replicas: median over ranks per repeat, then median over repeats -> rank 0's clean times
    assert (pp1.a, pp1.b, pp1.c) == pytest.approx((2e-4, 0.05, 3.0), rel=1e-4)
    # stages: the slower stage (rank 1, 0.6x) sets T
    assert model.stage_cost(Degrees(1, 2)).b == pytest.approx(0.6 * 0.05, rel=1e-4)
    assert times[Degrees(1, 2)][0] == pytest.approx(0.6 * (2 + 5 + 3))
    assert fits[Degrees(1, 1)].r2 == pytest.approx(1.0)
    # A_tp1: pp1 has 256 B/token per rank; pp2 stages sum to 128 + 160 = 288 -> the larger, / (L * H)
    assert model.memory.activation_bytes(1) == pytest.approx(288 / (2 * 64))
    table = model.to_table()
    assert table["cluster_config"]["gpus_per_node"] == 2
    assert table["cluster_config"]["gpu_memory_bound"] == 10**9
    assert set(table["_fit"]) == {"tp1", "tp1,pp2"} and "r2" in table["_fit"]["tp1"]
    reloaded = CostModel.from_table(table)
    assert reloaded.max_len(Degrees(1, 1)) == model.max_len(Degrees(1, 1)) > 0
    with pytest.raises(CostModelError, match="memory budget"):
        build_ranks_table(_synthetic_raw(), memory_gb=0)


def test_profile_ranks_rejects_bad_requests_before_launching(tmp_path, monkeypatch):
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path))
    with pytest.raises(CostModelError, match="does not divide world size 2"):
        profile_ranks(tiny_llama, 2, ["tp4"], [16, 32, 64])
    with pytest.raises(CostModelError, match="at least 3 distinct lengths"):
        profile_ranks(tiny_llama, 2, ["tp1"], [16, 32])
    with pytest.raises(CostModelError, match="module-level function"):
        profile_ranks(lambda: tiny_llama(), 2, ["tp1"], [16, 32, 64])
    with pytest.raises(CostModelError, match="2·cp chunks"):
        profile_ranks(tiny_llama, 2, ["tp1,cp2"], [3, 32, 64])


def test_profile_on_two_gloo_ranks_then_cache_hit_through_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    lengths = [32, 64, 128]
    profile = profile_ranks(tiny_llama, 2, ["tp1", "tp2"], lengths, repeats=2, memory_gb=0.05)
    assert not profile.cached and profile.lengths == tuple(lengths)
    assert set(profile.fits) == {Degrees(1, 1), Degrees(2, 1)}
    for scheme, fit in profile.fits.items():
        assert min(fit.cost.a, fit.cost.b, fit.cost.c) >= 0
        assert fit.r2 <= 1.0 and fit.max_rel_error >= 0 and all(t > 0 for t in profile.times_ms[scheme])
    model = profile.cost_model
    # saved activations per token shrink per rank under TP, so tp2 fits more tokens
    assert 0 < model.max_len(Degrees(1, 1)) < model.max_len(Degrees(2, 1))
    assert "R²" in str(profile) and "MaxLen" in str(profile)
    # saved-for-backward bytes grow linearly with the tokens of a micro-batch on every rank
    for rank in json.loads(profile.cache_path.read_text().split("\n", 1)[1])["per_rank"]:  # a header line, then the payload
        for saved in rank["saved_bytes"].values():
            slopes = [(saved[i + 1] - saved[i]) / (lengths[i + 1] - lengths[i]) for i in range(2)]
            assert slopes[0] > 0 and slopes[1] == pytest.approx(slopes[0], rel=0.02)

    def no_launch(*_args, **_kwargs):
        raise AssertionError("a cached profile must not launch ranks")

    monkeypatch.setattr(sys.modules["hgraph.runtime.launch"], "launch", no_launch)
    out = tmp_path / "table.json"
    argv = ["profile", "--world-size", "2", "--schemes", "tp1,tp2", "--lengths", "32,64,128",
            "--repeats", "2", "--memory-gb", "0.05", "--model", factory_name(tiny_llama), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "cached in" in printed and "max relative error" in printed
    loaded = CostModel.from_table(out)
    assert loaded.schemes == (Degrees(1, 1), Degrees(2, 1))
    assert loaded.stage_cost(Degrees(2, 1)) == model.stage_cost(Degrees(2, 1))
    assert loaded.max_len(Degrees(2, 1)) == model.max_len(Degrees(2, 1))
    assert json.loads(out.read_text())["model_config"] == {"H": 64, "L": 2, "V": 256}
    # the API reads the same cache entry
    assert profile_cost_model(tiny_llama, 2, ["tp1", "tp2"], lengths, repeats=2).stage_cost(Degrees(1, 1)) == (
        model.stage_cost(Degrees(1, 1))
    )
