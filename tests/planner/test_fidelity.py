"""Plan fidelity: iteration-term fits, the overlap-aware simulator, the online correction, the
trainer's predicted/measured record."""

import math

import numpy as np
import pytest
import torch

import hgraph
from hgraph.errors import CostModelError
from hgraph.models import Llama, LlamaConfig
from hgraph.planner.assign import Planner
from hgraph.planner.correction import OnlineCorrection, fidelity
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel, StageCost
from hgraph.planner.memory import MemoryRegression
from hgraph.profiling.profile_iteration import fit_activation, fit_terms
from hgraph.planner.timing import IterationPrediction, predict_iteration
from hgraph.planner.terms import AlphaBeta, IterationTerms, StrategyTerms, terms_of, with_terms
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.training.trainer import Trainer
from hgraph.core.strategy import Strategy

COSTS = {Degrees(1, 1): StageCost(1e-4, 0.05, 2.0), Degrees(1, 2): StageCost(5e-5, 0.025, 1.5),
         Degrees(2, 1): StageCost(6e-5, 0.03, 3.0)}


def cost_model(costs=COSTS):
    memory = MemoryRegression(activation=((1, 100.0), (2, 100.0)), bytes_per_layer_h2=16.0, alpha=0.75,
                              gap=(("node", 0.0),), safe_bound=0.0, gpu_memory=1e12, hidden=64, layers=4, vocab=256)
    return CostModel("synthetic", costs, memory, gpus_per_node=4, world_size=4)


def test_activation_fit_recovers_alpha_and_beta():
    alpha, beta = 0.3, 2e-6
    ranks = [{"exchange_ms": {str(n): [alpha + beta * n] * 3 for n in (4096, 32768, 131072, 524288)}}] * 2
    fit = fit_activation(ranks)
    assert fit.alpha_ms == pytest.approx(alpha, rel=1e-6) and fit.beta_ms_per_byte == pytest.approx(beta, rel=1e-6)
    assert fit.residual < 1e-9 and "GB/s" in str(fit)


def _synthetic_raw(model, truth, activation, strategies, noise=0.0, seed=0):
    """Per-rank profile rows generated from known terms: what ``_rank_main`` would record."""
    rng = np.random.default_rng(seed)
    base = IterationTerms(activation, 256.0, 4, {})
    dispatches = [[[[256, 128]], [[64]]], [[[512]], [[512]]], [[[64, 64, 64]], [[32, 32]]]]
    per_rank = []
    for rank in range(4):
        steps = []
        for k, name in enumerate(strategies):
            s = Strategy.parse(name)
            for sc in ("none", "overlap"):
                t = truth[(name, sc)]
                for b, d in enumerate(dispatches):
                    d = [d[i % len(d)] if s.pipelines[i].pp == 1 else [[n] for mb in d[i % len(d)] for n in mb]
                         for i in range(len(s.pipelines))]
                    for rep in range(3):
                        pred = predict_iteration(s, d, model, IterationTerms(activation, 256.0, 4, {(name, sc): t}), sc)
                        exposed = t.exposed_fraction * t.pull_push_ms if sc == "overlap" else t.pull_push_ms
                        steps.append({
                            "schedule": sc, "strategy": k, "batch": b, "repeat": rep,
                            "measured_ms": pred.total_ms * (1 + noise * rng.standard_normal()),
                            "optimizer_ms": t.optimizer_ms,
                            "pull_ms": t.pull_ms * (1.0 if rank == 3 else 0.8),  # the slowest rank's pull counts
                            "push_ms": t.push_ms + 5.0 * (rank != 1),  # rank 1 arrived last: waited least
                            "exposed_ms": exposed if rank == 2 else 0.5 * exposed,
                            "dispatch": d,
                        })
        per_rank.append({"exchange_ms": {}, "steps": steps, "strategies": strategies})
    return {"per_rank": per_rank, "hidden": 64, "layers": 4}, base


def test_fit_terms_recovers_known_pull_push_exposure_and_fixed_cost():
    model = cost_model()
    strategies = [str(Strategy.parse(s)) for s in ("4x tp1", "2x tp1,pp2", "tp2 + 2x tp1")]
    truth = {}
    for i, name in enumerate(strategies):
        pull, push, fixed = 10.0 + i, 20.0 + 2 * i, 30.0 + 5 * i
        truth[(name, "none")] = StrategyTerms(name, "none", pull, push, 1.0, 4.0, fixed)
        truth[(name, "overlap")] = StrategyTerms(name, "overlap", pull, push, 0.25, 4.0, fixed - 3)
    raw, _ = _synthetic_raw(model, truth, AlphaBeta(0.2, 1e-6), strategies)
    raw["per_rank"][0]["exchange_ms"] = {str(n): [0.2 + 1e-6 * n] for n in (4096, 65536, 524288)}
    terms = fit_terms(raw, model)
    assert terms.activation.alpha_ms == pytest.approx(0.2) and terms.bytes_per_token == 256.0
    for key, t in truth.items():
        got = terms.of(key[0], key[1])
        assert got.pull_ms == pytest.approx(t.pull_ms) and got.push_ms == pytest.approx(t.push_ms)
        assert got.exposed_fraction == pytest.approx(t.exposed_fraction)
        assert got.fixed_ms == pytest.approx(t.fixed_ms, abs=1e-6) and got.residual < 1e-9
        assert got.noise == 0.0 and got.samples == 9
    restored = terms_of(with_terms(model, terms))  # the terms travel in the cost table
    assert restored == terms and "exposed" in str(restored)


def test_fit_terms_reports_noise():
    model = cost_model()
    name = str(Strategy.parse("4x tp1"))
    truth = {(name, sc): StrategyTerms(name, sc, 10.0, 20.0, 1.0 if sc == "none" else 0.5, 1.0, 40.0)
             for sc in ("none", "overlap")}
    raw, _ = _synthetic_raw(model, truth, AlphaBeta(0.0, 0.0), [name], noise=0.05)
    t = fit_terms(raw, model).of(name, "none")
    assert 0.005 < t.noise < 0.15 and t.residual < 0.15
    assert t.fixed_ms == pytest.approx(40.0, abs=10.0)


def test_overlap_aware_simulator_against_a_hand_computed_timeline():
    """2 pipelines: tp1,pp2 and tp2, measured pull 30 + push 50 ms, fixed 7 ms, activation step
    0.5 ms + 1e-4 ms per byte at 256 bytes per token."""
    model = cost_model()
    s = Strategy.parse("(tp2) + (tp1,pp2)")
    assert [(p.tp, p.pp) for p in s.pipelines] == [(2, 1), (1, 2)]
    terms = IterationTerms(AlphaBeta(0.5, 1e-4), 256.0, 4, {
        (str(s), sc): StrategyTerms(str(s), sc, 30.0, 50.0, 1.0 if sc == "none" else 0.1, 2.0, 7.0)
        for sc in ("none", "overlap")})
    mbs = [[[300, 100]], [[100], [200]]]
    # pipeline 0 stage time per micro-batch: T(l) of tp1,pp2 + 2 activation steps of l tokens
    t0 = [5e-5 * l * l + 0.025 * l + 1.5 + 2 * (0.5 + 1e-4 * 256 * l) for l in (100, 200)]
    pipe0 = sum(t0) + 1 * max(t0)  # 1F1B: sum plus (pp - 1) times the largest
    pipe1 = 6e-5 * (300**2 + 100**2) + 0.03 * 400 + 3.0  # one micro-batch on tp2, no sends
    blocking = predict_iteration(s, mbs, model, terms, "none")
    assert blocking.pipeline_ms == pytest.approx((pipe1 + 80.0, pipe0 + 80.0))
    assert blocking.total_ms == pytest.approx(max(pipe0, pipe1) + 80.0 + 7.0)
    overlap = predict_iteration(s, mbs, model, terms, "overlap")
    # overlap: 10% of the 80 ms stays exposed, or what the pipeline's compute cannot hide
    expected = [t + max(8.0, 80.0 - t) for t in (pipe1, pipe0)]
    assert overlap.pipeline_ms == pytest.approx(tuple(expected))
    assert overlap.total_ms == pytest.approx(max(expected) + 7.0)
    assert overlap.total_ms < blocking.total_ms
    assert overlap.terms == pytest.approx((overlap.compute_ms, overlap.comm_ms, 7.0))
    with pytest.raises(CostModelError, match="no measured iteration terms for strategy 4x "):
        predict_iteration(Strategy.parse("4x tp1"), [[[8]]] * 4, model, terms, "none")


def test_correction_converges_on_a_synthetic_sequence_with_outliers():
    """Measured = 1.4 × compute + 0.6 × comm + fixed + 12 ms for strategy B, 2 % noise and 10 %
    of the iterations hit by a 3× burst: the corrected prediction converges to the truth."""
    rng = np.random.default_rng(0)
    corr = OnlineCorrection()
    errors_before, errors_after = [], []
    for i in range(120):
        strategy = "A" if i % 2 else "B"
        x = (rng.uniform(50, 300), rng.uniform(5, 60), rng.uniform(10, 30))
        pred = IterationPrediction(strategy, *x, pipeline_ms=(sum(x),))
        truth = 1.4 * x[0] + 0.6 * x[1] + x[2] + (12.0 if strategy == "B" else 0.0)
        measured = truth * (1 + 0.02 * rng.standard_normal()) * (3.0 if rng.random() < 0.1 else 1.0)
        (errors_before if i < 10 else errors_after).append(abs(corr.apply(pred) - truth) / truth)
        corr.observe(pred, measured)
    assert errors_before[0] > 0.2  # uncorrected
    assert np.median(errors_after[-40:]) < 0.03
    assert corr.scales[0] == pytest.approx(1.4, rel=0.05)
    # comm and fixed are nearly collinear here (the ridge keeps comm near 1, not at 0.6): the
    # per-strategy offsets take what the scales leave, so B's 12 ms comes out at 12-20 ms
    assert corr.offsets["B"] - corr.offsets["A"] == pytest.approx(16.0, abs=5.0)
    assert corr.observations == 120 and "compute ×" in str(corr)
    with pytest.raises(CostModelError, match="positive"):
        corr.observe(pred, 0.0)


def test_fidelity_summary():
    f = fidelity([100, 220, 290], [110, 200, 300])
    assert f["median_rel_error"] == pytest.approx(10 / 110)
    assert f["rank_correlation"] == pytest.approx(1.0) and f["pairs"] == 3


def _tiny():
    return Llama(LlamaConfig(vocab_size=64, hidden=16, layers=2, heads=2, kv_heads=2, ffn=32), seed=0)


def test_trainer_records_predicted_and_measured_and_feeds_the_correction():
    model = _tiny()
    strategies = ["2x tp1", "tp2"]
    costs = {Degrees(1, 1): StageCost(1e-5, 0.01, 1.0), Degrees(2, 1): StageCost(1e-5, 0.006, 1.5)}
    terms = IterationTerms(AlphaBeta(0.1, 1e-6), 64.0, 2, {
        (str(Strategy.parse(s)), "none"): StrategyTerms(str(Strategy.parse(s)), "none", 1.0, 1.0, 1.0, 0.5, 0.5)
        for s in strategies})
    g = torch.Generator().manual_seed(0)
    data = [[torch.randint(0, 64, (n,), generator=g) for n in (12, 30, 7)] for _ in range(4)]

    def body(comm):
        compiled = hgraph.compile(model, strategies, example_inputs=torch.randint(0, 64, (1, 8)))
        planner = Planner(cost_model(costs), compiled.strategies, terms=terms, correction=OnlineCorrection())
        trainer = Trainer(compiled, comm=comm, planner=planner)
        for batch in data:
            trainer.step(batch)
        return trainer.history, planner.correction.observations

    results = run_threads(body, 2, timeout=300)
    (history, observed), (other, observed_elsewhere) = results
    assert observed == 4 and observed_elsewhere == 0  # rank 0 plans, so rank 0 corrects
    for rec, twin in zip(history, other):
        assert rec["measured_ms"] > 0 and rec["optimizer_ms"] >= 0 and rec["predicted_ms"] > 0
        assert rec["prediction"]["strategy"] == rec["strategy"] and rec["prediction"] == twin["prediction"]
        assert rec["predicted_raw_ms"] == pytest.approx(sum(rec["prediction"][k] for k in ("compute_ms", "comm_ms", "fixed_ms")))
    # each prediction is the correction fitted to the iterations before it: replayed independently here
    replay = OnlineCorrection()
    for rec in history:
        pred = IterationPrediction(**{**rec["prediction"], "pipeline_ms": tuple(rec["prediction"]["pipeline_ms"])})
        assert rec["predicted_ms"] == pytest.approx(replay.apply(pred))
        replay.observe(pred, rec["measured_ms"])
    assert history[0]["predicted_ms"] == pytest.approx(history[0]["predicted_raw_ms"])
    assert history[-1]["predicted_ms"] != pytest.approx(history[-1]["predicted_raw_ms"])  # corrected
    assert all(math.isfinite(r["predicted_ms"]) for r in history)


def test_planner_refuses_candidates_without_measured_terms():
    terms = IterationTerms(AlphaBeta(0.0, 0.0), 64.0, 2, {})
    with pytest.raises(CostModelError, match="hgraph profile --world-size N --strategies"):
        Planner(cost_model(), ["4x tp1"], terms=terms)


def tiny_llama():
    """Module level so spawned ranks can import it."""
    return Llama(LlamaConfig(vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=2, ffn=64))


def test_profile_command_measures_iteration_terms_on_two_gloo_ranks(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from hgraph.cli.command import main
    from hgraph.profiling.profile_ranks import factory_name

    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "table.json"
    argv = ["profile", "--world-size", "2", "--schemes", "tp1,tp2,tp1pp2", "--lengths", "16,32,64", "--repeats", "1",
            "--model", factory_name(tiny_llama), "--strategies", "2x tp1; tp2; tp1,pp2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "iteration terms (measured in" in printed and "activation step" in printed
    terms = terms_of(CostModel.from_table(out))
    for name in ("2x tp1", "tp2", "tp1,pp2"):
        for schedule in ("none", "overlap"):
            t = terms.of(name, schedule)
            assert t.pull_ms > 0 and t.push_ms > 0 and t.samples == 3 and 0 <= t.exposed_fraction <= 1
            assert t.optimizer_ms > 0 and math.isfinite(t.fixed_ms) and t.residual >= 0 and t.noise >= 0
    assert terms.activation.alpha_ms >= 0 and terms.bytes_per_token == 4 * 32
    assert json.loads(out.read_text())["_fit"]["tp1"]["noise"] >= 0  # T(l) noise too

    def no_launch(*_args, **_kwargs):
        raise AssertionError("a cached profile must not launch ranks")

    monkeypatch.setattr(sys.modules["hgraph.runtime.launch"], "launch", no_launch)
    assert main(argv) == 0
    assert capsys.readouterr().out.count("cached in") == 2
