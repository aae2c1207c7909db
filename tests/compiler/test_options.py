"""Options as values: ``CompileOptions`` and the ``Trainer``'s configs are frozen kw-only dataclasses
with a docstring per field, checked where they are made (naming the field and the fix); ``compile``
and ``Trainer`` take at most six parameters; the top level holds at most sixteen documented names."""

import dataclasses
import inspect
import re

import pytest
import torch

import hgraph
from hgraph.core.degrees import Degrees
from hgraph.core.field_docs import field_docs
from hgraph.errors import HGraphError, InputError, StrategyError, TrainingError
from hgraph.models import Llama, LlamaConfig
from hgraph.program.options import BuildConfig, CompileOptions, OverlapConfig, RecomputeConfig, ScheduleConfig
from hgraph.training.configs import AdamWConfig, RunConfig

CONFIGS = (CompileOptions, ScheduleConfig, OverlapConfig, RecomputeConfig, BuildConfig, AdamWConfig, RunConfig)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring_and_the_value_is_frozen(cls):
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    names = [f.name for f in dataclasses.fields(cls)]
    docs = field_docs(cls)
    assert [n for n in names if not docs.get(n)] == [], f"{cls.__name__} fields without a docstring"
    value = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, names[0], getattr(value, names[0]))


@pytest.mark.parametrize("cls", [c for c in CONFIGS if c is not RecomputeConfig], ids=lambda c: c.__name__)
def test_configs_take_keywords_only(cls):
    with pytest.raises(TypeError):
        cls(getattr(cls(), dataclasses.fields(cls)[0].name))


@pytest.mark.parametrize("make, error, message", [
    (lambda: ScheduleConfig(pipeline="gpipe"), HGraphError, r"schedule.pipeline='gpipe'; expected one of \['1f1b', 'zb1p'\]"),
    (lambda: ScheduleConfig(pipeline="zb1p", overlap=OverlapConfig()), HGraphError,
     r"schedule.pipeline='zb1p' with schedule.overlap .*use schedule.overlap=None, or schedule.pipeline='1f1b'"),
    (lambda: ScheduleConfig(coalesce=True, overlap=OverlapConfig()), HGraphError,
     r"schedule.coalesce=True with schedule.overlap .*use schedule.overlap=None with coalesce=True, or coalesce=False"),
    (lambda: ScheduleConfig(overlap="overlap"), HGraphError, r"schedule.overlap='overlap'; expected None or an OverlapConfig"),
    (lambda: OverlapConfig(prefetch_layers=-1), InputError, r"prefetch_layers=-1; expected an integer >= 0"),
    (lambda: BuildConfig(rank=-1), StrategyError, r"build.rank=-1: expected 'auto', None or a rank >= 0"),
    (lambda: RecomputeConfig("partial"), HGraphError, r"recompute='partial'; expected one of none, selective, full"),
    (lambda: CompileOptions(recompute="full"), HGraphError, r"recompute='full'; expected a RecomputeConfig or a mapping"),
    (lambda: CompileOptions(recompute={"tp2;pp2": "full"}), StrategyError, r"tp2;pp2"),
    (lambda: CompileOptions(packing="always"), HGraphError, r"packing='always'; expected one of 'auto', 'require', 'off'"),
    (lambda: CompileOptions(disable="annotate"), HGraphError, r"disable='annotate'; expected a collection .*\('annotate',\)"),
    (lambda: CompileOptions(schedule="overlap"), HGraphError, r"schedule='overlap'; expected a ScheduleConfig"),
    (lambda: AdamWConfig(lr=-1.0), TrainingError, r"invalid AdamW settings lr=-1.0.*need lr, eps, weight_decay >= 0"),
    (lambda: AdamWConfig(betas=(0.9, 1.0)), TrainingError, r"betas=\(0.9, 1.0\).*0 <= beta < 1 \(optimizer=AdamWConfig"),
    (lambda: AdamWConfig(grad_clip=-1.0), TrainingError, r"optimizer.grad_clip=-1.0; expected None"),
    (lambda: RunConfig(micro_batch_tokens=0), InputError, r"run.micro_batch_tokens=0; expected an integer >= 1"),
    (lambda: RunConfig(metrics="runs/m"), InputError, r"run.metrics='runs/m'; expected None or a MetricsConfig"),
])
def test_cross_checks_raise_where_the_value_is_made(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("strategy, options, error, message", [
    ("tp1,pp2,vpp2", CompileOptions(schedule=ScheduleConfig(overlap=OverlapConfig())), HGraphError,
     r"interleaved pipelines \(vpp > 1\) with schedule.overlap .*use schedule.overlap=None or vpp=1"),
    ("tp1,pp2,vpp2", CompileOptions(schedule=ScheduleConfig(pipeline="zb1p")), StrategyError,
     r"schedule.pipeline='zb1p' with an interleaved pipeline .*use schedule.pipeline='1f1b' or vpp=1"),
    ("2x tp1", CompileOptions(build=BuildConfig(rank=2)), StrategyError,
     r"build.rank=2: expected 'auto', None or a rank in 0..1"),
])
def test_checks_that_need_the_strategies_run_in_compile(strategy, options, error, message):
    strategies = [hgraph.Strategy.parse(strategy)]
    with pytest.raises(error, match=message):
        options.check(strategies)
    with pytest.raises(error, match=message):  # compile runs them before tracing
        hgraph.compile(Llama(LlamaConfig(layers=4, kv_heads=4), seed=0), strategies, torch.randint(0, 256, (1, 8)),
                       options=options)


def test_recompute_per_pipeline_shape():
    options = CompileOptions(recompute={"tp2,pp2": "full", hgraph.Pipeline(tp=1): RecomputeConfig("selective", every=2)})
    assert options.recompute_for(Degrees.parse("tp2,pp2")) == RecomputeConfig("full")
    assert options.recompute_for(Degrees.parse("tp2,pp2,vpp2")) == RecomputeConfig("full")  # one config for every vpp
    assert options.recompute_for(Degrees.parse("tp1")) == RecomputeConfig("selective", every=2)
    assert options.recompute_for(Degrees.parse("tp1,cp2")) == RecomputeConfig()  # shapes not listed: none
    assert CompileOptions(recompute=RecomputeConfig("full")).recompute_for(Degrees.parse("tp1,cp2")) == RecomputeConfig("full")


def test_values_survive_pickling_to_spawned_ranks():
    import pickle

    options = CompileOptions(recompute={"tp2": "full"}, schedule=ScheduleConfig(overlap=OverlapConfig()))
    assert pickle.loads(pickle.dumps(options)) == options
    run = RunConfig(micro_batch_tokens=64)
    assert pickle.loads(pickle.dumps((AdamWConfig(lr=0.5), run))) == (AdamWConfig(lr=0.5), run)


def test_values_are_normalised_and_printed_by_what_changed():
    options = CompileOptions(layer_costs=[1.0, 2.0], disable=["precision"], schedule=ScheduleConfig(coalesce=True))
    assert options.layer_costs == (1.0, 2.0) and options.disable == frozenset({"precision"})
    assert str(options) == ("CompileOptions(layer_costs=(1.0, 2.0), schedule=ScheduleConfig(pipeline='1f1b', "
                            "overlap=None, coalesce=True), disable=frozenset({'precision'}))")
    assert str(CompileOptions()) == "CompileOptions()"


def test_compile_and_trainer_take_at_most_six_parameters():
    from hgraph.training.trainer import Trainer

    compile_params = inspect.signature(hgraph.compile).parameters
    assert list(compile_params) == ["model", "strategies", "example_inputs", "loss_fn", "options"]
    trainer_params = inspect.signature(Trainer.__init__).parameters
    assert list(trainer_params) == ["self", "compiled", "optimizer", "planner", "run", "comm"]
    assert len(compile_params) <= 6 and len(trainer_params) - 1 <= 6
    for old in ("schedule", "rank", "compute_dtype", "pipeline_schedule"):  # gone, not silently ignored
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            inspect.signature(hgraph.compile).bind("model", ["tp1"], None, **{old: None})
    for old in ("lr", "grad_clip", "micro_batch_tokens", "timeline"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            inspect.signature(Trainer).bind("compiled", **{old: None})


def test_compile_refuses_a_non_options_value():
    with pytest.raises(InputError, match=r"compile\(options=\{'rank': None\}\); expected a CompileOptions"):
        hgraph.compile(Llama(LlamaConfig(layers=2, kv_heads=4)), ["tp1"], torch.randint(0, 256, (1, 8)),
                       options={"rank": None})


def test_the_top_level_is_at_most_sixteen_documented_names():
    assert len(hgraph.__all__) <= 16
    doc = hgraph.__doc__
    assert [n for n in hgraph.__all__ if not re.search(rf"``{n}``", doc)] == [], "names the docstring omits"
    assert all(getattr(hgraph, n) is not None for n in hgraph.__all__)
    assert hgraph.compile.__module__ == "hgraph.compiler.entry" and hgraph.CompileOptions is CompileOptions


def test_everything_else_is_reached_through_its_subpackage():
    from hgraph.compiler.compiled_model import CompiledModel

    assert hgraph.errors.StrategyError is StrategyError and issubclass(hgraph.errors.PackingError, hgraph.HGraphError)
    assert hgraph.planner.Planner.__name__ == "Planner" and hgraph.frontend.trace.__name__ == "trace"
    assert CompiledModel.__name__ == "CompiledModel"
    for gone in ("CompiledModel", "Planner", "StrategyError", "MetricsConfig", "export_pretrained", "Pass", "trace"):
        with pytest.raises(AttributeError, match=f"no attribute '{gone}'"):
            getattr(hgraph, gone)
