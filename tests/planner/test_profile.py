"""Profiling: the least-squares fit and the ``hgraph profile`` command on a tiny model."""

import json

import numpy as np
import pytest

from hgraph.cli import main
from hgraph.errors import CostModelError
from hgraph.planner.cost import Scheme, load_cost_model
from hgraph.planner.profile import build_table, fit_stage_cost


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
    assert set(fits) == {Scheme(1, 1), Scheme(1, 2)} and fits[Scheme(1, 2)].r2 == pytest.approx(1.0)
    pp2 = model.stage_cost(Scheme(1, 2))
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
    assert model.schemes == (Scheme(1, 1), Scheme(1, 2))
    assert model.max_len(Scheme(1, 1)) > 0
    assert json.loads(out.read_text())["model_config"] == {"H": 128, "L": 4, "V": 1024}
    assert len(list((tmp_path / "cache" / "profile").iterdir())) == 1
    assert main(argv) == 0
    assert "using cached measurements" in capsys.readouterr().out


def test_profile_command_rejects_tensor_parallel_schemes(capsys):
    assert main(["profile", "--schemes", "tp2,pp1", "--device", "cpu"]) == 1
    assert "one process per rank" in capsys.readouterr().err
