"""``compile(rank=r)``: a rank builds its own plans and programs; any other rank's, built on first use,
equal a compile of every rank (``rank=None``), and every pull/push plan of every rank equals the full
LNK plan's steps for that rank (the oracle: ``solve`` over all ranks). Under ``hgraph.launch`` each
process compiles its own rank by default."""

import torch

import hgraph
from hgraph.lnk import solve
from hgraph.models import Llama, LlamaConfig
from hgraph.core.batch import next_token_targets
from hgraph.program.options import OverlapConfig

STRATEGIES = ["4x tp2", "tp4 + 2x tp2", "2x tp2,pp2", "8x tp1"]
WORLD = 8


def _model() -> Llama:
    return Llama(LlamaConfig(layers=2, kv_heads=4), seed=0)


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))


def _planned_ranks(compiled) -> set[int]:
    return {int(r.scope.rsplit("rank ", 1)[1]) for r in compiled.pass_history if r.name == "plan"}


def test_rank_compile_plans_only_its_rank_and_others_on_demand_equal_a_full_compile():
    everyone = hgraph.compile(_model(), STRATEGIES, example_inputs=_ids(),
                              options=hgraph.CompileOptions(build=hgraph.BuildConfig(rank=None)))
    mine = hgraph.compile(_model(), STRATEGIES, example_inputs=_ids(),
                          options=hgraph.CompileOptions(build=hgraph.BuildConfig(rank=3)))
    assert _planned_ranks(mine) == {3} and _planned_ranks(everyone) == set(range(WORLD))
    assert "rank 3" in str(mine)
    for index, strategy in enumerate(STRATEGIES):
        for rank in range(WORLD):
            a, b = everyone.program(index, rank), mine.program(index, rank)
            assert (a.pipeline, a.stage, a.groups) == (b.pipeline, b.stage, b.groups)
            assert a.stage_graph.gm.code == b.stage_graph.gm.code
            assert [str(pc.pull.plan) for pc in a.pulls] == [str(pc.pull.plan) for pc in b.pulls]
            assert [str(pc.push.plan) for pc in a.pushes] == [str(pc.push.plan) for pc in b.pushes]
            assert mine.explain(index, rank, backward=False) == everyone.explain(index, rank, backward=False)
            for pc in b.pulls:
                for sub in (pc.pull, pc.push):
                    full = solve(sub.src, sub.dst, itemsize=sub.plan.itemsize)
                    assert sub.plan.steps_for(rank) == full.steps_for(rank), f"{strategy} rank {rank} {sub.tensor}"
                    assert sub.bytes == full.bytes_moved
    assert _planned_ranks(mine) == set(range(WORLD))  # built lazily by the loop above


def test_lazily_built_ranks_simulate_like_the_unmodified_model():
    torch.manual_seed(0)
    model = _model()
    ids = _ids()
    model.zero_grad()
    logits = model(ids)
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten())
    ref.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    compiled = hgraph.compile(model, STRATEGIES[1:3], example_inputs=ids,
                              options=hgraph.CompileOptions(build=hgraph.BuildConfig(rank=0)))
    for index in range(2):
        loss, got = compiled.simulate(index, ids)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6)


def test_verify_switches_the_overlap_dry_run_over_every_rank():
    quiet = hgraph.compile(_model(), STRATEGIES[:2], example_inputs=_ids(),
                           options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig()),
                                                         build=hgraph.BuildConfig(rank=1, verify=False)))
    assert _planned_ranks(quiet) == {1}  # no dry run: no other rank's plans
    quiet.check_overlap(0, [2] * 4)  # the Trainer's per-dispatch check follows verify
    assert _planned_ranks(quiet) == {1}
    quiet.verify_overlap(0, [2] * 4)  # the explicit, offline check builds and dry-runs every rank
    assert _planned_ranks(quiet) == set(range(WORLD))
    checked = hgraph.compile(_model(), STRATEGIES[:2], example_inputs=_ids(),
                             options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig()),
                                                           build=hgraph.BuildConfig(rank=1)))
    assert checked.verify and _planned_ranks(checked) == set(range(WORLD))  # small world: verified by default


def _own(comm=None):
    compiled = hgraph.compile(_model(), ["2x tp1", "tp2"], example_inputs=_ids())
    return compiled.rank, sorted(_planned_ranks(compiled))


def test_launched_processes_compile_their_own_rank_by_default():
    assert hgraph.launch(_own, 2, timeout=300) == [(0, [0]), (1, [1])]
