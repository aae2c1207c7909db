"""User passes plug in at named points; the example custom resharding pass keeps results identical."""

import importlib.util
from pathlib import Path

import pytest
import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.kernels.collectives import all_reduce, reduce_scatter
from hgraph.passes.pipeline import Pass

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("custom_pass_example", ROOT / "examples" / "custom_pass.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_all_reduce_pass_changes_the_program_not_the_result():
    example = load_example()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=2))
    ids = torch.randint(0, 256, (2, 16))
    plain = hgraph.compile(model, ["tp2 + 2x tp1"], example_inputs=ids)
    custom = hgraph.compile(
        model, ["tp2 + 2x tp1"], example_inputs=ids,
        options=hgraph.CompileOptions(passes=[Pass("split_all_reduce", example.split_all_reduce, after="localize")]),
    )
    targets = {n.target for n in custom.local_program(1, 2).graph.nodes}
    assert all_reduce not in targets and reduce_scatter in targets
    assert all_reduce in {n.target for n in plain.local_program(1, 2).graph.nodes}
    assert "split_all_reduce" in [r.name for r in custom.pass_history]
    kinds = [r.tensor for r in custom.subgraphs(0, 0) if r.kind == "communicate_activation"]
    assert any("reduce_scatter/tp" in k for k in kinds) and not any("(all_reduce/tp)" in k for k in kinds)
    loss_a, grads_a = plain.simulate(0, ids)
    loss_b, grads_b = custom.simulate(0, ids)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-7)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7)


def test_unknown_insertion_point_and_disabling():
    model = Llama(LlamaConfig(layers=1))
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(hgraph.HGraphError, match="unknown point 'nowhere'"):
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(passes=[Pass("x", lambda gm, ctx: gm, after="nowhere")]))
    with pytest.raises(hgraph.HGraphError, match="returned"):
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(passes=[Pass("bad", lambda gm, ctx: None, after="localize")]))


def test_disable_switches_a_pass_off_and_rejects_unknown_names():
    example = load_example()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=1))
    ids = torch.randint(0, 256, (1, 8))
    split = Pass("split_all_reduce", example.split_all_reduce, after="localize")
    off = hgraph.compile(model, ["tp2"], example_inputs=ids,
                         options=hgraph.CompileOptions(passes=[split], disable=["split_all_reduce"]))
    targets = {n.target for n in off.local_program(1, 2).graph.nodes}
    assert all_reduce in targets and reduce_scatter not in targets  # the pass did not run
    assert "split_all_reduce" not in [r.name for r in off.pass_history]
    assert "localize" in [r.name for r in off.pass_history]
    with pytest.raises(hgraph.errors.InputError, match=r"disable=\['localise'\] names no pass.*'annotate', 'localize'"):
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(disable=["localise"]))
    with pytest.raises(hgraph.errors.InputError, match="split_all_reduce"):  # a user pass is only known when given
        hgraph.compile(model, ["tp1"], example_inputs=ids,
                       options=hgraph.CompileOptions(disable=["split_all_reduce"]))
