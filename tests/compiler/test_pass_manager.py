"""Every compile stage runs as a named pass with a real record, and user passes anchor at any of them."""

import collections

import pytest
import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.passes.pipeline import BUILTIN, Pass
from hgraph.passes.recompute import regions
from hgraph.program.options import OverlapConfig

STAGES = ["precision", "annotate", "localize", "partition", "recompute", "insert_comm", "schedule"]


@pytest.fixture(scope="module")
def model_and_ids():
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=2)), torch.randint(0, 256, (1, 8))


def test_every_stage_is_a_pass_with_a_record_of_what_it_did(model_and_ids):
    model, ids = model_and_ids
    compiled = hgraph.compile(model, ["tp2,pp2"], example_inputs=ids,
                              options=hgraph.CompileOptions(compute_dtype=torch.bfloat16,
                                                            recompute=hgraph.RecomputeConfig("full"),
                                                            schedule=hgraph.ScheduleConfig(overlap=OverlapConfig())))
    for rank in range(4):
        compiled.program(0, rank)
    assert list(BUILTIN) == STAGES
    by_name = collections.defaultdict(list)
    for record in compiled.pass_history:
        by_name[record.name].append(record)
    # besides the passes, "plan": each rank's part of the Pull / Push plans (a timed step, no graph)
    assert set(by_name) == set(STAGES) | {"plan"}
    assert sorted(r.scope for r in by_name["plan"]) == [f"strategy tp2,pp2 rank {r}" for r in range(4)]
    # sizes are those of the graphs the compiled model holds, not numbers the pass reports itself
    (localize,) = by_name["localize"]
    assert localize.scope == "cp1,tp2" and localize.nodes_after == len(compiled.local_program(1, 2).graph.nodes)
    stages = compiled.stage_graphs(compiled.strategies[0].pipelines[0])
    recompute = {r.scope: r for r in by_name["recompute"]}
    for sg in stages:
        # the stage passes end at recompute; bind_rank then adds the rank context input (one placeholder)
        assert recompute[f"cp1,tp2,pp2 stage {sg.stage}"].nodes_after == len(sg.gm.graph.nodes) - 1
        assert regions(sg.gm)  # full recompute outlined layers: the record's sizes differ
        assert recompute[f"cp1,tp2,pp2 stage {sg.stage}"].nodes_after < recompute[f"cp1,tp2,pp2 stage {sg.stage}"].nodes_before
    (precision,) = by_name["precision"]
    assert precision.scope == "cp1,tp2" and precision.nodes_after > precision.nodes_before  # bf16: autocast's casts
    assert [r.scope for r in by_name["insert_comm"]] == ["strategy tp2,pp2"]
    assert sorted(r.scope for r in by_name["schedule"]) == [f"strategy tp2,pp2 rank {r}" for r in range(4)]
    assert all(compiled.program(0, r).overlap is not None for r in range(4))  # what the lowering made
    assert "insert_comm [strategy tp2,pp2]" in str(by_name["insert_comm"][0])


def test_user_passes_run_after_any_stage_at_its_level(model_and_ids):
    model, ids = model_and_ids
    seen = collections.defaultdict(list)

    def spy(anchor):
        def fn(gm, ctx):
            seen[anchor].append({
                "nodes": len(gm.graph.nodes), "mesh": ctx.mesh, "stages": ctx.stages is not None,
                "stage": None if ctx.stage is None else ctx.stage.stage,
                "plans": len(ctx.parameter_layouts), "program": None if ctx.program is None else ctx.program.rank,
            })
            return gm
        return Pass(f"spy_{anchor}", fn, after=anchor)

    compiled = hgraph.compile(model, ["tp2", "2x tp1"], example_inputs=ids,
                              options=hgraph.CompileOptions(passes=[spy(a) for a in STAGES]))
    assert set(seen) == set(STAGES)
    assert {s["mesh"] for s in seen["localize"]} == {(1, 2), (1, 1)}
    assert all(s["stages"] for s in seen["partition"])
    assert [s["stage"] for s in seen["recompute"]] == [0, 0]  # one stage per pipeline scheme
    assert all(s["plans"] == len(compiled.param_shapes) for s in seen["insert_comm"])
    assert [s["program"] for s in seen["schedule"]] == [0, 1, 0, 1]  # every rank's program, built at compile
    order = [r.name for r in compiled.pass_history if r.scope == "cp1,tp2"]
    assert order == ["precision", "spy_precision", "annotate", "spy_annotate", "localize", "spy_localize"]


def test_before_anchor_and_user_order_are_kept(model_and_ids):
    model, ids = model_and_ids
    keep = lambda gm, ctx: gm  # noqa: E731
    passes = [Pass("b", keep, after="annotate"), Pass("a", keep, before="annotate"),
              Pass("c", keep, after="annotate")]
    compiled = hgraph.compile(model, ["tp1"], example_inputs=ids,
                              options=hgraph.CompileOptions(passes=passes))
    assert [r.name for r in compiled.pass_history if r.scope == "cp1,tp1"] == ["precision", "a", "annotate", "b", "c", "localize"]


def test_unknown_anchor_or_disable_name_is_an_error_listing_the_valid_ones(model_and_ids):
    model, ids = model_and_ids
    keep = lambda gm, ctx: gm  # noqa: E731
    listing = r"\['precision', 'annotate', 'localize', 'partition', 'recompute', 'insert_comm', 'schedule'\]"
    with pytest.raises(hgraph.errors.InputError, match=r"unknown point 'insert_com'.*" + listing):
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(passes=[Pass("x", keep, after="insert_com")]))
    with pytest.raises(hgraph.errors.InputError, match=r"disable=\['recomput'\].*\['precision', 'annotate', 'localize', 'recompute'\]"):
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(disable=["recomput"]))
    with pytest.raises(hgraph.errors.InputError, match=r"disable=\['partition'\].*partition cannot be"):
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(disable=["partition"]))
    with pytest.raises(hgraph.errors.InputError, match="name 'localize' is taken"):
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(passes=[Pass("localize", keep, after="annotate")]))


def test_disabled_stage_pass_does_not_run(model_and_ids):
    model, ids = model_and_ids
    off = hgraph.compile(model, ["tp1,pp2"], example_inputs=ids,
                         options=hgraph.CompileOptions(disable=["recompute"],
                                                       recompute=hgraph.RecomputeConfig("full")))
    assert not any(regions(sg.gm) for sg in off.stage_graphs(off.strategies[0].pipelines[0]))
    assert "recompute" not in [r.name for r in off.pass_history]


def test_a_pass_that_changes_the_graph_where_products_live_in_the_context_raises(model_and_ids):
    model, ids = model_and_ids

    def rewrite(gm, ctx):
        return torch.fx.GraphModule(gm, gm.graph)

    with pytest.raises(hgraph.HGraphError, match=r"rewrite \[strategy tp1\] changed the graph at the strategy level"):
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(passes=[Pass("rewrite", rewrite, after="insert_comm")]))
