"""The sharded AdamW equals torch.optim.AdamW element for element, and clips by the global norm."""

import math

import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.optimizer import ShardedAdamW
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig


def test_matches_torch_adamw_exactly():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(10, 6, generator=g)
    grads = [torch.randn(10, 6, generator=g) for _ in range(3)]
    ref = full.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for gr in grads:
        ref.grad = gr.clone()
        opt.step()
    shards = [ShardedAdamW({"w": full[a:b]}, 1e-2, (0.8, 0.95), 1e-6, 0.1) for a, b in ((0, 4), (4, 8), (8, 10))]
    for gr in grads:
        for sh, (a, b) in zip(shards, ((0, 4), (4, 8), (8, 10))):
            sh.apply({"w": gr[a:b]})
    got = torch.cat([sh.shards["w"] for sh in shards])
    assert torch.equal(got, ref.detach())


def test_lr_scheduler_drives_it():
    opt = ShardedAdamW({"w": torch.ones(3)}, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_global_norm_over_ranks_counts_replicated_once():
    def body(comm):
        opt = ShardedAdamW({"a": torch.zeros(2), "s": torch.zeros(())}, replicated=frozenset({"s"}))
        grads = {"a": torch.full((2,), float(comm.rank + 1)), "s": torch.tensor(2.0)}
        return opt.global_grad_norm(grads, comm, (0, 1))

    norms = run_threads(body, 2)
    expected = math.sqrt(2 * 1 + 2 * 4 + 4)
    assert norms == [expected, expected]


def test_state_round_trip():
    opt = ShardedAdamW({"w": torch.ones(4)}, lr=0.1)
    opt.apply({"w": torch.ones(4)})
    state = opt.shard_state()
    other = ShardedAdamW({"w": torch.zeros(4)}, lr=0.1)
    other.load_shard_state(state)
    opt.apply({"w": torch.ones(4)})
    other.apply({"w": torch.ones(4)})
    assert torch.equal(opt.shards["w"], other.shards["w"])


def test_parameter_without_gradient_is_skipped_like_torch_adamw():
    """torch.optim.AdamW leaves a parameter whose .grad is None untouched (no decay, no step);
    so must the sharded one, also across later steps with a gradient (bias correction by own step)."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(6, generator=g)
    grads = [torch.randn(6, generator=g), None, torch.randn(6, generator=g)]
    ref = full.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    mine = ShardedAdamW({"w": full}, lr=1e-2, weight_decay=0.1)
    for gr in grads:
        ref.grad = None if gr is None else gr.clone()
        opt.step()
        mine.apply({"w": gr})
        assert torch.equal(mine.shards["w"], ref.detach())
    assert mine.shard_state()["w"]["step"] == opt.state[ref]["step"] == 2


def _frozen_and_unused_model():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=1))
    model.embed.weight.requires_grad_(False)  # a frozen embedding, as in adapter fine-tuning
    model.unused = torch.nn.Parameter(torch.randn(8))  # never reaches the loss
    return model


def _trainer_run(comm, compiled, batches):
    trainer = Trainer(compiled, comm=comm, optimizer=AdamWConfig(lr=2e-4, weight_decay=0.1, eps=1e-6))
    for batch in batches:
        trainer.step(batch)
    return trainer.full_parameters()


def test_trainer_leaves_frozen_and_unused_parameters_as_torch_adamw_does():
    g = torch.Generator().manual_seed(2)
    batches = [[torch.randint(0, 256, (n,), generator=g) for n in (9, 5, 12, 7)] for _ in range(3)]
    model = _frozen_and_unused_model()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.1, eps=1e-6)
    for batch in batches:
        tokens = sum(len(s) - 1 for s in batch)
        opt.zero_grad()
        for s in batch:
            logits = model(s[None])[0, :-1]
            (torch.nn.functional.cross_entropy(logits, s[1:], reduction="sum") / tokens).backward()
        opt.step()
    compiled = hgraph.compile(_frozen_and_unused_model(), ["2x tp1"], example_inputs=torch.randint(0, 256, (1, 8)))
    got = run_threads(lambda comm: _trainer_run(comm, compiled, batches), 2)[0]
    for name, want in model.named_parameters():
        torch.testing.assert_close(got[name], want.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_foreach_chunks_with_differing_steps_match_torch_adamw(monkeypatch):
    """Several parameters over several foreach chunks, one without a gradient at some steps (so step
    counts differ within a chunk), gradients scaled: still bitwise torch.optim.AdamW."""
    import hgraph.runtime.optimizer as optimizer_module

    monkeypatch.setattr(optimizer_module, "_FOREACH_CHUNK_ELEMENTS_CPU", 20)
    g = torch.Generator().manual_seed(3)
    shapes = {"a": (4, 3), "b": (7,), "c": (2, 5), "d": ()}
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    refs = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    opt = torch.optim.AdamW(list(refs.values()), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    mine = ShardedAdamW(full, 1e-2, (0.8, 0.95), 1e-6, 0.1)
    for it in range(4):
        grads = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        if it in (1, 2):
            grads["b"] = None
        for n, ref in refs.items():
            ref.grad = None if grads[n] is None else grads[n] * 0.5
        opt.step()
        mine.apply(grads, scale=0.5)
        for n, ref in refs.items():
            assert torch.equal(mine.shards[n], ref.detach()), (it, n)
    assert mine.shard_state()["b"]["step"] == 2 and mine.shard_state()["a"]["step"] == 4
