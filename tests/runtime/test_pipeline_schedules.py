"""The pipeline schedules beyond 1F1B equal one device: zero-bubble ZB-H1 (``pipeline_schedule="zb1p"``)
on simulated ranks (``compiled.simulate``) and on real gloo processes, against the unmodified model
and ``torch.optim.AdamW``."""

import pytest
import torch

from adamw_oracle import assert_matches_reference, single_process_adamw
import hgraph
from hgraph.actions import Kind
from hgraph.errors import HGraphError
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.trainer import Trainer
from hgraph.simulate import next_token_targets

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


@pytest.mark.parametrize("strategy", ["tp1,pp2", "tp2,pp2", "tp1,pp2 + tp2"])
def test_zero_bubble_simulate_matches_the_unmodified_model(strategy):
    model = make_model()
    ids = torch.randint(0, model.config.vocab_size, (6, 16), generator=torch.Generator().manual_seed(1))
    compiled = hgraph.compile(model, [strategy], example_inputs=ids[:1], pipeline_schedule="zb1p")
    program = compiled.program(0, 0)
    assert "0.0I" in compiled.explain(0, 0, backward=False)
    assert any(a.kind is Kind.BACKWARD_WEIGHT for a in program.actions(3))
    ref_loss, ref_grads = reference(model, ids)
    loss, grads = compiled.simulate(0, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def make_batches(iterations, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, (int(n),), generator=g) for n in torch.randint(3, 40, (6,), generator=g)]
            for _ in range(iterations)]


def train(strategies, schedule, iterations, comm=None):
    """Runs on every rank (module level so spawned processes can import it)."""
    compiled = hgraph.compile(make_model(), strategies, example_inputs=torch.randint(0, 256, (1, 16)),
                              pipeline_schedule=schedule)
    trainer = Trainer(compiled, comm=comm, micro_batch_tokens=32, **OPT)
    losses, params = [], []
    for batch in make_batches(iterations):
        losses.append(trainer.step(batch))
        params.append(trainer.full_parameters())
    return losses, params


def test_zero_bubble_on_real_gloo_ranks_equals_adamw():
    results = hgraph.launch(train, 2, args=(["tp1,pp2"], "zb1p", 2), timeout=300)
    ref = single_process_adamw(make_model(), make_batches(2), **OPT)
    for r in results:
        assert_matches_reference(r, (ref.losses, ref.params))


def test_unsupported_schedule_combinations_are_errors():
    ids = torch.randint(0, 256, (1, 16))
    with pytest.raises(HGraphError, match="pipeline_schedule='gpipe'; expected one of"):
        hgraph.compile(make_model(), ["tp1,pp2"], example_inputs=ids, pipeline_schedule="gpipe")
    with pytest.raises(HGraphError, match="with schedule='overlap' is not supported yet"):
        hgraph.compile(make_model(), ["tp1,pp2"], example_inputs=ids, pipeline_schedule="zb1p", schedule="overlap")
