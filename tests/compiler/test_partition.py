"""Partition: layer balancing, stage programs that chain back to the full program, clear errors."""

import pytest
import torch

from hgraph.errors import StrategyError
from hgraph.frontend import trace
from hgraph.models import Llama, LlamaConfig
from hgraph.core.layer_names import layer_index
from hgraph.passes.partition import balance_layers, partition


def test_balance_layers_minimises_the_largest_stage():
    assert balance_layers([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert balance_layers([4, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    assert balance_layers([1, 1, 1, 1, 1, 1], 3) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(StrategyError, match="pp=5"):
        balance_layers([1, 1], 5)


def test_layer_index():
    assert layer_index("model.layers.12.mlp.up_proj") == 12
    assert layer_index("transformer.h.3.attn") == 3
    assert layer_index("lm_head") is None


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=4))
    return trace(model, torch.randint(0, 256, (2, 12)))


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stages_chain_to_the_full_loss(traced, pp):
    gm = traced.graph_module
    stages = partition(gm, pp, lambda n: n.name in traced.param_names)
    assert len(stages) == pp
    assert sorted(layer for s in stages for layer in s.layers) == [0, 1, 2, 3]
    ids = torch.randint(0, 256, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    tgt = torch.randint(0, 256, (2, 12))
    full = traced.run(ids, pos, tgt)
    params = traced.params()
    values = {"input_ids": ids, "position_ids": pos, "targets": tgt}
    values.update({ph: traced.buffers()[fqn] for ph, fqn in traced.buffer_names.items()})
    for s in stages:
        assert all(b.dst == b.src + 1 for b in s.send + s.recv), "boundaries join neighbouring stages"
        args = [params[traced.param_names[p]] for p in s.params] + [values[i] for i in s.inputs]
        args += [values[b.name] for b in s.recv]
        outs = s.gm(*args)
        for name, value in zip(s.output_names, outs):
            values[name] = value
    assert torch.equal(values["loss"], full)
    # every parameter lives in exactly one stage (no tied weights in this model)
    owners = [p for s in stages for p in s.params]
    assert len(owners) == len(set(owners)) == len(traced.param_names)


def test_custom_layer_costs_move_the_cut(traced):
    stages = partition(traced.graph_module, 2, lambda n: n.name in traced.param_names, layer_costs=[10, 1, 1, 1])
    assert stages[0].layers == (0,) and stages[1].layers == (1, 2, 3)
    with pytest.raises(StrategyError, match="layer_costs"):
        partition(traced.graph_module, 2, lambda n: n.name in traced.param_names, layer_costs=[1, 1])
