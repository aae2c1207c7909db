"""Compile-time fast paths: parameters of equal shape and placement (the layers of a model) share
one set of Pull / Push layouts and plans, equal to the layouts built holder by holder from the
stage programs (the oracle); and ``compile`` leaves the garbage collector as it found it."""

import gc

import torch

import hgraph
from hgraph.core.layout import Layout, LayoutUnion
from hgraph.models import Llama, LlamaConfig
from hgraph.program.options import BuildConfig, CompileOptions

STRATEGIES = ["tp4 + 2x tp2", "2x tp2,pp2", "8x tp1"]


def _compile(**kw):
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    return hgraph.compile(Llama(LlamaConfig(layers=4, kv_heads=4), seed=0), STRATEGIES, example_inputs=ids, **kw)


def _expected(compiled, index: int) -> dict[str, tuple]:
    """name -> (holders, compute, grads), built holder by holder from each stage's placeholders."""
    strategy = compiled.strategies[index]
    found: dict[str, list] = {}
    for i, pipeline in enumerate(strategy.pipelines):
        local = compiled.local_program(*pipeline.stage_mesh)
        meta = {n.name: n.meta for n in local.graph.nodes if n.op == "placeholder"}
        for sg in compiled.stage_graphs(pipeline):
            for ph in sg.params:
                name = compiled.traced.param_names[ph]
                stage = sg.stage % pipeline.pp
                entry = (i, stage, compiled.param_shapes[name], pipeline.stage_ranks(stage), pipeline.stage_mesh,
                         tuple(meta[ph]["hgraph_param_spec"]), tuple(meta[ph]["hgraph_grad_spec"]))
                if entry not in found.setdefault(name, []):
                    found[name].append(entry)
    out = {}
    for name, entries in found.items():
        compute = [Layout(shape, ranks, mesh, spec) for _, _, shape, ranks, mesh, spec, _ in entries]
        grads = [Layout(shape, ranks, mesh, grad) for _, _, shape, ranks, mesh, _, grad in entries]
        out[name] = (
            tuple((i, s) for i, s, *_ in entries),
            compute[0] if len(compute) == 1 else LayoutUnion(tuple(compute), "duplicate"),
            grads[0] if len(grads) == 1 else LayoutUnion(tuple(grads), "partial"),
        )
    return out


def test_layers_share_layouts_and_plans_equal_to_layouts_built_per_holder():
    compiled = _compile(options=CompileOptions(build=BuildConfig(rank=1)))
    for index in range(len(STRATEGIES)):
        layouts = compiled.parameter_layouts(index)
        expected = _expected(compiled, index)
        assert set(layouts) == set(expected)
        for name, lay in layouts.items():
            assert (lay.holders, lay.compute, lay.grads) == expected[name], f"{STRATEGIES[index]} {name}"
        comm = compiled.parameter_comm(index, 1)
        first, later = "layers.0.attn.q_proj.weight", "layers.1.attn.q_proj.weight"
        if layouts[first].holders == layouts[later].holders:  # same stages: one shared layout and plan
            assert layouts[first].compute is layouts[later].compute
            assert comm[first].pull.plan is comm[later].pull.plan
            assert comm[first].push.plan is comm[later].push.plan


def test_compile_leaves_the_garbage_collector_as_it_found_it():
    assert gc.isenabled()
    _compile(options=CompileOptions(build=BuildConfig(rank=0)))
    assert gc.isenabled()
    gc.disable()
    try:
        _compile(options=CompileOptions(build=BuildConfig(rank=0)))
        assert not gc.isenabled()
    finally:
        gc.enable()
