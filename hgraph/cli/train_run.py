"""What every rank of ``hgraph train`` runs: compile, (resume,) train, evaluate, checkpoint, export.

``train_rank`` is the function ``hgraph.cli.train_cli`` starts on local ranks (``launch``) or calls
once per torchrun process; rank 0 returns the run's record (history, held-out losses, summary).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from hgraph.cli.model_spec import ModelSpec, model_vocab
from hgraph.cli.train_planning import planning_cost_model
from hgraph.compiler import entry
from hgraph.data import DocumentSource, TokenLoader, load_tokenizer, stdlib_corpus, stdlib_tokenizer
from hgraph.errors import InputError
from hgraph.frontend.meta import is_meta_model
from hgraph.planner.assign import Planner
from hgraph.runtime.checkpoint_manager import CheckpointManager
from hgraph.runtime.metrics import MetricsConfig
from hgraph.runtime.metrics import log as metrics_log
from hgraph.training.export import export_pretrained, save_safetensors
from hgraph.training.train_config import STDLIB, TrainConfig
from hgraph.training.trainer import Trainer

__all__ = ["loaders", "synthetic_sequence", "train_rank"]


def loaders(cfg: TrainConfig) -> tuple[Any, Any]:
    """The training and held-out ``TokenLoader`` of a config with ``data.paths``."""
    d = cfg.data
    assert cfg.documents
    tok = stdlib_tokenizer() if d.tokenizer == STDLIB else load_tokenizer(d.tokenizer)

    def make(paths: tuple[str, ...], split: int) -> Any:
        source = stdlib_corpus()[split] if paths == (STDLIB,) else \
            DocumentSource.from_paths(list(paths), d.format, d.text_field)
        return TokenLoader(source, tok, d.context, d.batch_tokens, d.seed, d.long_documents, d.window)

    return make(d.paths, 0), (make(cfg.eval.paths, 1) if cfg.eval.paths else None)


def synthetic_sequence(length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """A learnable sequence: an arithmetic progression mod ``vocab`` with a random start and step,
    so the next token follows from the two before it (the loss can fall well below log(vocab))."""
    start = int(torch.randint(0, vocab, (1,), generator=generator))
    step = int(torch.randint(1, 8, (1,), generator=generator))
    return (start + step * torch.arange(length)) % vocab


def train_rank(cfg: TrainConfig, batches: Optional[list[list[int]]] = None, cost_table: Optional[str] = None) -> Any:
    """Every rank: compile, (resume,) train, evaluate, checkpoint, export; rank 0 returns the record.
    Data errors come back as ``{"error": ...}`` (every rank gets rank 0's), not as a rank failure."""
    try:
        return _train(cfg, batches, cost_table)
    except InputError as exc:
        return {"error": str(exc)}


def _train(cfg: TrainConfig, batches: Optional[list[list[int]]], cost_table: Optional[str]) -> Any:
    spec = ModelSpec(cfg.model, cfg.seed, meta=True)
    model = spec()
    vocab = model_vocab(model) or 256
    compiled = entry.compile(model, list(cfg.strategies), example_inputs=torch.randint(0, 8, (1, 16)),
                             options=cfg.compile)
    planner = None
    if cost_table is not None:
        planner = Planner(planning_cost_model(cfg, cost_table), compiled.strategies,
                          pipeline_schedule=cfg.compile.schedule.pipeline)
    scheduler = None
    if not cfg.lr_schedule.constant:
        scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
            opt, lambda step: cfg.lr_schedule.factor(step, cfg.iterations))
    # meta-built models: sliced load or layer-wise init; eager ones are released once sharded
    trainer = Trainer(compiled,
                      optimizer=replace(cfg.optimizer, lr_scheduler=scheduler),
                      run=replace(cfg.run, metrics=metrics_config(cfg),
                                  weights=spec.weights if is_meta_model(model) else None,
                                  init_seed=cfg.seed, release_model=not is_meta_model(model)),
                      planner=planner)
    log_to_file(Path(cfg.out) / "logs", trainer.rank)
    console_lines_to_stdout()
    if trainer.metrics is not None:
        trainer.metrics.iterations = cfg.iterations
    train, held = loaders(cfg) if cfg.documents else (None, None)
    checkpoints = None
    c = cfg.checkpoint
    if c.dir:
        checkpoints = CheckpointManager(c.dir, c.interval, c.keep, c.async_)
    resumed = checkpoints.resume(trainer, data=train) if checkpoints is not None and c.resume else None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    say = print if trainer.rank == 0 else (lambda *a, **k: None)
    if restart and not c.resume:
        say(f"hgraph train: restart {restart} of this torchrun job starts over (set checkpoint.resume = true "
            "to continue from the newest checkpoint)", flush=True)
    if resumed is not None:
        say(f"hgraph train: resumed from {resumed} at iteration {trainer.iteration}", flush=True)
    held_batches = held.first_batches(cfg.eval.batches) if held is not None and trainer.rank == 0 else None
    evals: list[dict[str, Any]] = []

    def evaluate() -> None:
        if held is not None:
            evals.append({"iteration": trainer.iteration, "loss": trainer.evaluate(held_batches)})
            say(f"iter {trainer.iteration}: held-out loss {evals[-1]['loss']:.4f}", flush=True)

    start, first = time.perf_counter(), trainer.iteration
    preempted = False
    if cfg.eval.interval:
        evaluate()
    while trainer.iteration < cfg.iterations:
        i = trainer.iteration
        strategy = None if planner else i % len(compiled.strategies)
        if train is not None:
            loss = trainer.step_data(train, strategy)
            if loss is None:
                break
        else:
            g = torch.Generator().manual_seed(cfg.seed * 100_003 + i)
            loss = trainer.step([synthetic_sequence(n, vocab, g) for n in batches[i]], strategy)
        rec = trainer.history[-1]
        rec["tokens"] = sum(rec["lengths"])
        if cfg.eval.interval and trainer.iteration % cfg.eval.interval == 0:
            evaluate()
        saved = checkpoints.step(trainer) if checkpoints is not None else None
        if trainer.stop_requested:  # SIGTERM on some rank: every rank stops after this same iteration
            preempted = True
            if checkpoints is not None and saved is None:
                checkpoints.save(trainer)
            say(f"hgraph train: stopped by a signal after iteration {trainer.iteration}"
                + (f"; checkpoint in {c.dir}" if checkpoints is not None else
                   " (no checkpoint.dir: nothing saved)"), flush=True)
            break
    wall = time.perf_counter() - start
    if not preempted:
        if cfg.eval.interval and (not evals or evals[-1]["iteration"] != trainer.iteration):
            evaluate()
        if checkpoints is not None and c.interval and trainer.iteration % c.interval:
            checkpoints.save(trainer)
    if checkpoints is not None:
        checkpoints.close()  # the write in flight is complete (or its error raised) before we return
    trainer.close()
    exported = export(trainer, model, cfg.export.dir) if cfg.export.dir and not preempted else None
    tokens = sum(h["tokens"] for h in trainer.history)
    return {"history": trainer.history, "evals": evals, "summary": {
        "iterations": trainer.iteration - first, "first_iteration": first, "tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else None,
        "loss_first": trainer.history[0]["loss"] if trainer.history else None,
        "loss_last": trainer.history[-1]["loss"] if trainer.history else None,
        "heldout_first": evals[0]["loss"] if evals else None, "heldout_last": evals[-1]["loss"] if evals else None,
        "strategies": [str(s) for s in compiled.strategies], "checkpoint": c.dir, "export": exported,
        "data_position": str(train.position) if train is not None else None,
        "resumed_from": str(resumed) if resumed is not None else None, "preempted": preempted,
        "metrics": str(trainer.metrics.directory) if trainer.metrics is not None else None,
        "planner": "per iteration" if planner is not None else "rotation", "backend": dist.get_backend(),
        "device": str(trainer.device), "options": {
            "compute_dtype": str(compiled.options.compute_dtype or torch.float32).removeprefix("torch."),
            "reduce_dtype": str(compiled.options.reduce_dtype).removeprefix("torch."),
            "recompute": compiled.options.recompute.mode,
            "schedule": "none" if compiled.options.schedule.overlap is None else "overlap",
            "pipeline_schedule": compiled.options.schedule.pipeline}}}


def metrics_config(cfg: TrainConfig) -> Any:
    """The ``[metrics]`` section as a ``MetricsConfig`` (``None`` when every sink is off)."""
    m = cfg.metrics
    if not (m.jsonl or m.tensorboard or m.console or m.wandb):
        return None
    return MetricsConfig(m.dir or str(Path(cfg.out) / "metrics"), m.jsonl, m.tensorboard, m.console, m.peak_tflops,
                         m.wandb)


def console_lines_to_stdout() -> None:
    """The metrics' console line per iteration (``hgraph.runtime.metrics``'s INFO records) on stdout,
    the message alone; in the log file too."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    metrics_log.addHandler(handler)
    metrics_log.setLevel(logging.INFO)


def log_to_file(directory: Path, rank: int) -> Path:
    """Send hgraph's log records to ``directory/rank<r>.log``; on the console (stderr) only warnings
    and errors, as ``hgraph`` shows them, also in local ranks (stdout has the progress lines)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.log"
    logger = logging.getLogger("hgraph")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    if not any(type(h) is logging.StreamHandler for h in logger.handlers):  # a local rank: no hgraph command here
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        console.setLevel(logging.WARNING)
        logger.addHandler(console)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return path


def export(trainer: Any, model: torch.nn.Module, path: str) -> str:
    """HF models: ``export_pretrained``; others: the state as safetensors (``model.safetensors``, or HF
    shards with an index). Streamed: rank 0 writes one tensor at a time."""
    if hasattr(model, "save_pretrained"):
        return str(export_pretrained(trainer, model, path))
    files = save_safetensors(trainer, path)
    return str(files[0] if len(files) == 1 else path)

