"""The pipeline schedules beyond 1F1B equal one device: zero-bubble ZB-H1 (``pipeline_schedule="zb1p"``)
and interleaved 1F1B (``"tp1,pp2,vpp2"``) on simulated ranks (``compiled.simulate``) and on real gloo processes, against the unmodified model
and ``torch.optim.AdamW``."""

import pytest
import torch

from adamw_oracle import assert_matches_reference, single_process_adamw
import hgraph
import hgraph.schedule.actions
from hgraph.schedule.actions import Kind
from hgraph.errors import HGraphError
from hgraph.models import Llama, LlamaConfig
from hgraph.training.trainer import Trainer
from hgraph.core.batch import next_token_targets
from hgraph.program.options import OverlapConfig
from hgraph.training.configs import AdamWConfig, RunConfig

OPT = dict(lr=2e-4, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)


def make_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=4, kv_heads=4))


def reference(model, ids):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), next_token_targets(ids).flatten(),
                                             ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["tp1,pp2", pytest.param("tp2,pp2", marks=pytest.mark.slow), "tp1,pp2 + tp2"])
def test_zero_bubble_simulate_matches_the_unmodified_model(strategy):
    model = make_model()
    ids = torch.randint(0, model.config.vocab_size, (6, 16), generator=torch.Generator().manual_seed(1))
    compiled = hgraph.compile(model, [strategy], example_inputs=ids[:1],
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(pipeline="zb1p")))
    program = compiled.program(0, 0)
    assert "0.0I" in compiled.explain(0, 0, backward=False)
    assert any(a.kind is Kind.BACKWARD_WEIGHT for a in program.actions(3))
    ref_loss, ref_grads = reference(model, ids)
    loss, grads = compiled.simulate(0, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("strategy", ["tp1,pp2,vpp2", pytest.param("tp2,pp2,vpp2", marks=pytest.mark.slow)])
def test_interleaved_simulate_matches_the_unmodified_model(strategy):
    model = make_model()  # 4 layers: one per virtual stage
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    compiled = hgraph.compile(model, [strategy], example_inputs=ids[:1])
    program = compiled.program(0, 0)
    assert [list(c.layers) for c in program.chunks] == [[0], [2]]  # non-adjacent chunks
    assert "interleaved schedule" in compiled.explain(0, 0, backward=False)
    ref_loss, ref_grads = reference(model, ids)
    loss, grads = compiled.simulate(0, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for rows in (3, 1):  # micro-batches that are not whole rounds of pp=2
        ref_loss, ref_grads = reference(model, ids[:rows])
        loss, grads = compiled.simulate(0, ids[:rows])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{rows} rows {name}: {m}")


def make_batches(iterations, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, (int(n),), generator=g) for n in torch.randint(3, 40, (6,), generator=g)]
            for _ in range(iterations)]


def train(strategies, schedule, iterations, comm=None):
    """Runs on every rank (module level so spawned processes can import it)."""
    compiled = hgraph.compile(make_model(), strategies, example_inputs=torch.randint(0, 256, (1, 16)),
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(pipeline=schedule)))
    trainer = Trainer(compiled, comm=comm, optimizer=AdamWConfig(**OPT),
                      run=RunConfig(micro_batch_tokens=32))
    losses, params = [], []
    for batch in make_batches(iterations):
        losses.append(trainer.step(batch))
        params.append(trainer.full_parameters())
    return losses, params


ODD_BATCHES = [(20, 25, 30), (30, 10, 10, 10, 10, 9), (5,)]  # 3, 4 (one micro-batch cut), 1 micro-batches


def interleaved_batches(iterations, seed=2):
    """Four sequences longer than half a micro-batch (four micro-batches, two rounds of pp=2), then the
    batches that are not whole rounds: three long sequences, one of 30 and five short, one of 5."""
    g = torch.Generator().manual_seed(seed)
    whole = [[torch.randint(0, 256, (int(n),), generator=g) for n in torch.randint(20, 32, (4,), generator=g)]
             for _ in range(iterations)]
    return whole + [[torch.randint(0, 256, (n,), generator=g) for n in lengths] for lengths in ODD_BATCHES]


def train_interleaved(iterations, comm=None):
    compiled = hgraph.compile(make_model(), ["tp1,pp2,vpp2"], example_inputs=torch.randint(0, 256, (1, 16)))
    trainer = Trainer(compiled, comm=comm, optimizer=AdamWConfig(**OPT),
                      run=RunConfig(micro_batch_tokens=32))
    losses, params = [], []
    for batch in interleaved_batches(iterations):
        losses.append(trainer.step(batch))
        params.append(trainer.full_parameters())
    return losses, params


def train_both(comm=None):
    """ZB-H1 then interleaved 1F1B in one set of processes (one spawn for both)."""
    return train(["tp1,pp2"], "zb1p", 2, comm), train_interleaved(2, comm)


def test_new_schedules_on_real_gloo_ranks_equal_adamw():
    results = hgraph.launch(train_both, 2, timeout=400)
    zero_bubble = single_process_adamw(make_model(), make_batches(2), **OPT)
    interleaved = single_process_adamw(make_model(), interleaved_batches(2), **OPT)
    for zb, il in results:
        assert_matches_reference(zb, (zero_bubble.losses, zero_bubble.params))
        assert_matches_reference(il, (interleaved.losses, interleaved.params))


def test_unsupported_schedule_combinations_are_errors():
    ids = torch.randint(0, 256, (1, 16))
    with pytest.raises(HGraphError, match="schedule.pipeline='gpipe'; expected one of"):
        hgraph.compile(make_model(), ["tp1,pp2"], example_inputs=ids,
                       options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(pipeline="gpipe")))
    with pytest.raises(HGraphError, match="with schedule.overlap is not supported yet"):
        hgraph.compile(make_model(), ["tp1,pp2"], example_inputs=ids,
                       options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig(),
                                                                                    pipeline="zb1p")))
    with pytest.raises(hgraph.errors.StrategyError, match="pp\\*vpp=6 virtual stages exceed the model's 4 layers; use vpp <= 2"):
        hgraph.compile(make_model(), ["tp1,pp2,vpp3"], example_inputs=ids)
    with pytest.raises(hgraph.errors.StrategyError, match="vpp=2 needs pp >= 2"):
        hgraph.Strategy.parse("tp2,vpp2")
    with pytest.raises(hgraph.errors.StrategyError, match="always runs interleaved"):
        hgraph.compile(make_model(), ["tp1,pp2,vpp2"], example_inputs=ids,
                       options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(pipeline="zb1p")))


def test_compile_dry_runs_every_ranks_action_list_and_catches_a_swap(monkeypatch):
    compiled = hgraph.compile(make_model(), ["tp1,pp2 + tp2"], example_inputs=torch.randint(0, 256, (1, 16)))
    compiled.check_actions(0, [4, 2])  # pipelines, pulls and pushes of all 4 ranks agree
    program = compiled.program(0, 3)
    original = type(program).actions

    def swapped(self, m, mode="train"):  # rank 3 pulls its first two parameters in the other order
        out = original(self, m, mode)
        if self.rank == 3:
            out[0:2], out[2:4] = out[2:4], out[0:2]
        return out

    monkeypatch.setattr(type(program), "actions", swapped)
    with pytest.raises(hgraph.schedule.actions.ScheduleError, match="collective order mismatch on ranks .* rank 3 starts"):
        compiled.check_actions(0, [4, 2])
