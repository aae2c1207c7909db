"""A rank's process groups in a pipeline, written out by hand for a cp2 x tp2, pp2 pipeline."""

from hgraph.core.strategy import Strategy


def test_groups_of_a_rank_are_its_tp_cp_stage_and_pipeline_ranks():
    (pipeline,) = Strategy.parse("cp2,tp2,pp2").pipelines
    assert pipeline.ranks == tuple(range(8))
    # stage 1 holds ranks 4..7 cp-major: (cp0: 4, 5), (cp1: 6, 7)
    assert pipeline.groups_of(7) == {"tp": (6, 7), "cp": (5, 7), "stage": (4, 5, 6, 7), "pipeline": tuple(range(8))}
    assert pipeline.groups_of(0) == {"tp": (0, 1), "cp": (0, 2), "stage": (0, 1, 2, 3), "pipeline": tuple(range(8))}
