"""Each communication op's forward and backward equal a single-process reference (fp64)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from hgraph.errors import ShardingRuleError
from hgraph.runtime.kernels.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    grad_all_reduce,
    reduce_scatter,
    split,
)
from hgraph.core.batch import load_balance_indices
from hgraph.runtime.kernels.packed_attention import packed_attention
from hgraph.runtime.kernels.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.kernels.context import RankContext

DT = torch.float64


def on_ranks(world: int, fn: Callable[[int, RankContext], object], mesh_dim: str = "tp") -> list:
    """Run ``fn(rank, rank_context)`` on ``world`` simulated ranks forming one ``mesh_dim`` group."""

    def body(comm):
        return fn(comm.rank, RankContext(comm.rank, comm, {mesh_dim: tuple(range(world))}))

    return run_threads(body, world, timeout=30)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_sums_and_passes_gradient_through(world):
    parts = [rand(3, 4, seed=r) for r in range(world)]
    upstream = rand(3, 4, seed=99)

    def body(rank, rc):
        x = leaf(parts[rank])
        out = all_reduce(x, "tp", rank_context=rc)
        (out * upstream).sum().backward()
        return out, x.grad

    for out, grad in on_ranks(world, body):
        torch.testing.assert_close(out, sum(parts))
        torch.testing.assert_close(grad, upstream)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_and_its_all_gather_adjoint(world, dim):
    parts = [rand(4, 8, seed=r) for r in range(world)]
    upstream = rand(4, 8, seed=99)

    def body(rank, rc):
        x = leaf(parts[rank])
        out = reduce_scatter(x, "tp", dim, rank_context=rc)
        (out * upstream.chunk(world, dim)[rank]).sum().backward()
        return out, x.grad

    for rank, (out, grad) in enumerate(on_ranks(world, body)):
        torch.testing.assert_close(out, sum(parts).chunk(world, dim)[rank])
        torch.testing.assert_close(grad, upstream)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("grad_partial", [False, True])
def test_all_gather_forward_and_both_backward_modes(world, grad_partial):
    full = rand(8, 3, 2, seed=1)
    upstreams = [rand(8, 3, 2, seed=10 + r) for r in range(world)]

    def body(rank, rc):
        x = leaf(full.chunk(world, 0)[rank])
        out = all_gather(x, "tp", 0, grad_partial=grad_partial, rank_context=rc)
        # partial grads differ per rank; replicated grads are the same on every rank
        g = upstreams[rank] if grad_partial else upstreams[0]
        (out * g).sum().backward()
        return out, x.grad

    total = sum(upstreams) if grad_partial else upstreams[0]
    for rank, (out, grad) in enumerate(on_ranks(world, body)):
        torch.testing.assert_close(out, full)
        torch.testing.assert_close(grad, total.chunk(world, 0)[rank])


@pytest.mark.parametrize("world", [2, 4])
def test_split_keeps_own_chunk_and_gathers_gradient(world):
    full, upstream = rand(2, 8, seed=1), rand(2, 8, seed=2)

    def body(rank, rc):
        x = leaf(full)
        out = split(x, "tp", -1, rank_context=rc)
        (out * upstream.chunk(world, -1)[rank]).sum().backward()
        return out, x.grad

    for rank, (out, grad) in enumerate(on_ranks(world, body)):
        torch.testing.assert_close(out, full.chunk(world, -1)[rank])
        torch.testing.assert_close(grad, upstream)


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_reshards_and_its_adjoint_reshards_back(world):
    full, upstream = rand(8, 4, 12, seed=1), rand(8, 4, 12, seed=2)

    def body(rank, rc):
        x = leaf(full.chunk(world, 0)[rank])  # S(0)
        out = all_to_all(x, "tp", split_dim=2, cat_dim=0, rank_context=rc)  # -> S(2)
        (out * upstream.chunk(world, 2)[rank]).sum().backward()
        return out, x.grad

    for rank, (out, grad) in enumerate(on_ranks(world, body)):
        torch.testing.assert_close(out, full.chunk(world, 2)[rank])
        torch.testing.assert_close(grad, upstream.chunk(world, 0)[rank])


@pytest.mark.parametrize("world", [2, 4])
def test_grad_all_reduce_is_identity_forward_and_sums_gradients(world):
    full = rand(3, 5, seed=1)
    upstreams = [rand(3, 5, seed=10 + r) for r in range(world)]

    def body(rank, rc):
        x = leaf(full)
        out = grad_all_reduce(x, "tp", rank_context=rc)
        (out * upstreams[rank]).sum().backward()
        return out, x.grad

    for out, grad in on_ranks(world, body):
        torch.testing.assert_close(out, full)
        torch.testing.assert_close(grad, sum(upstreams))


def test_uneven_split_raises_sharding_rule_error():
    def body(rank, rc):
        reduce_scatter(torch.ones(3, 5, dtype=DT), "tp", 1, rank_context=rc)

    with pytest.raises(ShardingRuleError, match="size 5"):
        on_ranks(2, body)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_matches_embedding(world):
    weight = rand(16, 6, seed=1)
    ids = torch.tensor([[0, 3, 15, 8, 4], [9, 9, 1, 12, 7]])
    upstream = rand(2, 5, 6, seed=2)
    ref_weight = leaf(weight)
    ref = F.embedding(ids, ref_weight)
    (ref * upstream).sum().backward()

    def body(rank, rc):
        shard = leaf(weight.chunk(world, 0)[rank])
        out = all_reduce(vocab_parallel_embedding(ids, shard, "tp", rank_context=rc), "tp", rank_context=rc)
        (out * upstream).sum().backward()
        return out, shard.grad

    for rank, (out, grad) in enumerate(on_ranks(world, body)):
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(grad, ref_weight.grad.chunk(world, 0)[rank])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_vocab_parallel_cross_entropy_matches_cross_entropy(world, offset):
    logits = rand(2, 5, 16, seed=1) * 3 + offset  # a large offset checks numerical stability
    targets = torch.tensor([[1, 15, 7, -100, 8], [0, 4, 4, 12, -100]])
    ref_logits = leaf(logits)
    ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100)
    ref.backward()

    def body(rank, rc):
        shard = leaf(logits.chunk(world, -1)[rank])
        loss = vocab_parallel_cross_entropy(shard, targets, "tp", rank_context=rc)
        loss.backward()
        return loss, shard.grad

    for rank, (loss, grad) in enumerate(on_ranks(world, body)):
        assert torch.isfinite(loss)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(grad, ref_logits.grad.chunk(world, -1)[rank])


# ----------------------------------------------------------------------------- packed attention
def packed_positions(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def per_sequence_reference(q, k, v, lengths_per_row, gqa):
    """Attention of every sequence on its own, concatenated back into the packed layout."""
    rows = []
    for b, lengths in enumerate(lengths_per_row):
        outs, start = [], 0
        for n in lengths:
            sl = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(
                q[b : b + 1, :, sl], k[b : b + 1, :, sl], v[b : b + 1, :, sl], is_causal=True, enable_gqa=gqa
            ))
            start += n
        rows.append(torch.cat(outs, dim=2))
    return torch.cat(rows, dim=0)


def qkv(batch, seq, hq=4, hkv=2, d=8, seed=0):
    q = rand(batch, hq, seq, d, seed=seed)
    return q, rand(batch, hkv, seq, d, seed=seed + 1), rand(batch, hkv, seq, d, seed=seed + 2)


@pytest.mark.parametrize(
    "lengths", [[[16]], [[5, 1, 7, 3]], [[4, 12], [9, 2, 5]], [[3, 5, 8], [3, 5, 8]]], ids=str
)
def test_packed_attention_equals_per_sequence_attention(lengths):
    seq = sum(lengths[0])
    q, k, v = (leaf(t) for t in qkv(len(lengths), seq))
    upstream = rand(len(lengths), 4, seq, 8, seed=9)
    out = packed_attention(q, k, v, packed_positions(lengths), enable_gqa=True)
    (out * upstream).sum().backward()
    rq, rk, rv = (leaf(t) for t in (q, k, v))
    ref = per_sequence_reference(rq, rk, rv, lengths, gqa=True)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(out, ref)
    for got, want in ((q.grad, rq.grad), (k.grad, rk.grad), (v.grad, rv.grad)):
        torch.testing.assert_close(got, want)


def test_packed_attention_cost_is_per_sequence(monkeypatch):
    """No attention call covers more keys than the longest sequence: no (Σl)² mask."""
    key_lengths = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        key_lengths.append(k.shape[2])
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    lengths = [[5, 1, 7, 3]]
    q, k, v = qkv(1, 16)
    packed_attention(q, k, v, packed_positions(lengths), enable_gqa=True)
    assert sorted(key_lengths) == [1, 3, 5, 7]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", [[[16]], [[5, 1, 7, 3]], [[4, 12], [9, 2, 5]]], ids=str)
def test_context_parallel_packed_attention_matches_per_sequence(cp, lengths):
    seq = sum(lengths[0])
    q, k, v = qkv(len(lengths), seq, seed=3)
    positions = packed_positions(lengths)
    upstream = rand(len(lengths), 4, seq, 8, seed=9)
    rq, rk, rv = (leaf(t) for t in (q, k, v))
    ref = per_sequence_reference(rq, rk, rv, lengths, gqa=True)
    (ref * upstream).sum().backward()

    def body(rank, rc):
        idx = load_balance_indices(seq, cp, rank)
        lq, lk, lv = (leaf(t[:, :, idx]) for t in (q, k, v))
        out = packed_attention(lq, lk, lv, positions[:, idx], cp=True, enable_gqa=True, rank_context=rc)
        (out * upstream[:, :, idx]).sum().backward()
        return idx, out, lq.grad, lk.grad, lv.grad

    for idx, out, gq, gk, gv in on_ranks(cp, body, mesh_dim="cp"):
        torch.testing.assert_close(out, ref[:, :, idx])
        torch.testing.assert_close(gq, rq.grad[:, :, idx])
        torch.testing.assert_close(gk, rk.grad[:, :, idx])
        torch.testing.assert_close(gv, rv.grad[:, :, idx])


def test_load_balance_indices_pair_early_and_late_chunks():
    assert load_balance_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balance_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ShardingRuleError, match="divisible by 4"):
        load_balance_indices(6, 2, 0)


def test_packed_attention_propagates_fake_tensors_without_a_rank_context():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in qkv(1, 8))
        out = packed_attention(q, k, v, torch.zeros(1, 8, dtype=torch.long), cp=True, enable_gqa=True)
    assert out.shape == (1, 4, 8, 8) and out.dtype == DT


def every_op(rc: RankContext, world: int) -> dict[str, torch.Tensor]:
    """Forward and backward of every op on one rank (its group is the whole world, named tp and cp)."""
    results, rank = {}, rc.rank
    x = leaf(rand(4, 8, seed=rank))
    all_reduce(x, "tp", rank_context=rc).pow(2).sum().backward()
    results["all_reduce"] = x.grad
    x = leaf(rand(4, 8, seed=rank))
    y = reduce_scatter(x, "tp", 1, rank_context=rc)
    results["reduce_scatter"] = y
    (y * y).sum().backward()
    results["reduce_scatter.grad"] = x.grad
    for partial in (False, True):
        x = leaf(rand(2, 4, seed=rank))
        y = all_gather(x, "tp", 0, grad_partial=partial, rank_context=rc)
        (y * rand(2 * world, 4, seed=rank if partial else 0)).sum().backward()
        results[f"all_gather{partial}"], results[f"all_gather{partial}.grad"] = y, x.grad
    x = leaf(rand(8, 4, seed=0))
    y = all_to_all(split(x, "tp", 0, rank_context=rc), "tp", split_dim=1, cat_dim=0, rank_context=rc)
    (y * rand(*y.shape, seed=rank)).sum().backward()
    results["split_all_to_all"], results["split_all_to_all.grad"] = y, x.grad
    x = leaf(rand(3, 3, seed=0))
    (grad_all_reduce(x, "tp", rank_context=rc) * rank).sum().backward()
    results["grad_all_reduce.grad"] = x.grad
    logits = leaf(rand(6, 4, seed=rank))
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([0, 5, 7, -100, 2, 1]), "tp", rank_context=rc)
    loss.backward()
    results["cross_entropy"], results["cross_entropy.grad"] = loss, logits.grad
    q, k, v = (leaf(t[:, :, load_balance_indices(16, world, rank)]) for t in qkv(1, 16))
    positions = packed_positions([[5, 1, 7, 3]])[:, load_balance_indices(16, world, rank)]
    out = packed_attention(q, k, v, positions, cp=True, enable_gqa=True, rank_context=rc)
    out.pow(2).sum().backward()
    results.update(attention=out, q_grad=q.grad, k_grad=k.grad, v_grad=v.grad)
    return results


def _gloo_every_op(world: int) -> dict[str, torch.Tensor]:
    from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm

    comm = ProcessGroupComm()
    group = tuple(range(world))
    return every_op(RankContext(comm.rank, comm, {"tp": group, "cp": group}), world)


def test_ops_give_identical_results_on_gloo_processes_and_threads():
    from hgraph.runtime.launch import launch

    world = 2

    def threads(comm):
        group = tuple(range(world))
        return every_op(RankContext(comm.rank, comm, {"tp": group, "cp": group}), world)

    expected = run_threads(threads, world, timeout=30)
    got = launch(_gloo_every_op, world, args=(world,), timeout=120)
    for want, have in zip(expected, got):
        assert want.keys() == have.keys()
        for name in want:
            torch.testing.assert_close(have[name], want[name], msg=name)


@pytest.mark.parametrize("window, softcap", [(3, None), (None, 5.0), (4, 2.0)])
def test_packed_attention_window_and_softcap_equal_a_dense_mask(window, softcap):
    """Oracle: one dense masked attention over the whole packed row, written out by hand."""
    torch.manual_seed(0)
    lengths = [[7, 2, 5], [14]]
    q = torch.randn(2, 4, 14, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 14, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 14, 8, dtype=torch.float64, requires_grad=True)
    positions = packed_positions(lengths)
    out = packed_attention(q, k, v, positions, enable_gqa=True, window=window, softcap=softcap)
    index = torch.arange(14)
    starts = [torch.cat([torch.full((n,), sum(row[:i])) for i, n in enumerate(row)]) for row in lengths]
    same = torch.stack([s[:, None] == s[None, :] for s in starts])
    mask = same & (index[None, :] <= index[:, None])
    if window is not None:
        mask = mask & (index[:, None] - index[None, :] < window)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 8**0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    expected = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
