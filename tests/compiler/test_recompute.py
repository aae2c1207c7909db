"""Activation recomputation: every mode gives the unmodified model's loss and gradients, recomputes
what it says it does, and never issues a layer's collectives twice."""

import collections
import threading

import pytest
import torch

import hgraph
from hgraph.errors import HGraphError
from hgraph.models import Llama, LlamaConfig, tiny_hf_llama
from hgraph.passes.recompute import RecomputeConfig, regions
from hgraph.runtime.kernels import thread_comm
from hgraph.runtime.kernels import packed_attention as packed_attention_module
from hgraph.core.batch import next_token_targets
from hgraph.program.options import OverlapConfig

MODES = ["none", "selective", "full"]
STRATEGIES = ["tp2", "tp1,pp2", "cp2", "2x tp1"]


def reference(model, ids):
    model.zero_grad()
    logits = model(ids)
    logits = logits.logits if hasattr(logits, "logits") else logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=4, kv_heads=2))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    return model, ids, reference(model, ids)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_one_device(llama, mode):
    model, ids, (ref_loss, ref_grads) = llama
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=ids,
                              options=hgraph.CompileOptions(recompute=hgraph.RecomputeConfig.of(mode)))
    for s in compiled.strategies:
        loss, grads = compiled.simulate(s, ids)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, want in ref_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{s} {name}: {m}")


def test_hf_llama_full_recompute_with_overlap_equals_one_device():
    torch.manual_seed(0)
    model = tiny_hf_llama(num_key_value_heads=2, num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    ref_loss, ref_grads = reference(model, ids)
    compiled = hgraph.compile(model, ["tp2", "tp1,pp2"], example_inputs=ids,
                              options=hgraph.CompileOptions(recompute=hgraph.RecomputeConfig("full"),
                                                            schedule=hgraph.ScheduleConfig(overlap=OverlapConfig())))
    for s in compiled.strategies:
        loss, grads = compiled.simulate(s, ids)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, want in ref_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6)


def test_per_layer_control_and_explain(llama):
    model, ids, _ = llama
    every = hgraph.compile(model, ["tp2"], example_inputs=ids,
                           options=hgraph.CompileOptions(recompute=RecomputeConfig("full", every=2)))
    assert [r.layer for r in regions(every.program(0, 0).stage_graph.gm)] == [0, 2]
    chosen = hgraph.compile(model, ["tp1,pp2"], example_inputs=ids,
                            options=hgraph.CompileOptions(recompute=RecomputeConfig("selective",
                                                                                    layers={1, 3})))
    assert [r.layer for r in regions(chosen.program(0, 0).stage_graph.gm)] == [1]
    assert [r.layer for r in regions(chosen.program(0, 1).stage_graph.gm)] == [3]
    text = chosen.explain(0, 1)
    assert "recompute: selective (layers [1, 3]): layer 3" in text
    plain = hgraph.compile(model, ["tp2"], example_inputs=ids)
    assert regions(plain.program(0, 0).stage_graph.gm) == []
    assert "recompute: none" in plain.explain(0, 0, backward=False)


@pytest.mark.parametrize("bad", ["partial", 3])
def test_bad_recompute_values_are_errors(bad):
    with pytest.raises(HGraphError, match="recompute="):
        hgraph.CompileOptions(recompute=bad)


def test_bad_recompute_configs_are_errors():
    with pytest.raises(HGraphError, match="not both"):
        RecomputeConfig("full", layers={0}, every=2)
    with pytest.raises(HGraphError, match="every=0"):
        RecomputeConfig("full", every=0)


class CountingComm:
    """Counts the collectives and point-to-point calls every simulated rank starts."""

    NAMES = ["start_all_reduce", "start_all_gather", "start_reduce_scatter", "start_all_to_all",
             "start_broadcast", "start_exchange"]

    def __init__(self, monkeypatch):
        self.counts = collections.Counter()
        lock = threading.Lock()
        for name in self.NAMES:
            original = getattr(thread_comm.ThreadComm, name)

            def counted(comm, *args, _original=original, _name=name, **kwargs):
                with lock:
                    self.counts[(comm.rank, _name)] += 1
                return _original(comm, *args, **kwargs)

            monkeypatch.setattr(thread_comm.ThreadComm, name, counted)

    def of(self, rank):
        return {name: n for (r, name), n in sorted(self.counts.items()) if r == rank}


def test_recomputed_layers_do_not_issue_communication_twice(llama, monkeypatch):
    model, ids, _ = llama
    counter = CountingComm(monkeypatch)
    attention_calls = collections.Counter()
    original = packed_attention_module._packed_attention_local

    def counted_attention(*args, **kwargs):
        attention_calls[threading.current_thread().name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(packed_attention_module, "_packed_attention_local", counted_attention)
    per_mode = {}
    for mode in MODES:
        compiled = hgraph.compile(model, ["tp2", "cp2"], example_inputs=ids,
                                  options=hgraph.CompileOptions(recompute=hgraph.RecomputeConfig.of(mode)))
        per_mode[mode] = []
        for s in compiled.strategies:
            counter.counts.clear()
            attention_calls.clear()
            compiled.simulate(s, ids)
            per_mode[mode].append((counter.of(0), attention_calls["hgraph-rank0"]))
    assert per_mode["none"][0][0]["start_all_reduce"] > 8  # tp2 has collectives inside every layer
    for mode in ("selective", "full"):
        for (counts, _), (base, _) in zip(per_mode[mode], per_mode["none"]):
            assert counts == base, mode
    # Attention kernels per rank: 4 layers x 2 micro-batches (one per row), forward + its backward's
    # recompute; full recomputes it once more, selective keeps its output.
    for i in range(2):
        assert [per_mode[m][i][1] for m in MODES] == [16, 16, 24]


def test_full_recompute_can_reissue_collectives_instead(llama, monkeypatch):
    model, ids, (ref_loss, ref_grads) = llama
    counter = CountingComm(monkeypatch)
    counts = {}
    for keep in (True, False):
        compiled = hgraph.compile(model, ["tp2"], example_inputs=ids,
                                  options=hgraph.CompileOptions(recompute=RecomputeConfig("full",
                                                                                          keep_communication=keep)))
        counter.counts.clear()
        loss, grads = compiled.simulate(0, ids)
        counts[keep] = counter.of(0)["start_all_reduce"]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, want in ref_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6)
    assert "collectives reissued" in compiled.explain(0, 0, backward=False)
    # Reissued per layer and micro-batch (4 x 2): the attention output's all-reduce. The MLP output's is
    # the layer's last op and nothing saved depends on it, so checkpoint's early stop never replays it.
    assert counts[False] - counts[True] == 4 * 2
