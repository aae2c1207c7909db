"""Held-out evaluation is the forward lowering (``RankProgram.actions(m, mode="eval")``) run by the one
executor: its lists dry-run clean on every rank, and on real gloo ranks an interleaved pipeline (vpp 2)
evaluates to the unmodified model's held-out loss."""

import pytest
import torch
import torch.nn.functional as F

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.schedule.actions import Kind, wrapped_chunk
from hgraph.schedule.lowerings import forward_only
from hgraph.schedule.replay import dry_run, dry_run_pipeline

STRATEGIES = ["tp1,pp2,vpp2", "2x tp1"]
HELD_OUT = [[15, 7, 24, 10, 31], [9, 18, 5]]  # several micro-batches of <= 32 tokens, not whole rounds of pp
MICRO_BATCH_TOKENS = 32


def make_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=4, kv_heads=4))  # one layer per virtual stage under pp2,vpp2


def held_out():
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, 256, (n,), generator=g) for n in batch] for batch in HELD_OUT]


@pytest.mark.parametrize("pp,vpp", [(2, 1), (2, 2), (4, 2), (3, 3)])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_forward_lowering_has_only_forwards_and_dry_runs_clean(pp, vpp, m):
    programs = {s: forward_only(pp, vpp, s, m) for s in range(pp)}
    for actions in programs.values():
        assert {a.kind for a in actions} <= {Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT}
        assert sorted((a.chunk, a.mb) for a in actions if a.kind is Kind.FORWARD) == \
            [(c, mb) for c in range(vpp) for mb in range(m)]
    dry_run(programs, first=lambda s, c: c * pp + s == 0, last=lambda s, c: c * pp + s == pp * vpp - 1,
            route=lambda s, a: wrapped_chunk(pp, s, a))
    dry_run_pipeline("1f1b", pp, vpp, m)  # the training lowering of the same shape, for comparison


def test_eval_list_is_pulls_then_forwards_on_every_rank():
    compiled = hgraph.compile(make_model(), STRATEGIES, example_inputs=torch.randint(0, 256, (1, 16)))
    for index in range(len(STRATEGIES)):
        compiled.check_actions(index, [5] * len(compiled.strategies[index].pipelines), mode="eval")
    program = compiled.program(0, 1)
    actions = program.actions(3, mode="eval")
    kinds = [a.kind for a in actions]
    pulls = 2 * len(program.pulls)
    assert set(kinds[:pulls]) == {Kind.PULL_START, Kind.PULL_WAIT}
    assert set(kinds[pulls:]) == {Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT}
    assert {a.chunk for a in actions if a.kind is Kind.FORWARD} == {0, 1}
    with pytest.raises(hgraph.schedule.actions.ScheduleError, match="expected 'train' or 'eval'"):
        program.actions(3, mode="test")


def _evaluate():
    compiled = hgraph.compile(make_model(), STRATEGIES, example_inputs=torch.randint(0, 256, (1, 16)))
    trainer = hgraph.Trainer(compiled, run=hgraph.RunConfig(micro_batch_tokens=MICRO_BATCH_TOKENS))
    before = trainer.full_parameters()
    batches = held_out() if trainer.rank == 0 else None
    micro_batches = [len(mbs) for mbs in trainer.dispatch([len(s) for s in held_out()[0]], 0).micro_batches]
    losses = [trainer.evaluate(batches, strategy=s) for s in STRATEGIES]
    after = trainer.full_parameters()
    return losses, all(torch.equal(before[k], after[k]) for k in before), micro_batches


@pytest.mark.timeout(600)
def test_interleaved_evaluation_on_gloo_ranks_equals_the_unmodified_model():
    ranks = hgraph.launch(_evaluate, 2, timeout=500)
    model = make_model()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in held_out():
            for seq in batch:
                total += float(F.cross_entropy(model(seq[None])[0, :-1], seq[1:], reduction="sum"))
                tokens += len(seq) - 1
    want = total / tokens
    for losses, untouched, micro_batches in ranks:
        assert micro_batches[0] > 2  # the interleaved pipeline ran more than one round of pp micro-batches
        assert untouched
        for loss in losses:
            assert loss == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert ranks[0][0] == ranks[1][0]  # every rank returns the same all-reduced loss
