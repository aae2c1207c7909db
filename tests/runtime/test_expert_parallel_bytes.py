"""Expert parallelism's bytes, counted at the communicator (every simulated rank's calls, what it hands
over): per MoE layer the tokens' rows move by all-to-all (two forward, two backward) and nothing
reduces the experts' output; expert weights are pulled and pushed whole per expert. Expected figures
come from the model's shapes alone (Mixtral from the zoo: L=2 layers, E=4 experts, top-2, hidden 64,
expert width 128)."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

import hgraph
from hgraph.models.zoo import zoo_model
from hgraph.runtime import executor
from hgraph.runtime.kernels import thread_comm

STRATEGIES = ["tp4", "tp4,ep4", "tp4,ep2"]
NAMES = ("start_all_reduce", "start_all_gather", "start_reduce_scatter", "start_all_to_all", "start_broadcast",
         "start_exchange")


class CommCounter:
    """Calls and bytes every rank hands to the communicator: ``(rank, phase, primitive, dtype) -> [calls, bytes]``,
    phase ``pull``/``push`` of an expert weight (``pull_experts``), of another parameter, or ``activation``."""

    def __init__(self, monkeypatch):
        self.seen: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
        phase, lock = threading.local(), threading.Lock()
        for name in NAMES:
            original = getattr(thread_comm.ThreadComm, name)

            def counted(comm, first, *args, _original=original, _name=name, **kwargs):
                sent = [t for _, t in first] if _name == "start_exchange" else [first] if torch.is_tensor(first) else list(first)
                key = (comm.rank, getattr(phase, "name", "activation"), _name.removeprefix("start_"),
                       sent[0].dtype if sent else None)
                with lock:
                    self.seen[key][0] += 1
                    self.seen[key][1] += sum(t.numel() * t.element_size() for t in sent)
                return _original(comm, first, *args, **kwargs)

            monkeypatch.setattr(thread_comm.ThreadComm, name, counted)
        for name, label in (("pull_start", "pull"), ("push_start", "push")):
            original = getattr(executor.Executor, name)

            def in_phase(ex, action, _original=original, _label=label):
                phase.name = _label + ("_experts" if ".experts." in action.group else "")
                try:
                    return _original(ex, action)
                finally:
                    phase.name = "activation"

            monkeypatch.setattr(executor.Executor, name, in_phase)

    def calls(self, rank=None, phase=None, primitive=None, dtype=None) -> int:
        return sum(v[0] for k, v in self.seen.items() if _match(k, rank, phase, primitive, dtype))

    def bytes(self, rank=None, phase=None, primitive=None, dtype=None) -> int:
        return sum(v[1] for k, v in self.seen.items() if _match(k, rank, phase, primitive, dtype))


def _match(key, *want) -> bool:
    return all(w is None or k == w for k, w in zip(key, want))


@pytest.fixture(scope="module")
def mixtral():
    model = zoo_model("mixtral")
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    return model, ids, hgraph.compile(model, STRATEGIES, example_inputs=ids)


def test_moe_layers_move_tokens_by_all_to_all_and_reduce_no_expert_output(mixtral, monkeypatch):
    model, ids, compiled = mixtral
    cfg = model.config
    layers, k, hidden, tokens = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.hidden_size, ids.numel()
    counter = CommCounter(monkeypatch)
    per_strategy = {}
    for strategy in STRATEGIES:
        counter.seen.clear()
        compiled.simulate(strategy, ids)
        per_strategy[strategy] = {r: (counter.calls(r, "activation", "all_to_all", torch.float32),
                                      counter.calls(r, "activation", "all_reduce")) for r in range(4)}
        if strategy == "tp4,ep4":
            # every (token, expert) pair's row, once per all-to-all: dispatch and combine, and their adjoints
            assert counter.bytes(None, "activation", "all_to_all", torch.float32) == 4 * layers * tokens * k * hidden * 4
            # the split sizes, agreed once per layer and micro-batch: E/ep counts to each of the ep peers
            assert counter.calls(0, "activation", "all_to_all", torch.int64) == layers
            assert counter.bytes(0, "activation", "all_to_all", torch.int64) == layers * cfg.num_local_experts * 8
    for r in range(4):
        tp_a2a, tp_reduce = per_strategy["tp4"][r]
        ep_a2a, ep_reduce = per_strategy["tp4,ep4"][r]
        assert tp_a2a == 0 and ep_a2a == 4 * layers  # two all-to-alls forward, two backward, per MoE layer
        # tp-sharded experts reduce their row-parallel output forward and their input's gradient backward
        assert tp_reduce - ep_reduce == 2 * layers


def test_expert_weights_pull_and_push_whole_experts(mixtral, monkeypatch):
    """The optimizer layout holds whole experts (rank r: expert r); tp4,ep4 computes on exactly those,
    so its expert Pulls and Pushes move nothing; tp-sharded experts (a quarter of every expert's
    columns) send 3/16 of all expert bytes per rank each way, tp4,ep2 (two experts, half of each) 1/8."""
    model, ids, compiled = mixtral
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    counter = CommCounter(monkeypatch)
    want = {"tp4": expert_bytes * 3 // 16, "tp4,ep4": 0, "tp4,ep2": expert_bytes // 8}
    for strategy, per_rank in want.items():
        counter.seen.clear()
        compiled.simulate(strategy, ids)
        for r in range(4):
            assert counter.bytes(r, "pull_experts") == per_rank, (strategy, r)
            assert counter.bytes(r, "push_experts") == per_rank, (strategy, r)
