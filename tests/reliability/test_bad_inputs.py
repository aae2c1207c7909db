"""The bad-input catalogue: every public entry point rejects bad input with an ``HGraphError`` whose
message names the bad value and what would be valid, before any process group is touched."""

import json

import pytest
import torch

import hgraph
from hgraph.cli import command as cli
from hgraph.core.layout import Layout
from hgraph.core.placement import Shard
from hgraph.lnk import solve
from hgraph.models import Llama, LlamaConfig
from hgraph.planner import Planner, load_cost_model, propose, read_lengths
from hgraph.runtime.checkpoint import read_manifest
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig

EXAMPLE = torch.randint(0, 256, (1, 8))


def tiny(**kw):
    torch.manual_seed(0)
    cfg = dict(hidden=32, heads=4, kv_heads=2, ffn=64, layers=2)
    cfg.update(kw)
    return Llama(LlamaConfig(**cfg))


@pytest.fixture(scope="module")
def compiled2():
    return hgraph.compile(tiny(), ["2x tp1", "tp2"], example_inputs=EXAMPLE)


@pytest.fixture(scope="module")
def planner():
    cost = load_cost_model("llama7b_a800")
    return Planner(cost, propose(cost, 8, [100, 200, 4000, 30000]))


@pytest.fixture(scope="module")
def table():
    return json.loads(json.dumps(load_cost_model("llama7b_a800").to_table()))


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert code != 0
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- strategies and layouts
@pytest.mark.parametrize("model, strategy, match", [
    (tiny(heads=6, kv_heads=6, hidden=48), "tp4",
     r"tp=4 does not divide the attention heads \(6\); use a tp that divides 6"),
    (tiny(heads=6, kv_heads=3, hidden=48), "tp2", r"tp=2 does not divide the key/value heads \(3\)"),
    (tiny(vocab_size=255), "tp2", r"tp=2 does not divide the vocabulary \(255\); use a tp that divides 255"),
    (tiny(), "pp3", r"pp=3 exceeds the model's 2 layers; use pp <= 2"),
], ids=["heads", "kv-heads", "vocab", "layers"])
def test_degrees_that_do_not_fit_the_model(model, strategy, match):
    with pytest.raises(hgraph.errors.StrategyError, match=match):
        hgraph.compile(model, [strategy], example_inputs=EXAMPLE)


def test_strategies_with_different_world_sizes():
    with pytest.raises(hgraph.errors.StrategyError, match=r"strategy tp4 uses 4 ranks but the world has 2"):
        hgraph.compile(tiny(), ["tp2", "tp4"], example_inputs=EXAMPLE)


def test_strategy_larger_than_the_launched_world(compiled2):
    def body(comm):
        Trainer(compiled2, comm=comm)

    message = r"compiled for 2 ranks but this world has 4; launch with world_size=2"
    with pytest.raises(hgraph.errors.InputError, match=message):
        run_threads(body, 4)


def test_overlapping_ranks():
    message = r"rank 1 is used by pipeline 0 \(tp2\) and pipeline 1 \(tp2\); .*disjoint"
    with pytest.raises(hgraph.errors.StrategyError, match=message):
        hgraph.Strategy((hgraph.Pipeline(tp=2, ranks=(0, 1)), hgraph.Pipeline(tp=2, ranks=(1, 2))))


def test_missing_ranks():
    with pytest.raises(hgraph.errors.StrategyError, match=r"leaves ranks \[1\] unused; ranks must be exactly 0..1"):
        hgraph.Strategy((hgraph.Pipeline(tp=2, ranks=(0, 2)),))


def test_unparsable_strategy_and_bad_degree():
    with pytest.raises(hgraph.errors.StrategyError, match=r"cannot parse 'tp2;pp2' .* use e.g. 'tp2,pp2 \+ 2x tp1'"):
        hgraph.Strategy.parse("tp2;pp2")
    with pytest.raises(hgraph.errors.StrategyError, match=r"Pipeline tp=0; every degree must be an integer >= 1"):
        hgraph.Pipeline(tp=0)


def test_layout_mesh_does_not_match_ranks():
    message = r"mesh \(2,\) has 2 positions but 3 ranks \(0, 1, 2\).*must equal"
    with pytest.raises(hgraph.errors.LayoutError, match=message):
        Layout((8,), (0, 1, 2), (2,), (Shard(0),))
    with pytest.raises(hgraph.errors.LayoutError, match=r"shards dim 2 .* shape \(8,\) has 1 dims \(valid: 0..0\)"):
        Layout((8,), (0, 1), (2,), (Shard(2),))


def test_reshard_between_different_shapes():
    message = r"has shape \(8,\) but dst .* has shape \(6,\); they must match"
    with pytest.raises(hgraph.errors.LayoutError, match=message):
        solve(Layout((8,), (0, 1), (2,), (Shard(0),)), Layout((6,), (0, 1), (2,), (Shard(0),)))


# ----------------------------------------------------------------------------- models
class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.out = torch.nn.Linear(8, 16)

    def forward(self, ids):
        h = self.emb(ids)
        if h.sum() > 0:  # control flow on a tensor value
            h = h * 2
        return self.out(h)


class Flipped(DataDependent):
    def forward(self, ids):
        return self.out(torch.flip(self.emb(ids), dims=[-1]))


def test_untraceable_model():
    message = r"cannot trace DataDependent: data-dependent control flow.*`if h.sum\(\) > 0:"
    with pytest.raises(hgraph.errors.TraceError, match=message):
        hgraph.compile(DataDependent(), ["tp1"], example_inputs=torch.randint(0, 16, (1, 8)))


def test_op_without_a_sharding_rule():
    message = r"aten.flip.default .* no sharding rule .*hgraph.rules.register"
    with pytest.raises(hgraph.errors.ShardingRuleError, match=message):
        hgraph.compile(Flipped(), ["tp2"], example_inputs=torch.randint(0, 16, (1, 8)))


# ----------------------------------------------------------------------------- run-time inputs
@pytest.mark.parametrize("batch, match", [
    ([], r"empty batch; give at least one sequence"),
    ([torch.ones(5)], r"sequence 0 must be a 1-D LongTensor of token ids, got Tensor torch.float32 \(5,\)"),
    ([torch.ones(2, 5, dtype=torch.long)], r"sequence 0 must be a 1-D LongTensor .* \(2, 5\)"),
    ([torch.tensor([3])], r"sequence 0 has 1 token\(s\); need at least 2"),
    ([torch.tensor([3, 4]), torch.tensor([1, 256])], r"sequence 1 holds token id 256; ids must be in 0..255"),
], ids=["empty", "dtype", "shape", "too-short", "token-out-of-vocab"])
def test_trainer_rejects_bad_batches(compiled2, batch, match):
    def body(comm):
        Trainer(compiled2, comm=comm).step(batch)

    with pytest.raises(hgraph.errors.InputError, match=match):
        run_threads(body, 2)


@pytest.mark.parametrize("input_ids, match", [
    (torch.ones(1, 8), r"input_ids must be a \[batch, seq\] LongTensor .*, got torch.float32 \(1, 8\)"),
    (torch.ones(1, 2, 8, dtype=torch.long),
     r"input_ids must be a \[batch, seq\] LongTensor .*, got torch.int64 \(1, 2, 8\)"),
    (torch.ones(0, 8, dtype=torch.long), r"the batch has no target tokens"),
    ([torch.arange(5), torch.arange(1)], r"document 1 must be a 1-D LongTensor of at least 2 token ids"),
    ([torch.arange(5), torch.ones(2, 3, dtype=torch.long)], r"document 1 must be a 1-D LongTensor .* \(2, 3\)"),
    ([], r"empty list of documents"),
], ids=["dtype", "shape", "empty", "short-document", "2-d-document", "no-documents"])
def test_simulate_rejects_bad_inputs(compiled2, input_ids, match):
    with pytest.raises(hgraph.errors.InputError, match=match):
        compiled2.simulate(0, input_ids)


def test_non_finite_loss_stops_with_state_unchanged(compiled2):
    """A parameter gone NaN makes the loss NaN: TrainingError names the iteration; no shard moves."""
    batch = [torch.arange(2, 12), torch.arange(5, 9)]

    def body(comm):
        trainer = Trainer(compiled2, comm=comm)
        trainer.step(batch)
        norm = next(n for n in trainer.optimizer.names if "norm" in n)
        trainer.optimizer.shards[norm].fill_(float("nan"))
        before = trainer.optimizer.shard_state()
        message = r"non-finite loss nan at iteration 1; optimizer state left unchanged"
        with pytest.raises(hgraph.errors.TrainingError, match=message):
            trainer.step(batch)
        after = trainer.optimizer.shard_state()
        return trainer.iteration, before, after

    for iteration, before, after in run_threads(body, 2):
        assert iteration == 1
        for name, entry in before.items():
            for key, value in entry.items():  # bitwise, so NaN equals NaN here
                other = after[name][key]
                if value.dim():
                    value, other = value.view(torch.uint8), other.view(torch.uint8)
                assert torch.equal(value, other), (name, key)


def test_non_finite_gradient_stops_with_state_unchanged(compiled2, monkeypatch):
    """A backward that overflows on one rank (injected): TrainingError on every rank, nothing applied."""
    import hgraph.training.trainer as trainer_module

    real = trainer_module.run_iteration

    def overflowing(program, *args, **kwargs):
        out = real(program, *args, **kwargs)
        if program.rank == 1:
            name = next(n for n, g in out.grad_shards.items() if g is not None)
            out.grad_shards[name] = torch.full_like(out.grad_shards[name], float("inf"))
        return out

    monkeypatch.setattr(trainer_module, "run_iteration", overflowing)
    batch = [torch.arange(2, 12), torch.arange(5, 9)]

    def body(comm):
        trainer = Trainer(compiled2, comm=comm)
        before = trainer.optimizer.shard_state()
        message = r"non-finite gradient norm inf at iteration 0 \(loss [0-9.]+\)"
        with pytest.raises(hgraph.errors.TrainingError, match=message):
            trainer.step(batch)
        return trainer.iteration, before, trainer.optimizer.shard_state()

    for iteration, before, after in run_threads(body, 2):
        assert iteration == 0
        for name, entry in before.items():
            for key, value in entry.items():
                assert torch.equal(value, after[name][key]), (name, key)


def test_bad_optimizer_settings():
    message = r"invalid AdamW settings lr=-1.0.*need lr, eps, weight_decay >= 0"
    with pytest.raises(hgraph.errors.TrainingError, match=message):  # where the value is made, on no rank yet
        AdamWConfig(lr=-1.0)


# ----------------------------------------------------------------------------- planner
def test_sequence_longer_than_every_max_len(planner):
    message = r"a sequence of 10000000 tokens exceeds the largest MaxLen \d+ .*split_long=True"
    with pytest.raises(hgraph.errors.PlanError, match=message):
        planner.plan([100, 10_000_000])


@pytest.mark.parametrize("lengths, match", [
    ([], r"cannot plan an empty batch"),
    ([100, 0], r"sequence 1 has length 0; lengths must be positive integers"),
    ([100, 2.5], r"sequence 1 has length 2.5; lengths must be positive integers"),
], ids=["empty", "zero", "float"])
def test_planner_rejects_bad_lengths(planner, lengths, match):
    with pytest.raises(hgraph.errors.PlanError, match=match):
        planner.plan(lengths)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.clear(), r"field strategies is missing"),
    (lambda t: t["strategies"][0].update(tp="two"),
     r"strategies\[0\].tp: expected an integer >= 1, got 'two'"),
    (lambda t: t["strategies"][0].update(tp=1.5), r"strategies\[0\].tp: expected an integer >= 1, got 1.5"),
    (lambda t: t["strategies"][0].update(a=-1.0),
     r"strategies\[0\].a: expected a finite number >= 0, got -1.0"),
    (lambda t: t.update(strategies=[]), r"no schemes|strateg"),
], ids=["empty", "non-integer", "float-degree", "negative", "no-schemes"])
def test_malformed_cost_table(tmp_path, table, edit, match):
    table = json.loads(json.dumps(table))
    edit(table)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    with pytest.raises(hgraph.errors.CostModelError, match=match):
        load_cost_model(path)


@pytest.mark.parametrize("text, match", [
    ("", r"the length file is empty; it needs one positive integer per line"),
    ("12\nabc\n", r":2: 'abc' is not an integer; a length file holds one positive integer per line"),
    ("12\n1.5\n", r":2: '1.5' is not an integer"),
    ("12\n-3\n", r":2: length -3 is not positive; lengths must be >= 1"),
], ids=["empty", "word", "float", "negative"])
def test_malformed_length_file(tmp_path, text, match):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(hgraph.errors.InputError, match=match):
        read_lengths(path)


# ----------------------------------------------------------------------------- CLI and files
def test_cli_missing_length_file(capsys, tmp_path):
    err = run_cli(capsys, "plan", "--gpus", "8", "--lengths", str(tmp_path / "nope.txt"))
    assert "nope.txt" in err and "not found" in err


def test_cli_bad_json_cost_table(capsys, tmp_path):
    bad = tmp_path / "table.json"
    bad.write_text("{not json")
    err = run_cli(capsys, "plan", "--gpus", "8", "--cost-table", str(bad))
    assert "table.json" in err and "not valid JSON" in err


def test_cli_missing_cost_table(capsys, tmp_path):
    err = run_cli(capsys, "plan", "--gpus", "8", "--cost-table", str(tmp_path / "missing.json"))
    assert "missing.json" in err and "llama7b_a800" in err  # names the presets that would be valid


def test_cli_length_file_that_is_not_text(capsys, tmp_path):
    bad = tmp_path / "lengths.txt"
    bad.write_bytes(b"\xff\xfe\x00\x01garbage")
    err = run_cli(capsys, "plan", "--gpus", "8", "--lengths", str(bad))
    assert "UTF-8" in err or "lengths.txt" in err


def test_checkpoint_that_does_not_exist(tmp_path):
    with pytest.raises(hgraph.errors.CheckpointError, match=r"manifest.json is missing"):
        read_manifest(tmp_path / "never-saved")


def test_launch_with_no_ranks():
    with pytest.raises(hgraph.errors.CommunicationError, match=r"world_size=0; launch needs at least 1 rank"):
        hgraph.launch(print, 0)
