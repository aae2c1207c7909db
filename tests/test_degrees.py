"""One degrees type: ``Degrees`` is what a ``Pipeline`` is apart from its ranks and what the planner
costs; its keys; one ``Strategy.check`` (the world and the model's dimensions, with the kv-head rule)
that compile, ``hgraph train``, the demo and profiling all run."""

import pytest

from hgraph.core.degrees import Degrees
from hgraph.errors import StrategyError
from hgraph.core.strategy import Pipeline, Strategy, fits, homogeneous


def test_a_pipeline_is_degrees_plus_ranks():
    p = Strategy.parse("tp2,pp2,vpp2 + 2x tp2,ep2").pipelines[0]
    assert isinstance(p, Degrees) and p.ranks == (0, 1, 2, 3)
    assert p.degrees == Degrees(2, 2, vpp=2) and type(p.degrees) is Degrees and str(p) == str(p.degrees)
    assert p.stage_key == Degrees(2, 2) and p.program_key == (1, 2, 1)
    ep = Pipeline(tp=2, ep=2)
    assert ep.program_key == (1, 2, 2) and ep.expert_mesh == (2, 1) and ep.size == 2
    with pytest.raises(TypeError):
        Degrees(2, 1, 2, 4)  # vpp and ep are keyword-only: a positional fourth degree is not silently vpp
    with pytest.raises(StrategyError, match="Pipeline vpp=2 needs pp >= 2"):
        Pipeline(vpp=2)


def test_check_covers_the_world_and_the_model_with_the_kv_head_rule():
    dims = {"heads": 8, "kv_heads": 2, "hidden": 64, "vocab": 256, "layers": 4}
    homogeneous(4, tp=4).check(4, dims)  # 2 kv heads on 4 tp ranks: each replicated twice (Megatron)
    with pytest.raises(StrategyError, match=r"tp=4 does not divide the key/value heads \(6\)"):
        homogeneous(4, tp=4).check(4, dict(dims, heads=12, kv_heads=6))
    with pytest.raises(StrategyError, match="uses 4 ranks but the world has 8"):
        homogeneous(4, tp=4).check(8, dims)
    with pytest.raises(StrategyError, match="pp=8 exceeds the model's 4 layers"):
        homogeneous(8, pp=8).check(8, dims)
    with pytest.raises(StrategyError, match="pp\\*vpp=8 virtual stages exceed"):
        Strategy((Pipeline(pp=2, vpp=4),)).check(2, dims)
    with pytest.raises(StrategyError, match="ep=2 but the model has no routed experts"):
        homogeneous(2, tp=2, ep=2).check(2, dims)
    homogeneous(2, tp=2).check(2)  # without model dimensions: the world alone


def test_fits_is_the_check_as_a_filter():
    dims = {"heads": 8, "kv_heads": 2, "layers": 4}
    assert fits(Degrees(4), 4, dims) and fits(Degrees(2, 2), 8, dims)
    assert not fits(Degrees(3), 4, dims)  # 3 does not divide the world
    assert not fits(Degrees(1, 8), 8, dims)  # more stages than layers
    assert fits(Degrees(1, 2, vpp=2), 2, dims) and not fits(Degrees(1, 2, vpp=4), 2, dims)
