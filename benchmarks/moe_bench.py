"""Expert parallelism against tp-sharded experts: an 8-expert Mixtral on 4 gloo ranks, ``tp4,ep4`` vs
``tp4``, side by side in one run. Prints JSON.

    python benchmarks/moe_bench.py [--steps 3] [--warmup 1] [--tiny]

The model is ``MixtralForCausalLM(MixtralConfig(...))`` (defaults but the sizes: 8 experts, top-2,
hidden 256, expert width 512, 2 layers, 8 heads, 4 key/value heads, vocabulary 1024), trained by
``hgraph.Trainer`` (fp32, AdamW) on a batch of variable-length sequences (seeded, 32..512 tokens).
Figures from a run and what they say: docs/expert_parallelism.md.

* Step time and bytes per step: one launch of 4 processes compiles both strategies and alternates
  their steps (A B A B ..., so drift in the machine's load falls on both); a step is timed from a
  barrier to a barrier (median over ``steps`` after ``warmup`` steps of each). Bytes are those every
  rank hands to its communicator in a step, by phase: Pull (all parameters; the expert weights also
  apart), activations (the all-to-alls, all-reduces and gathers inside the programs), Push.
* Peak memory per rank: one fresh launch per strategy (RSS never shrinks inside a process), each
  compiling only that strategy and running the same steps; ``peak_rss_mb`` is the rank's peak RSS
  (``ru_maxrss``), ``peak_over_start_mb`` that minus its RSS before the model was built (Python,
  torch and transformers imported). Every rank also holds the user's full model (the trace's source,
  the fp32 masters' origin), the same under both strategies.

``--tiny`` is the smoke configuration (2 layers, hidden 64, short sequences, one step).
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import statistics
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM

import hgraph
from hgraph.runtime import executor
from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm

OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
PHASES = ("pull", "pull_experts", "activation", "push", "push_experts")


@dataclass(frozen=True)
class BenchConfig:
    experts: int = 8
    top_k: int = 2
    hidden: int = 256
    expert_ffn: int = 512
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 1024
    sequences: int = 8
    min_len: int = 32
    max_len: int = 512
    warmup: int = 1
    steps: int = 3
    world: int = 4
    strategies: tuple[str, str] = ("tp4,ep4", "tp4")
    timeout: float = 1800.0

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        config = MixtralConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.expert_ffn,
                               num_hidden_layers=self.layers, num_attention_heads=self.heads,
                               num_key_value_heads=self.kv_heads, num_local_experts=self.experts,
                               num_experts_per_tok=self.top_k, max_position_embeddings=2048)
        return MixtralForCausalLM(config)

    def batch(self) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1234)
        lengths = torch.randint(self.min_len, self.max_len + 1, (self.sequences,), generator=g)
        return [torch.randint(0, self.vocab, (int(n),), generator=g) for n in lengths]


class StepBytes:
    """Bytes this rank hands to its communicator, by phase (``PHASES``), counted per step."""

    NAMES = ("start_all_reduce", "start_all_gather", "start_reduce_scatter", "start_all_to_all",
             "start_broadcast", "start_exchange")

    def __init__(self, comm: ProcessGroupComm) -> None:
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._phase = threading.local()
        for name in self.NAMES:
            original = getattr(comm, name)

            def counted(first: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                sent = [t for _, t in first] if _name == "start_exchange" else [first] if torch.is_tensor(first) else list(first)
                phase = getattr(self._phase, "name", "activation")
                self.bytes[phase] += sum(t.numel() * t.element_size() for t in sent)
                self.calls[f"{phase}:{_name.removeprefix('start_')}"] += 1
                return _original(first, *args, **kwargs)

            setattr(comm, name, counted)
        for name, label in (("pull_start", "pull"), ("push_start", "push")):
            original = getattr(executor.Executor, name)

            def in_phase(ex: Any, action: Any, _original: Any = original, _label: str = label) -> Any:
                self._phase.name = _label + ("_experts" if ".experts." in action.group else "")
                try:
                    return _original(ex, action)
                finally:
                    self._phase.name = "activation"

            setattr(executor.Executor, name, in_phase)

    def take(self) -> dict[str, Any]:
        out = {phase: self.bytes[phase] for phase in PHASES}
        out["total"] = sum(self.bytes.values())
        out["calls"] = dict(sorted(self.calls.items()))
        self.bytes.clear()
        self.calls.clear()
        return out


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _timed(trainer: Any, batch: list[torch.Tensor], index: int) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = trainer.step(batch, strategy=index)
    dist.barrier()
    return time.perf_counter() - start, loss


def time_and_bytes(cfg: BenchConfig) -> dict[str, Any]:
    """On every rank: both strategies compiled together, steps alternating."""
    model = cfg.model()
    batch = cfg.batch()
    start = time.perf_counter()
    compiled = hgraph.compile(model, list(cfg.strategies), example_inputs=torch.randint(0, cfg.vocab, (1, 16)))
    compile_s = time.perf_counter() - start
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(**OPTIMIZER),
                             run=hgraph.RunConfig(micro_batch_tokens=cfg.max_len * 2))
    counter = StepBytes(trainer.comm)
    seconds: dict[str, list[float]] = {s: [] for s in cfg.strategies}
    losses: dict[str, list[float]] = {s: [] for s in cfg.strategies}
    step_bytes: dict[str, dict] = {}
    for step in range(cfg.warmup + cfg.steps):
        for index, label in enumerate(cfg.strategies):
            counter.take()
            elapsed, loss = _timed(trainer, batch, index)
            measured = counter.take()
            if step >= cfg.warmup:
                seconds[label].append(elapsed)
                step_bytes[label] = measured  # the same every step (same batch, same dispatch)
            losses[label].append(loss)
    imbalance = [h.get("expert_imbalance") for h in trainer.history if h.get("expert_imbalance") is not None]
    return {
        "compile_s": compile_s,
        "step_s": {s: statistics.median(v) for s, v in seconds.items()},
        "bytes": step_bytes,
        "losses": losses,
        "expert_imbalance": max(imbalance) if imbalance else None,
    }


def peak_memory(cfg: BenchConfig, strategy: str) -> dict[str, float]:
    """On every rank of a fresh launch: one strategy alone, the same steps."""
    before = _current_rss_mb()
    model = cfg.model()
    batch = cfg.batch()
    compiled = hgraph.compile(model, [strategy], example_inputs=torch.randint(0, cfg.vocab, (1, 16)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(**OPTIMIZER),
                             run=hgraph.RunConfig(micro_batch_tokens=cfg.max_len * 2))
    for _ in range(cfg.warmup + cfg.steps):
        trainer.step(batch, strategy=0)
    peak = _rss_mb()
    return {"peak_rss_mb": round(peak, 1), "peak_over_start_mb": round(peak - before, 1)}


def run(cfg: BenchConfig) -> dict[str, Any]:
    started = time.perf_counter()
    ranks = hgraph.launch(time_and_bytes, cfg.world, args=(cfg,), timeout=cfg.timeout)
    memory = {s: hgraph.launch(peak_memory, cfg.world, args=(cfg, s), timeout=cfg.timeout) for s in cfg.strategies}
    ep, tp = cfg.strategies
    step_s = {s: statistics.median(r["step_s"][s] for r in ranks) for s in cfg.strategies}
    per_rank_bytes = {s: [r["bytes"][s] for r in ranks] for s in cfg.strategies}
    total = {s: sum(b["total"] for b in per_rank_bytes[s]) for s in cfg.strategies}
    first_losses = {s: ranks[0]["losses"][s][0] for s in cfg.strategies}
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks), "ranks disagree on the losses"
    out = {
        "config": asdict(cfg),
        "model": f"MixtralForCausalLM: {cfg.experts} experts, top-{cfg.top_k}, hidden {cfg.hidden}, "
                 f"expert width {cfg.expert_ffn}, {cfg.layers} layers",
        "batch_lengths": [len(s) for s in cfg.batch()],
        "step_s": {s: round(v, 4) for s, v in step_s.items()},
        "step_time_ratio_ep_over_tp": round(step_s[ep] / step_s[tp], 3),
        "bytes_per_step": {
            s: {"per_rank": per_rank_bytes[s], "all_ranks": total[s]} for s in cfg.strategies
        },
        "bytes_ratio_ep_over_tp": round(total[ep] / total[tp], 3),
        "peak_memory_per_rank": {s: memory[s] for s in cfg.strategies},
        "peak_over_start_ratio_ep_over_tp": round(
            max(m["peak_over_start_mb"] for m in memory[ep]) / max(m["peak_over_start_mb"] for m in memory[tp]), 3),
        "first_loss": first_losses[ep],  # the first step (ep); equality with one device: tests/compiler
        "expert_imbalance_observed": ranks[0]["expert_imbalance"],
        "compile_s": round(ranks[0]["compile_s"], 2),
        "seconds": round(time.perf_counter() - started, 1),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=BenchConfig.steps)
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup)
    parser.add_argument("--tiny", action="store_true", help="smoke configuration")
    args = parser.parse_args()
    cfg = replace(BenchConfig(), steps=args.steps, warmup=args.warmup)
    if args.tiny:
        cfg = replace(cfg, hidden=64, expert_ffn=128, layers=2, heads=4, kv_heads=4, vocab=256, sequences=4,
                      min_len=16, max_len=64, steps=1, warmup=0)
    print(json.dumps(run(cfg), indent=1))


if __name__ == "__main__":
    main()
