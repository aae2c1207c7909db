"""``hgraph train CONFIG.json``: train a model described by a JSON config on local ranks or torchrun.

Config keys (only ``model`` and ``strategies`` are required)::

    {"model": "hgraph.demo:tiny_model",          # module:factory returning an nn.Module
     "strategies": ["tp2 + 2x tp1", "4x tp1"],   # compiled once; cycled per iteration unless a planner is set
     "world_size": 4, "iterations": 10, "lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0,
     "data": {"lengths": "wikipedia", "tokens_per_iteration": 2048, "max_len": 512, "length_scale": 8, "seed": 0},
     "planner": {"cost_table": "profile.json"},  # optional: the planner picks strategy, dispatch, packing
     "out": "runs/train"}

The data are synthetic learnable sequences whose lengths follow the length file ("wikipedia" is the
bundled sample). Under torchrun (``RANK`` set) every process runs its own rank; otherwise
``world_size`` local gloo ranks are spawned. The config is JSON: nothing in it is executed except
importing the model factory it names.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hgraph.errors import InputError

KNOWN = {"model", "strategies", "world_size", "iterations", "lr", "weight_decay", "grad_clip", "data", "planner", "out"}


@dataclass(frozen=True)
class TrainConfig:
    model: str
    strategies: tuple[str, ...]
    world_size: int = 4
    iterations: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    lengths: str = "wikipedia"
    tokens_per_iteration: int = 2048
    max_len: int = 512
    length_scale: int = 8
    seed: int = 0
    cost_table: str | None = None
    out: str = "runs/train"


def read_config(path: str) -> TrainConfig:
    """Parse and check a config file; every problem is an ``InputError`` naming the key."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"config {path}: bad JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise InputError(f"config {path}: expected a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - KNOWN
    if unknown:
        raise InputError(f"config {path}: unknown keys {sorted(unknown)}; known: {sorted(KNOWN)}")
    for key in ("model", "strategies"):
        if key not in raw:
            raise InputError(f"config {path}: missing required key {key!r}")
    if not isinstance(raw["strategies"], list) or not raw["strategies"]:
        raise InputError(f"config {path}: 'strategies' must be a non-empty list like [\"tp2\", \"2x tp1\"]")
    data = raw.get("data", {})
    planner = raw.get("planner", {})
    cfg = TrainConfig(
        model=str(raw["model"]),
        strategies=tuple(str(s) for s in raw["strategies"]),
        world_size=int(raw.get("world_size", 4)),
        iterations=int(raw.get("iterations", 10)),
        lr=float(raw.get("lr", 1e-3)),
        weight_decay=float(raw.get("weight_decay", 0.0)),
        grad_clip=None if raw.get("grad_clip") is None else float(raw["grad_clip"]),
        lengths=str(data.get("lengths", "wikipedia")),
        tokens_per_iteration=int(data.get("tokens_per_iteration", 2048)),
        max_len=int(data.get("max_len", 512)),
        length_scale=int(data.get("length_scale", 8)),
        seed=int(data.get("seed", 0)),
        cost_table=planner.get("cost_table"),
        out=str(raw.get("out", "runs/train")),
    )
    if cfg.world_size < 1 or cfg.iterations < 1:
        raise InputError(f"config {path}: world_size and iterations must be >= 1")
    return cfg


def length_batches(cfg: TrainConfig) -> list[list[int]]:
    from hgraph.planner.batches import make_batches, read_lengths, sample_path

    source = sample_path() if cfg.lengths == "wikipedia" else cfg.lengths
    lengths = [max(16, n // cfg.length_scale) for n in read_lengths(source)]
    return make_batches(lengths, cfg.tokens_per_iteration, cfg.max_len, cfg.iterations, seed=cfg.seed)


def train_rank(cfg: TrainConfig, batches: list[list[int]]) -> list[dict[str, Any]]:
    """Every rank: compile, train, return the history."""
    import hgraph
    from hgraph.demo import synthetic_sequence
    from hgraph.models import load_factory

    model = load_factory(cfg.model)()
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 256))
    compiled = hgraph.compile(model, list(cfg.strategies), example_inputs=torch.randint(0, vocab, (1, 16)))
    planner = None
    if cfg.cost_table:
        from hgraph.planner.assign import Planner
        from hgraph.planner.cost import load_cost_model

        planner = Planner(load_cost_model(cfg.cost_table), compiled.strategies)
    trainer = hgraph.Trainer(compiled, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                             planner=planner)
    for i, lengths in enumerate(batches):
        g = torch.Generator().manual_seed(cfg.seed * 100_003 + i)
        sequences = [synthetic_sequence(n, vocab, g) for n in lengths]
        loss = trainer.step(sequences, strategy=None if planner else i % len(compiled.strategies))
        if trainer.rank == 0:
            print(f"iter {i} loss {loss:.4f} strategy {trainer.history[-1]['strategy']}", flush=True)
    return trainer.history


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="JSON config (see `hgraph train --help` and the README)")
    parser.add_argument("--world-size", type=int, help="override the config's world_size (local ranks only)")
    parser.add_argument("--timeout", type=float, default=1800.0)


def run(args: argparse.Namespace) -> int:
    cfg = read_config(args.config)
    if args.world_size:
        cfg = TrainConfig(**{**cfg.__dict__, "world_size": args.world_size})
    batches = length_batches(cfg)
    if "RANK" in os.environ:
        from hgraph.runtime.launch import init_from_env

        init_from_env("gloo")
        history = train_rank(cfg, batches)
    else:
        from hgraph.runtime.launch import launch

        history = launch(train_rank, cfg.world_size, args=(cfg, batches), timeout=args.timeout)[0]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.json").write_text(json.dumps(history, indent=1))
    print(f"wrote {out / 'history.json'}")
    return 0
