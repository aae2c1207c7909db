"""``hgraph demo``: the whole idea on this machine, in a few minutes.

A small Llama-style model trains on local gloo ranks on real code: the source files of this
interpreter's standard library (``hgraph.data.stdlib_corpus``, no download), tokenized by a
byte-level BPE of 512 tokens trained locally on first use and cached, one sequence per file, cut at
``--max-len`` tokens (``--long-documents split``: split into pieces instead), batched to
``--tokens-per-iteration`` in a seeded order. File lengths vary over two orders of magnitude (a
quarter of the files are under 600 tokens, a quarter over 7,800), so batches range from one long
file to a dozen short ones, and the best strategy changes from batch to batch. The loss is a
language-modelling loss; the held-out loss (files never trained on) is measured every
``--eval-interval`` iterations, forward only. Steps:

1. profile ``T(l) = a·l² + b·l + c`` for every scheme on this machine (``hgraph profile``, cached);
2. propose candidate strategies from the length distribution (``hgraph.planner.propose``), then
   measure their iteration terms (Pull/Push, exposure under overlap, fixed cost; cached);
3. compile the model once for every candidate (``hgraph.compile``) on every rank;
4. each iteration the planner picks the strategy, dispatches the sequences to its pipelines and packs
   them into micro-batches; ``hgraph.Trainer`` runs it (Pull, 1F1B, Push, sharded AdamW), records the
   predicted and measured time, and the planner's ``OnlineCorrection`` refits the cost model.

By default a per-rank memory budget binds (``--memory-binds 2048``, ``0``: off): a file of 2,048
tokens (every file cut at the context) does not fit a ``tp1`` pipeline, so it needs ranks with tensor
or pipeline parallelism, which the many short files do not; the planner runs each batch on what it
needs.

``--compare`` (on by default; ``--no-compare`` skips it) then trains the planner and the best
homogeneous strategies that take every file (``hgraph.cli.demo_compare``) on the same batches,
interleaved in rotating blocks and repeated, and prints the ratio's median and range.
The run folder gets the Perfetto trace, PNG plots, the plans as JSON and a summary.

This module holds the demo's inputs (model sizes, corpus, cost tables); ``hgraph.cli.demo_run`` the
command line, the ranks' training and the run folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hgraph.core.degrees import Degrees
from hgraph.core.strategy import fits
from hgraph.data import TokenLoader, stdlib_corpus, stdlib_tokenizer
from hgraph.models import Llama, LlamaConfig, init_weights
from hgraph.planner.cost import CostModel
from hgraph.planner.terms import with_terms
from hgraph.profiling import profile
from hgraph.profiling.profile_iteration import profile_iteration

__all__ = ["DemoConfig", "SIZES", "model_factory", "tiny_model"]

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, hidden=64, layers=4, heads=4, kv_heads=4, ffn=128),
    "small": dict(vocab_size=512, hidden=128, layers=4, heads=8, kv_heads=4, ffn=256),
    "medium": dict(vocab_size=1024, hidden=256, layers=4, heads=8, kv_heads=8, ffn=512),
}
SCHEMES = ("tp1", "tp2", "tp4", "tp1,pp2", "tp2,pp2", "tp1,pp4")
WORLD_SIZE = 2  # one rank per core of a 2-core machine
MAX_LEN = 2048  # files are cut here: long enough that lengths vary, short enough for CPU attention
MEMORY_BINDS = MAX_LEN  # default budget: a file as long as the context does not fit a tp1 pipeline
TOKENS_PER_ITERATION = 4096


@dataclass(frozen=True)
class DemoConfig:
    """Everything a rank needs to run its part of the demo (picklable)."""

    size: str = "tiny"
    world_size: int = WORLD_SIZE
    iterations: int = 30
    tokens_per_iteration: int = TOKENS_PER_ITERATION
    max_len: int = MAX_LEN
    long_documents: str = "cut"
    eval_interval: int = 10
    eval_batches: int = 4
    lr: float = 3e-3
    seed: int = 0
    timeline: bool = True
    schedule: str = "overlap"
    candidates: tuple[str, ...] = field(default=())
    cost_table: str = ""
    gpu_memory: Optional[float] = None  # per-rank memory budget (bytes) for MaxLen; None: the profiled one


def model_factory(size: str = "tiny") -> torch.nn.Module:
    """The demo model of a given size, with deterministic weights."""
    model = Llama(LlamaConfig(**SIZES[size]))
    init_weights(model, seed=0)
    return model


def tiny_model() -> torch.nn.Module:
    return model_factory("tiny")


def small_model() -> torch.nn.Module:
    return model_factory("small")


def medium_model() -> torch.nn.Module:
    return model_factory("medium")


def corpus_loaders(cfg: DemoConfig) -> tuple[Any, Any]:
    """Training and held-out ``TokenLoader`` over the standard library (same order on every rank)."""
    train, held = stdlib_corpus()
    tok = stdlib_tokenizer()
    make = lambda src: TokenLoader(src, tok, cfg.max_len, cfg.tokens_per_iteration, seed=cfg.seed, window=64,  # noqa: E731
                                   long_documents=cfg.long_documents)
    return make(train), make(held)


def corpus_batches(cfg: DemoConfig) -> list[list[int]]:
    """The lengths of the batches the run will train on (for the strategy proposal)."""
    train, _ = corpus_loaders(cfg)
    return [[len(s) for s in train.next_batch()] for _ in range(cfg.iterations)]


def _profile_lengths(cfg: DemoConfig) -> list[int]:
    top = max(cfg.max_len, 96)  # three distinct lengths at least, to fit a, b and c
    return sorted({min(top, n) for n in (top // 4, top // 2, 3 * top // 4, top)} | {min(top, n) for n in (64, 128, 256, 512)})


def factory_of(cfg: DemoConfig) -> Any:
    """The demo model's factory as the profiler and the ranks take it (``"module:function"`` or a
    picklable callable)."""
    return "hgraph.cli.demo:tiny_model" if cfg.size == "tiny" else _SizedFactory(cfg.size)


def profiled_cost_table(cfg: DemoConfig, fresh: bool = False) -> dict[str, Any]:
    """``T(l)`` per scheme measured on this machine (cached by ``hgraph profile``)."""
    schemes = [s for s in SCHEMES if _fits(s, cfg)]
    cm = profile.profile_cost_model(factory_of(cfg), cfg.world_size, schemes, _profile_lengths(cfg), use_cache=not fresh)
    return cm.to_table()


def with_iteration_terms(cfg: DemoConfig, table: dict[str, Any], candidates: list[str], batches: list[list[int]],
                         fresh: bool = False, repeats: int = 2) -> dict[str, Any]:
    """The cost table plus the iteration terms of ``candidates`` measured on ``batches`` (lengths;
    cached by ``hgraph profile``)."""
    cost_model = CostModel.from_table(table)
    found = profile_iteration(factory_of(cfg), cfg.world_size, candidates, cost_model, _profile_lengths(cfg),
                              repeats=repeats, use_cache=not fresh, batches=batches)
    return with_terms(cost_model, found.terms).to_table()


@dataclass(frozen=True)
class _SizedFactory:
    size: str

    def __call__(self) -> torch.nn.Module:
        return model_factory(self.size)


def _fits(scheme: str, cfg: DemoConfig) -> bool:
    """Whether ``scheme`` fills the world and fits the model (``Strategy.check``)."""
    dims = SIZES[cfg.size]
    return fits(Degrees.parse(scheme), cfg.world_size, dict(dims, vocab=dims["vocab_size"]))


