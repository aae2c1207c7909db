"""Baselines: megatron packing, homogeneous-tuned, the hydraulis reference; hgraph is never worse."""

import pytest

from hgraph.errors import PlanError
from hgraph.planner import baselines
from hgraph.planner.assign import Planner
from hgraph.planner.batches import make_batches, read_lengths, sample_path
from hgraph.planner.cost import CostModel
from hgraph.planner.timing import check_plan


@pytest.fixture(scope="module")
def llama7b():
    return CostModel.preset("llama7b_a800")


@pytest.fixture(scope="module")
def batches():
    return make_batches(read_lengths(sample_path()), 20_000, 16_384, 2, seed=3)


def test_homogeneous_strategies_cover_every_dividing_scheme(llama7b):
    names = {str(s) for s in baselines.homogeneous_strategies(llama7b, 8)}
    assert "4x tp1,pp2" in names and "tp8" in names and all("tp16" not in n for n in names)
    with pytest.raises(PlanError, match="gpus=0"):
        baselines.homogeneous_strategies(llama7b, 0)


def test_megatron_packs_best_fit_decreasing_to_the_context_length(llama7b):
    (plan,) = baselines.megatron(llama7b, 8, [[600, 500, 400, 300, 200]], max_len=1000)
    check_plan(plan, [600, 500, 400, 300, 200])
    mbs = sorted(sorted(mb) for p in plan.pipelines for mb in p.micro_batch_lengths)
    assert mbs == [[200, 300, 500], [400, 600]]
    assert len({p.pipeline.degrees for p in plan.pipelines}) == 1


def test_megatron_needs_a_scheme_that_holds_the_longest_sequence(llama7b):
    with pytest.raises(PlanError, match="holds a 200000-token sequence"):
        baselines.megatron(llama7b, 8, [[200_000]], max_len=300_000)


def test_hgraph_is_never_worse_than_the_homogeneous_baselines(llama7b, batches):
    """Consistency check: every homogeneous strategy is among the candidates and homogeneous_tuned
    runs the same planner, so this guards the plumbing, not optimality (see test_optimum_oracle.py)."""
    tuned = baselines.homogeneous_tuned(llama7b, 8, batches)
    mega = baselines.megatron(llama7b, 8, batches, max_len=16_384)
    assert len({str(p.strategy) for p in tuned}) == 1  # one strategy for the whole run
    candidates = baselines.homogeneous_strategies(llama7b, 8) + ["tp4 + 2x tp2", "tp4 + 2x tp1,pp2"]
    planner = Planner(llama7b, candidates)
    for batch, t, m in zip(batches, tuned, mega):
        ours = planner.plan(batch)
        check_plan(t, batch)
        check_plan(m, batch)
        assert ours.predicted_ms <= t.predicted_ms * (1 + 1e-9)
        assert t.predicted_ms <= m.predicted_ms * (1 + 1e-9)


def test_hydraulis_reference_gives_valid_plans_that_hgraph_matches(llama7b):
    batch = [9000, 4000, 3000, 1200, 900, 700, 500, 300, 200, 100]
    candidates = ["2x tp4", "tp4 + 2x tp2", "4x tp2"]
    ref = baselines.HydraulisReference(llama7b, candidates, orders=20, time_limit=0.2)
    plan = ref.plan(batch)
    check_plan(plan, batch)
    ours = Planner(llama7b, candidates).plan(batch)
    assert ours.predicted_ms <= plan.predicted_ms * (1 + 1e-9)
