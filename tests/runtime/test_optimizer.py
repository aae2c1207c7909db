"""The sharded AdamW equals torch.optim.AdamW element for element, and clips by the global norm."""

import math

import torch

from hgraph.runtime.comm import run_threads
from hgraph.runtime.optimizer import ShardedAdamW


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
