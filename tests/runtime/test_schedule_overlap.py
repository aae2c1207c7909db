"""schedule="overlap": same results bit for bit as schedule="none" (simulated ranks, Trainer on
threads, real gloo processes), a golden pull/push order, and the dry run catching bad orders."""

import pytest
import torch

import hgraph
from hgraph.errors import HGraphError, InputError
from hgraph.models import Llama, LlamaConfig
from hgraph.program.options import OverlapConfig
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.schedule.actions import Action, Kind, ScheduleError, format_actions, parse
from hgraph.schedule.replay import dry_run
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig, RunConfig

WORLD4 = ["4x tp1", "2x tp2", "tp2,pp2", "tp2 + 2x tp1", "2x cp2", "2x tp1,pp2"]


def make_model(layers=4):
    torch.manual_seed(0)
    return Llama(LlamaConfig(layers=layers, kv_heads=4))


@pytest.fixture(scope="module")
def compiled_pair():
    model = make_model()
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))
    none = hgraph.compile(model, WORLD4, example_inputs=ids)
    config = OverlapConfig(prefetch_layers=1, bucket_bytes=4096)
    overlap = hgraph.compile(model, WORLD4, example_inputs=ids,
                             options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=config)))
    return ids, none, overlap


@pytest.mark.parametrize("strategy", WORLD4)
def test_simulate_overlap_is_bit_identical(compiled_pair, strategy):
    ids, none, overlap = compiled_pair
    loss_a, grads_a = none.simulate(strategy, ids)
    loss_b, grads_b = overlap.simulate(strategy, ids)
    assert torch.equal(loss_a, loss_b)
    assert set(grads_a) == set(grads_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def trainer_run(overlap, strategies, iterations, comm=None):
    """Runs on every rank (module level so spawned processes can import it)."""
    model = make_model(layers=2)
    example = torch.randint(0, 256, (1, 16))
    compiled = hgraph.compile(model, strategies, example_inputs=example,
                              options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=overlap)))
    trainer = Trainer(compiled, comm=comm, optimizer=AdamWConfig(lr=1e-3),
                      run=RunConfig(micro_batch_tokens=48))
    g = torch.Generator().manual_seed(1)
    losses, params = [], []
    for i in range(iterations):
        lengths = torch.randint(3, 40, (6,), generator=g)
        batch = [torch.randint(0, 256, (int(n),), generator=g) for n in lengths]
        losses.append(trainer.step(batch, strategy=i % len(strategies)))
    params = trainer.full_parameters()
    return losses, params


def assert_identical(a, b):
    assert a[0] == b[0]
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def test_trainer_threads_overlap_equals_none():
    n = len(WORLD4)
    base = run_threads(lambda comm: trainer_run(None, WORLD4, n, comm), 4)
    over = run_threads(lambda comm: trainer_run(OverlapConfig(), WORLD4, n, comm), 4)
    for a, b in zip(base, over):
        assert_identical(a, b)


@pytest.mark.slow
def test_real_gloo_overlap_equals_none():
    strategies = ["4x tp1", "tp2,pp2", "tp2 + 2x tp1"]
    base = hgraph.launch(trainer_run, 4, args=(None, strategies, 3), timeout=300)
    over = hgraph.launch(trainer_run, 4, args=(OverlapConfig(), strategies, 3), timeout=300)
    for a, b in zip(base, over):
        assert_identical(a, b)


def small_compiled(strategy="2x tp1", **config):
    model = Llama(LlamaConfig(layers=2, kv_heads=4))
    return hgraph.compile(model, [strategy], example_inputs=torch.randint(0, 256, (1, 8)),
                          options=hgraph.CompileOptions(schedule=hgraph.ScheduleConfig(overlap=OverlapConfig(**config))))


def test_golden_order_two_layers():
    compiled = small_compiled(prefetch_layers=1, bucket_bytes=1 << 30)
    program = compiled.program(0, 0)
    order = program.overlap
    names = [pc.name for pc in program.pulls]
    # layer 0 = embedding, 1-2 = the blocks, 3 = final norm, 4 = head; one layer of prefetch: the
    # next layer starts right after the first wait of this one, each wait sits at the first use.
    assert [str(a) for a in order.prelude] == ["PULL_START:embed.weight"]
    at_use: dict[str, list[str]] = {}  # parameter -> the pull ops attached before its first use
    for a in order.forward:
        assert a.at is not None  # every held pull is used by the forward: nothing after it
        at_use.setdefault(a.at, []).append(f"{'start' if a.kind is Kind.PULL_START else 'wait'}:{a.group}")
    block0 = [f"start:{n}" for n in names if n.startswith("layers.0.")]
    assert next(iter(at_use)) == "embed.weight" and at_use["embed.weight"] == block0 + ["wait:embed.weight"]
    assert at_use["layers.1.attn_norm.weight"] == ["start:norm.weight", "wait:layers.1.attn_norm.weight"]
    assert at_use["norm.weight"] == ["start:lm_head.weight", "wait:norm.weight"]
    assert [a.kind for a in order.end] == [Kind.PUSH_WAIT] * len(program.pushes)  # no pull left to wait
    pulls = [*order.prelude, *order.forward]
    started = [a.group for a in pulls if a.kind is Kind.PULL_START]
    waited = [a.group for a in pulls if a.kind is Kind.PULL_WAIT]
    assert started == names  # global order on every rank
    assert sorted(waited) == sorted(names)  # both ranks of 2x tp1 use every parameter
    pushes = [pc.name for pc in program.pushes]
    # one bucket when bucket_bytes is huge: every push start attached at the first push
    assert order.backward == tuple(Action(Kind.PUSH_START, group=n, at=pushes[0]) for n in pushes)
    assert compiled.program(0, 1).overlap.prelude == order.prelude


def test_inflight_cap_waits_early():
    capped = small_compiled(prefetch_layers=8, max_inflight_bytes=1).program(0, 0).overlap
    # with a 1-byte cap at most one pull is in flight: every start but the first follows a wait
    ops = [*capped.prelude, *(a for a in capped.forward if a.at is not None)]
    inflight = 0
    for a in ops:
        inflight += 1 if a.kind is Kind.PULL_START else -1
        assert 0 <= inflight <= 1


def _dry_run(compiled, programs, lists):
    """``hgraph.schedule.replay.dry_run`` of ``lists`` with the compiled programs' groups and stage ends."""
    members = {(p.rank, pc.name): pc.pull.plan.ranks for p in programs.values() for pc in p.pulls}
    dry_run(lists, members=lambda r, g: members[(r, g)], first=lambda r, c: programs[r].stage == 0,
            last=lambda r, c: programs[r].is_last_stage)


def test_overlap_lowering_places_pulls_and_pushes_around_the_pipeline():
    """The overlap order as actions: prelude pulls, waits attached to the first forward at each
    parameter's first use, push starts attached to the last backward, waits at the end."""
    compiled = small_compiled(prefetch_layers=1, bucket_bytes=1 << 30)
    program = compiled.program(0, 0)
    actions = program.actions(2)
    assert [parse(str(a)) for a in actions] == actions  # string round-trip, attached ones too
    kinds = [a.kind for a in actions]
    first_f, last_b = kinds.index(Kind.FORWARD), len(kinds) - 1 - kinds[::-1].index(Kind.BACKWARD)
    assert actions[0] == Action(Kind.PULL_START, group="embed.weight")
    assert all(a.at is None and a.kind is Kind.PULL_START for a in actions[:first_f])
    attached = actions[first_f + 1:first_f + 1 + sum(a.at is not None and a.kind in (Kind.PULL_START, Kind.PULL_WAIT)
                                                       for a in actions)]
    assert str(attached[-1]) == "PULL_WAIT:lm_head.weight@lm_head.weight"
    assert [a.at for a in attached if a.kind is Kind.PULL_WAIT] == [a.group for a in attached if a.kind is Kind.PULL_WAIT]
    pushes = [a for a in actions[last_b + 1:] if a.kind is Kind.PUSH_START]
    assert [a.group for a in pushes] == [pc.name for pc in program.pushes]
    assert {a.at for a in pushes} == {program.pushes[0].name}  # one bucket when bucket_bytes is huge
    assert [a.kind for a in actions[-len(pushes) - 1:]] == [Kind.PUSH_WAIT] * len(pushes) + [Kind.OPTIMIZER]
    assert "PULL_WAIT:embed.weight@embed.weight" in format_actions(actions)


def test_dry_run_catches_mismatched_collective_order():
    compiled = small_compiled("4x tp1")
    programs = {r: compiled.program(0, r) for r in range(4)}
    lists = {r: p.actions(2) for r, p in programs.items()}
    _dry_run(compiled, programs, lists)  # the real schedule is fine
    starts = [k for k, a in enumerate(lists[1]) if a.kind is Kind.PULL_START]
    a, b = starts[0], starts[1]
    lists[1][a], lists[1][b] = lists[1][b], lists[1][a]
    with pytest.raises(ScheduleError, match="mismatch"):
        _dry_run(compiled, programs, lists)
    assert issubclass(ScheduleError, HGraphError)


def test_dry_run_catches_a_wait_that_never_completes():
    compiled = small_compiled("4x tp1")
    programs = {r: compiled.program(0, r) for r in range(4)}
    lists = {r: p.actions(1) for r, p in programs.items()}
    lists[2] = lists[2][:next(k for k, a in enumerate(lists[2]) if a.kind is Kind.PULL_START)]  # never starts its pulls
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits at PULL_WAIT"):
        _dry_run(compiled, programs, lists)


def test_check_runs_at_compile_time_and_in_trainer():
    compiled = small_compiled("tp1,pp2")
    assert compiled.options.schedule.overlap is not None
    compiled.verify_overlap(0, [5])


def test_bad_config_is_rejected():
    with pytest.raises(InputError, match="prefetch_layers"):
        OverlapConfig(prefetch_layers=-1)
    with pytest.raises(HGraphError, match="schedule.overlap='fast'; expected None or an OverlapConfig"):
        hgraph.ScheduleConfig(overlap="fast")


def test_thread_comm_async_start_and_wait():
    """Starts return at once; ready() turns true only when every member started; different tags
    match apart, whatever the order in which they were started on each side."""

    def body(comm):
        other = 1 - comm.rank
        h = comm.start_all_reduce(torch.tensor([float(comm.rank + 1)]), (0, 1))
        first_ready = h.ready()
        comm.barrier((0, 1))
        assert h.ready()
        got = h.wait()
        a, b = torch.zeros(1), torch.zeros(1)
        if comm.rank == 0:
            s1 = comm.start_exchange([(other, torch.tensor([1.0]))], [], tag=1)
            s2 = comm.start_exchange([(other, torch.tensor([2.0]))], [], tag=2)
            s1.wait(), s2.wait()
        else:  # receives posted in the other order: tags keep the streams apart
            r2 = comm.start_exchange([], [(other, b)], tag=2)
            r1 = comm.start_exchange([], [(other, a)], tag=1)
            r1.wait(), r2.wait()
        return first_ready, float(got), float(a), float(b)

    results = run_threads(body, 2)
    assert results[0][1] == results[1][1] == 3.0
    assert (results[1][2], results[1][3]) == (1.0, 2.0)
    assert not (results[0][0] and results[1][0])  # the first starter cannot be ready yet
