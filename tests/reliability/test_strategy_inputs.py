"""Strategy values that used to pass and be wrong: a degree named twice, a strategy string read
letter by letter, ``None`` as strategies."""

import pytest
import torch

import hgraph
from hgraph.core.degrees import Degrees
from hgraph.core.strategy import Strategy, as_strategies
from hgraph.errors import HGraphError, StrategyError
from hgraph.models import Llama, LlamaConfig


@pytest.mark.parametrize("text", ["tp2,tp4", "tp2,pp2,pp2", "2x tp1,tp1 + tp2"])
def test_a_degree_named_twice_is_refused(text):
    with pytest.raises(StrategyError, match="named twice"):
        Strategy.parse(text)


def test_degrees_named_twice_are_refused_too():
    with pytest.raises(StrategyError, match="degree tp is named twice in 'tp2,tp4'"):
        Degrees.parse("tp2,tp4")


def test_one_strategy_string_is_one_strategy():
    assert as_strategies("tp2 + 2x tp1") == [Strategy.parse("tp2 + 2x tp1")]
    assert as_strategies(Strategy.parse("tp2")) == [Strategy.parse("tp2")]


@pytest.mark.parametrize("bad", [None, 3])
def test_strategies_that_are_not_strategies_raise_hgraph_errors(bad):
    with pytest.raises(StrategyError, match="give a strategy such as"):
        as_strategies(bad)


def tiny():
    return Llama(LlamaConfig(vocab_size=64, hidden=16, heads=2, kv_heads=2, ffn=32, layers=1))


def test_compile_refuses_none_with_an_hgraph_error():
    with pytest.raises(HGraphError, match="strategies=None"):
        hgraph.compile(tiny(), None)


@pytest.mark.slow
def test_compile_takes_a_single_string_as_one_strategy():
    compiled = hgraph.compile(tiny(), "tp1", example_inputs=torch.randint(0, 64, (1, 8)))
    assert [str(s) for s in compiled.strategies] == ["tp1"]
