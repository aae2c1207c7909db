"""Sharded checkpoints: bit-identical resume, atomic saves, verified loads, resharding loads."""

import hashlib
import json
import pickle
import re

import pytest
import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime import checkpoint
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig, RunConfig

WORLD4 = ["2x tp2", "tp2,pp2", "tp2 + 2x tp1"]
WORLD2 = ["tp2", "2x tp1"]
OPT = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)


def make_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(hidden=32, heads=4, kv_heads=2, ffn=64, layers=2))


def compile_for(strategies):
    return hgraph.compile(make_model(), strategies, example_inputs=torch.randint(0, 256, (1, 8)))


def batches(count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, (int(n),), generator=g) for n in torch.randint(3, 20, (6,), generator=g)]
            for _ in range(count)]


def make_trainer(compiled, comm):
    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)

    return Trainer(compiled, comm=comm, optimizer=AdamWConfig(lr_scheduler=schedule, **OPT),
                   run=RunConfig(micro_batch_tokens=32))


def train(trainer, data, start):
    losses = []
    for i, batch in enumerate(data):
        losses.append(trainer.step(batch, strategy=(start + i) % len(trainer.compiled.strategies)))
    return losses


@pytest.fixture(scope="module")
def compiled4():
    return compile_for(WORLD4)


def test_resume_is_bit_identical_on_simulated_ranks(compiled4, tmp_path):
    data = batches(4)

    def body(comm):
        straight = make_trainer(compiled4, comm)
        want = train(straight, data, 0)
        first = make_trainer(compiled4, comm)
        got = train(first, data[:2], 0)
        first.save(tmp_path / "ck", extra={"epoch": 3})
        resumed = make_trainer(compiled4, comm)
        extra = resumed.load(tmp_path / "ck")
        assert resumed.iteration == 2 and extra == {"epoch": 3}
        got += train(resumed, data[2:], 2)
        lr = (straight.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"])
        return want, got, straight.full_parameters(), resumed.full_parameters(), lr

    for want, got, p_straight, p_resumed, (lr_a, lr_b) in run_threads(body, 4):
        assert want == got  # bit-identical losses
        assert lr_a == lr_b
        for name, value in p_straight.items():
            assert torch.equal(value, p_resumed[name]), name


def _save_then(compiled, fn):
    def body(comm):
        trainer = make_trainer(compiled, comm)
        train(trainer, batches(1), 0)
        return fn(trainer)
    return run_threads(body, compiled.world_size)


def test_crash_during_save_leaves_no_loadable_checkpoint(compiled4, tmp_path, monkeypatch):
    good, bad = tmp_path / "good", tmp_path / "bad"
    _save_then(compiled4, lambda t: t.save(good))
    real_save = torch.save
    written = []

    def crash_on_second_file(obj, fh):
        real_save(obj, fh)
        written.append(fh)
        if len(written) == 2:
            raise OSError("disk full (injected)")

    monkeypatch.setattr(checkpoint.torch, "save", crash_on_second_file)
    for target in (bad, good):  # a new path, and overwriting the good one
        written.clear()
        with pytest.raises(OSError, match="injected"):
            _save_then(compiled4, lambda t, target=target: t.save(target))
    monkeypatch.undo()
    with pytest.raises(hgraph.errors.CheckpointError, match="manifest.json is missing"):
        _save_then(compiled4, lambda t: t.load(bad))
    with pytest.raises(hgraph.errors.CheckpointError, match="manifest.json is missing"):
        _save_then(compiled4, lambda t: t.load(bad.with_name(".bad.partial")))
    assert _save_then(compiled4, lambda t: t.load(good)) == [{}] * 4


def test_crash_before_manifest_keeps_previous_checkpoint(compiled4, tmp_path, monkeypatch):
    path = tmp_path / "ck"
    before = _save_then(compiled4, lambda t: (t.save(path), t.full_parameters())[1])[0]

    def crash(*args, **kwargs):
        raise OSError("power loss before the manifest (injected)")

    monkeypatch.setattr(checkpoint, "_write_manifest", crash)
    with pytest.raises(OSError, match="injected"):
        _save_then(compiled4, lambda t: t.save(path))
    monkeypatch.undo()

    def reload(trainer):
        trainer.load(path)
        return trainer.full_parameters()

    after = _save_then(compiled4, reload)[0]
    for name, value in before.items():
        assert torch.equal(value, after[name]), name


def test_corrupt_byte_and_bad_manifest_are_rejected(compiled4, tmp_path):
    path = tmp_path / "ck"
    _save_then(compiled4, lambda t: t.save(path))
    for victim in (path / checkpoint.rank_file(2), path / ".metadata"):
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(hgraph.errors.CheckpointError, match=rf"{re.escape(victim.name)} is corrupt: sha256"):
            _save_then(compiled4, lambda t: t.load(path))
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = "hgraph-checkpoint-v1"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(hgraph.errors.CheckpointError, match=r"hgraph-checkpoint-v1 checkpoint \(rankNNNNN.pt"):
        _save_then(compiled4, lambda t: t.load(path))
    manifest["format"] = checkpoint.FORMAT
    del manifest["files"][".metadata"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(hgraph.errors.CheckpointError, match=r"files lacks \.metadata"):
        _save_then(compiled4, lambda t: t.load(path))
    del manifest["files"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(hgraph.errors.CheckpointError, match=r"lacks the fields \['files'\]"):
        _save_then(compiled4, lambda t: t.load(path))
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(hgraph.errors.CheckpointError, match="not valid JSON"):
        _save_then(compiled4, lambda t: t.load(path))


class _Exploit:
    def __reduce__(self):
        return (print, ("unpickled untrusted code",))


def test_loading_never_unpickles_code(compiled4, tmp_path, capsys):
    """DCP's .metadata is a pickle: one that names any global but DCP's metadata types is refused
    before it is built, even with a matching digest in the manifest."""
    path = tmp_path / "ck"
    _save_then(compiled4, lambda t: t.save(path))
    victim = path / ".metadata"
    with open(victim, "wb") as fh:
        pickle.dump(_Exploit(), fh)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][".metadata"]["sha256"] = hashlib.sha256(victim.read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(hgraph.errors.CheckpointError, match=r"\.metadata cannot be read safely .*builtins.print"):
        _save_then(compiled4, lambda t: t.load(path))
    assert "unpickled untrusted code" not in capsys.readouterr().out


def test_mismatched_model_is_rejected(tmp_path):
    path = tmp_path / "ck"
    _save_then(compile_for(["2x tp1"]), lambda t: t.save(path))
    torch.manual_seed(0)
    other = hgraph.compile(Llama(LlamaConfig(hidden=32, heads=4, kv_heads=2, ffn=96, layers=2)), ["2x tp1"],
                           example_inputs=torch.randint(0, 256, (1, 8)))
    message = r"parameter '.*' has shape \(\d+, \d+\), the model's is"
    with pytest.raises(hgraph.errors.CheckpointError, match=message):
        _save_then(other, lambda t: t.load(path))


def test_load_into_another_world_size_reshards(compiled4, tmp_path):
    """Saved at world 4, loaded at world 2 (other strategies): the same full parameters and Adam moments,
    and training continues as it would have at world 4 (up to the summation order of TP)."""
    path = tmp_path / "ck"
    data = batches(3)

    def at4(comm):
        trainer = make_trainer(compiled4, comm)
        train(trainer, data[:2], 0)
        trainer.save(path)
        saved = checkpoint.full_state(trainer)
        loss = trainer.step(data[2], strategy=0)
        return saved, loss, trainer.full_parameters()

    saved, loss4, params4 = run_threads(at4, 4)[0]
    compiled2 = compile_for(WORLD2)

    def at2(comm):
        trainer = make_trainer(compiled2, comm)
        trainer.load(path)
        loaded = checkpoint.full_state(trainer)
        loss = trainer.step(data[2], strategy=0)
        return loaded, loss, trainer.full_parameters(), trainer.iteration

    for loaded, loss2, params2, iteration in run_threads(at2, 2):
        assert iteration == 3
        for key in checkpoint.STATE_KEYS:
            for name, value in saved[key].items():
                assert torch.equal(loaded[key][name], value), (key, name)
        assert loss2 == pytest.approx(loss4, rel=1e-6)
        for name, value in params4.items():
            torch.testing.assert_close(params2[name], value, rtol=1e-5, atol=1e-6)


def gloo_resume(path):
    """Runs on every gloo rank: 3 iterations straight vs 2 + save + load + 1 (and the RNG restored)."""
    compiled = compile_for(WORLD2)
    comm = None
    data = batches(3)
    straight = make_trainer(compiled, comm)
    want = train(straight, data, 0)
    first = make_trainer(compiled, comm)
    got = train(first, data[:2], 0)
    first.save(path)
    rng = torch.get_rng_state()
    torch.rand(5)  # moves the RNG on; load must put it back
    resumed = make_trainer(compiled, comm)
    resumed.load(path)
    same_rng = torch.equal(torch.get_rng_state(), rng)
    got += train(resumed, data[2:], 2)
    a, b = straight.full_parameters(), resumed.full_parameters()
    return want == got, all(torch.equal(a[n], b[n]) for n in a), same_rng


@pytest.mark.slow
def test_resume_is_bit_identical_on_gloo_processes(tmp_path):
    results = hgraph.launch(gloo_resume, 2, args=(str(tmp_path / "ck"),), timeout=120)
    assert results == [(True, True, True), (True, True, True)]
