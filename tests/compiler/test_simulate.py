"""The compiler's correctness proof: every strategy's programs, run on simulated ranks (Pull, 1F1B
stages, Push through the LNK plans), reproduce the unmodified model's loss and every gradient —
on rectangular rows, and on documents of different lengths packed as the Trainer packs them, against
the model run on each document alone."""

import dataclasses

import pytest
import torch

import hgraph
from hgraph.models import Llama, LlamaConfig, tiny_hf_gpt2, tiny_hf_llama
from hgraph.core.batch import next_token_targets

STRATEGIES = [
    "tp1",  # one rank: the trivial program
    "tp2",
    "tp4",
    "2x tp1",  # DP 2
    "tp1,pp2",
    "tp2,pp2",
    "2x cp2",
    "cp2,tp2",
    "tp2 + 2x tp1",
    "tp2,pp2 + tp4",
]

MODELS = {
    "llama": lambda: Llama(LlamaConfig(layers=4, kv_heads=4)),
    "hf_llama": lambda: tiny_hf_llama(num_key_value_heads=4, num_hidden_layers=4),
    "hf_gpt2": lambda: tiny_hf_gpt2(),
}


def reference(model, ids):
    model.zero_grad()
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100
    )
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_documents(model, documents):
    """Token-mean loss and gradients of the model run on each document alone."""
    model.zero_grad()
    tokens = sum(len(d) - 1 for d in documents)
    total = 0.0
    for doc in documents:
        out = model(doc[None])
        logits = out.logits if hasattr(out, "logits") else out
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], doc[1:], reduction="sum") / tokens
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


# Several documents per micro-batch on every strategy; under cp they cross the chunk boundaries.
DOCUMENT_LENGTHS = (5, 17, 9, 12, 3, 16, 2)


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    torch.manual_seed(0)
    model = MODELS[request.param]()
    ids = torch.randint(0, model.config.vocab_size, (4, 16))
    by_world: dict[int, list[str]] = {}
    for s in STRATEGIES:
        by_world.setdefault(hgraph.Strategy.parse(s).world_size, []).append(s)
    compiled = {w: hgraph.compile(model, ss, example_inputs=ids) for w, ss in by_world.items()}
    return request.param, model, ids, compiled, reference(model, ids)


# Rectangular rows (each its own micro-batch) keep working; the packed documents below are what
# training runs, so they take every strategy.
RECTANGULAR = ["tp1", "tp2,pp2", "2x cp2", "tp2 + 2x tp1"]


@pytest.mark.parametrize("strategy", RECTANGULAR)
def test_simulated_strategy_matches_reference(case, strategy):
    name, model, ids, compiled, (ref_loss, ref_grads) = case
    s = hgraph.Strategy.parse(strategy)
    loss, grads = compiled[s.world_size].simulate(s, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for param, ref in ref_grads.items():
        torch.testing.assert_close(grads[param], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {strategy} {param}: {m}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_simulated_documents_match_each_document_alone(case, strategy):
    """The packed oracle: the Trainer's dispatch and packing, several documents per micro-batch."""
    name, model, ids, compiled, _ = case
    g = torch.Generator().manual_seed(2)
    documents = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in DOCUMENT_LENGTHS]
    ref_loss, ref_grads = reference_documents(model, documents)
    s = hgraph.Strategy.parse(strategy)
    loss, grads = compiled[s.world_size].simulate(s, documents)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for param, ref in ref_grads.items():
        torch.testing.assert_close(grads[param], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {strategy} {param}: {m}")


def test_documents_share_micro_batches_as_in_training(case, monkeypatch):
    """The oracle packs as training does: several documents in one micro-batch, positions restarting."""
    from hgraph.runtime import executor

    name, model, ids, compiled, _ = case
    seen = []
    original = executor.run_iteration

    def recording(program, shards, micro_batches, *args, **kwargs):
        seen.extend(mb["position_ids"][0].tolist() for mb in micro_batches)
        return original(program, shards, micro_batches, *args, **kwargs)

    monkeypatch.setattr("hgraph.runtime.thread_oracle.run_iteration", recording)
    documents = [torch.randint(0, 200, (n,)) for n in DOCUMENT_LENGTHS]
    compiled[4].simulate("tp2 + 2x tp1", documents)
    starts = [sum(1 for p in positions if p == 0) for positions in seen]
    assert max(starts) >= 3, seen


def test_a_reordered_push_is_caught(case, monkeypatch):
    """A push order that differs on one rank (mismatched collectives) raises instead of hanging."""
    name, model, ids, compiled, (ref_loss, ref_grads) = case
    cm = compiled[4]
    index = cm.strategy_index(hgraph.Strategy.parse("tp2 + 2x tp1"))
    program = cm.program(index, 3)
    saved = program.pushes
    # push order differs on one rank: mismatched collectives
    reordered = dataclasses.replace(program, pushes=saved[1:] + (saved[0],))
    original = cm.program
    monkeypatch.setattr(cm, "program", lambda s, r: reordered if (cm.strategy_index(s), r) == (index, 3) else original(s, r))
    with pytest.raises(hgraph.HGraphError):
        cm.simulate(index, ids)


def test_a_zeroed_push_is_caught(case, monkeypatch):
    """The numeric comparison can fail: one rank pushing zeros for one parameter (same collectives,
    nothing hangs) leaves the loss right and that parameter's gradient wrong, and is caught."""
    from hgraph.runtime import executor

    name, model, ids, compiled, (ref_loss, ref_grads) = case
    cm = compiled[4]
    index = cm.strategy_index(hgraph.Strategy.parse("tp2 + 2x tp1"))
    victim = cm.program(index, 3).pushes[0].name
    original = executor.Executor.push_start

    def zeroing(self, action):
        params = self.params
        if self.program.rank == 3 and params.get(victim) is not None and params[victim].grad is not None:
            params[victim].grad.zero_()
        return original(self, action)

    monkeypatch.setattr(executor.Executor, "push_start", zeroing)
    loss, grads = cm.simulate(index, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(grads[victim], ref_grads[victim], rtol=1e-5, atol=1e-6)
    for param, ref in ref_grads.items():
        if param != victim:
            torch.testing.assert_close(grads[param], ref, rtol=1e-5, atol=1e-6)
