"""``hgraph train CONFIG``: train a model described by a JSON or TOML config (see
``hgraph.training.train_config``) on local gloo ranks, or one rank per process under torchrun (``RANK`` set).

With ``data.paths``: documents from local files through ``hgraph.data`` (rank 0 reads; every rank
gets only its pipeline's tokens), held-out loss every ``eval.interval`` iterations, checkpoints
(``checkpoint.dir/step-N``, written in the background, the newest ``checkpoint.keep`` kept) with the
data position and planner state every ``checkpoint.interval`` (``checkpoint.resume`` continues
exactly from the newest: also after ``torchrun --max-restarts`` restarted the job), export at the end
(``export.dir``: HF ``save_pretrained`` format, or ``model.safetensors`` for other models). Without
it: the synthetic learnable sequences of 0.1, lengths from a length file. SIGTERM (to ``hgraph
train`` or to its ranks under torchrun): every rank finishes the iteration, a checkpoint is written,
exit code 0. Metrics (``[metrics]``, ``hgraph.runtime.metrics``): ``metrics.jsonl`` and TensorBoard
event files, one console line per iteration on rank 0; log records go to ``out/logs/rank<r>.log``.
``history.json`` (over restarts too), ``eval.json``, ``summary.json`` and ``loss.png`` in ``out``.
Nothing in the config is executed except importing the model factory it names.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from hgraph.core.errors import InputError
from hgraph.training.train_config import STDLIB, TrainConfig, read_config

__all__ = ["ModelSpec", "TrainConfig", "read_config", "run"]
SCHEMES = ("tp1", "tp2", "tp4", "tp8", "tp1,pp2", "tp2,pp2", "tp1,pp4")


@dataclass(frozen=True)
class ModelSpec:
    """The config's ``model``: ``module:factory``, an HF ``config.json`` (random init with ``seed``)
    or a local HF checkpoint directory (``from_pretrained``). Picklable, for the ranks."""

    spec: str
    seed: int = 0

    def __call__(self) -> torch.nn.Module:
        p = Path(os.path.expanduser(self.spec))
        if ":" in self.spec and not p.exists():
            from hgraph.models import load_factory

            return load_factory(self.spec)()
        import transformers

        if p.is_dir():
            weights = list(p.glob("*.safetensors")) + list(p.glob("pytorch_model*.bin"))
            if not (p / "config.json").is_file():
                raise InputError(f"model {self.spec}: the directory has no config.json")
            if weights:
                return transformers.AutoModelForCausalLM.from_pretrained(
                    str(p), local_files_only=True, attn_implementation="sdpa", use_cache=False).eval()
            p = p / "config.json"
        if not p.is_file():
            raise InputError(f"model {self.spec!r}: not 'module:factory', an HF config.json or a checkpoint directory")
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
            config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
        except (KeyError, ValueError) as exc:
            raise InputError(f"model {self.spec}: not an HF model config ({exc})") from None
        config.use_cache = False
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def model_vocab(model: torch.nn.Module) -> Optional[int]:
    from hgraph.core.model_info import model_dims

    return model_dims(model).get("vocab")


def loaders(cfg: TrainConfig) -> tuple[Any, Any]:
    """The training and held-out ``TokenLoader`` of a config with ``data.paths``."""
    from hgraph.data import DocumentSource, TokenLoader, load_tokenizer, stdlib_corpus, stdlib_tokenizer

    d = cfg.data
    assert d is not None
    tok = stdlib_tokenizer() if d.tokenizer == STDLIB else load_tokenizer(d.tokenizer)

    def make(paths: tuple[str, ...], split: int) -> Any:
        source = stdlib_corpus()[split] if paths == (STDLIB,) else \
            DocumentSource.from_paths(list(paths), d.format, d.text_field)
        return TokenLoader(source, tok, d.context, d.tokens_per_iteration, d.seed, d.long_documents, d.window)

    return make(d.paths, 0), (make(cfg.eval_paths, 1) if cfg.eval_paths else None)


def lr_lambda(cfg: TrainConfig) -> Any:
    """Linear warmup over ``warmup`` iterations, then constant or cosine down to ``min_lr_ratio``."""
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.iterations - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def precheck(cfg: TrainConfig) -> None:
    """Everything that can be checked before ranks start: model, tokenizer vocabulary, first batch."""
    model = ModelSpec(cfg.model, cfg.seed)()
    if cfg.data is None:
        return
    train, held = loaders(cfg)
    train.tokenizer.check_vocab(model_vocab(model), "data.tokenizer")
    for name, loader in (("data.paths", train), ("eval.paths", held)):
        if loader is not None:
            try:
                loader.first_batches(1)
            except InputError as exc:
                raise InputError(f"{name}: {exc}") from None


def auto_strategies(cfg: TrainConfig) -> tuple[list[str], str]:
    """``strategies = "auto"``: profile the schemes that fit, propose candidates from the lengths of
    the first batches; returns the candidates and the cost table (JSON) for the planner."""
    from hgraph.core.model_info import model_dims
    from hgraph.planner.cost import Scheme
    from hgraph.planner.proposal import propose
    from hgraph.profiling import profile

    assert cfg.data is not None
    spec = ModelSpec(cfg.model, cfg.seed)
    dims = model_dims(spec())
    schemes = []
    for text in SCHEMES:
        s = Scheme.parse(text)
        if cfg.world_size % s.gpus == 0 and all(dims.get(k, s.tp) % s.tp == 0 for k in ("heads", "kv_heads")) \
                and dims.get("layers", s.pp) >= s.pp:
            schemes.append(text)
    context = cfg.data.context
    lengths = sorted({max(16, context * k // 4) for k in (1, 2, 3, 4)} | {n for n in (64, 128, 256) if n < context})
    cm = profile.profile_cost_model(spec, cfg.world_size, schemes, lengths)
    train, _ = loaders(cfg)
    sample = [len(s) for b in train.first_batches(8) for s in b]
    found = propose(cm, cfg.world_size, sample, context, tokens_per_iteration=cfg.data.tokens_per_iteration,
                    max_candidates=4)
    return [str(s) for s in found], json.dumps(cm.to_table())


def synthetic_sequence(length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """A learnable sequence: an arithmetic progression mod ``vocab`` with a random start and step,
    so the next token follows from the two before it (the loss can fall well below log(vocab))."""
    start = int(torch.randint(0, vocab, (1,), generator=generator))
    step = int(torch.randint(1, 8, (1,), generator=generator))
    return (start + step * torch.arange(length)) % vocab


def length_batches(cfg: TrainConfig) -> list[list[int]]:
    from hgraph.planner.batches import make_batches, read_lengths, sample_path

    source = sample_path() if cfg.lengths == "wikipedia" else cfg.lengths
    lengths = [max(16, n // cfg.length_scale) for n in read_lengths(source)]
    return make_batches(lengths, cfg.tokens_per_iteration, cfg.max_len, cfg.iterations, seed=cfg.seed)


def train_rank(cfg: TrainConfig, batches: Optional[list[list[int]]] = None, cost_table: Optional[str] = None) -> Any:
    """Every rank: compile, (resume,) train, evaluate, checkpoint, export; rank 0 returns the record.
    Data errors come back as ``{"error": ...}`` (every rank gets rank 0's), not as a rank failure."""
    try:
        return _train(cfg, batches, cost_table)
    except InputError as exc:
        return {"error": str(exc)}


def _train(cfg: TrainConfig, batches: Optional[list[list[int]]], cost_table: Optional[str]) -> Any:
    from hgraph.compiler import entry
    from hgraph.training.trainer import Trainer
    from hgraph.runtime.checkpoint_manager import CheckpointManager

    model = ModelSpec(cfg.model, cfg.seed)()
    vocab = model_vocab(model) or 256
    compiled = entry.compile(model, list(cfg.strategies), example_inputs=torch.randint(0, 8, (1, 16)))
    planner = None
    if cost_table or cfg.cost_table:
        from hgraph.planner.assign import Planner
        from hgraph.planner.cost import CostModel, load_cost_model

        cm = CostModel.from_table(json.loads(cost_table)) if cost_table else load_cost_model(cfg.cost_table)
        planner = Planner(cm, compiled.strategies)
    scheduler = None
    if cfg.warmup or cfg.lr_schedule != "constant":
        scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))  # noqa: E731
    trainer = Trainer(compiled, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                      planner=planner, lr_scheduler=scheduler, metrics=metrics_config(cfg))
    log_to_file(Path(cfg.out) / "logs", trainer.rank)
    if trainer.metrics is not None:
        trainer.metrics.iterations = cfg.iterations
    train, held = loaders(cfg) if cfg.data is not None else (None, None)
    checkpoints = None
    if cfg.checkpoint_dir:
        checkpoints = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint_interval, cfg.checkpoint_keep,
                                        cfg.checkpoint_async)
    resumed = checkpoints.resume(trainer, data=train) if checkpoints is not None and cfg.resume else None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    say = print if trainer.rank == 0 else (lambda *a, **k: None)
    if restart and not cfg.resume:
        say(f"hgraph train: restart {restart} of this torchrun job starts over (set checkpoint.resume = true "
            "to continue from the newest checkpoint)", flush=True)
    if resumed is not None:
        say(f"hgraph train: resumed from {resumed} at iteration {trainer.iteration}", flush=True)
    held_batches = held.first_batches(cfg.eval_batches) if held is not None and trainer.rank == 0 else None
    evals: list[dict[str, Any]] = []

    def evaluate() -> None:
        if held is not None:
            evals.append({"iteration": trainer.iteration, "loss": trainer.evaluate(held_batches)})
            say(f"iter {trainer.iteration}: held-out loss {evals[-1]['loss']:.4f}", flush=True)

    start, first = time.perf_counter(), trainer.iteration
    preempted = False
    if cfg.eval_interval:
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
        if cfg.eval_interval and trainer.iteration % cfg.eval_interval == 0:
            evaluate()
        saved = checkpoints.step(trainer) if checkpoints is not None else None
        if trainer.stop_requested:  # SIGTERM on some rank: every rank stops after this same iteration
            preempted = True
            if checkpoints is not None and saved is None:
                checkpoints.save(trainer)
            say(f"hgraph train: stopped by a signal after iteration {trainer.iteration}"
                + (f"; checkpoint in {cfg.checkpoint_dir}" if checkpoints is not None else
                   " (no checkpoint.dir: nothing saved)"), flush=True)
            break
    wall = time.perf_counter() - start
    if not preempted:
        if cfg.eval_interval and (not evals or evals[-1]["iteration"] != trainer.iteration):
            evaluate()
        if checkpoints is not None and cfg.checkpoint_interval and trainer.iteration % cfg.checkpoint_interval:
            checkpoints.save(trainer)
    if checkpoints is not None:
        checkpoints.close()  # the write in flight is complete (or its error raised) before we return
    trainer.close()
    exported = export(trainer, model, cfg.export_dir) if cfg.export_dir and not preempted else None
    tokens = sum(h["tokens"] for h in trainer.history)
    return {"history": trainer.history, "evals": evals, "summary": {
        "iterations": trainer.iteration - first, "first_iteration": first, "tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else None,
        "loss_first": trainer.history[0]["loss"] if trainer.history else None,
        "loss_last": trainer.history[-1]["loss"] if trainer.history else None,
        "heldout_first": evals[0]["loss"] if evals else None, "heldout_last": evals[-1]["loss"] if evals else None,
        "strategies": [str(s) for s in compiled.strategies], "checkpoint": cfg.checkpoint_dir, "export": exported,
        "resumed_from": str(resumed) if resumed is not None else None, "preempted": preempted,
        "metrics": str(trainer.metrics.directory) if trainer.metrics is not None else None,
        "data_position": str(train.position) if train is not None else None}}


def metrics_config(cfg: TrainConfig) -> Any:
    """The ``[metrics]`` section as a ``MetricsConfig`` (``None`` when every sink is off)."""
    from hgraph.runtime.metrics import MetricsConfig

    if not (cfg.metrics_jsonl or cfg.metrics_tensorboard or cfg.metrics_console):
        return None
    return MetricsConfig(cfg.metrics_dir or str(Path(cfg.out) / "metrics"), cfg.metrics_jsonl,
                         cfg.metrics_tensorboard, cfg.metrics_console, cfg.peak_tflops)


def log_to_file(directory: Path, rank: int) -> Path:
    """Send hgraph's log records to ``directory/rank<r>.log`` and not to the console, where the
    progress lines go (so the two never interleave)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.log"
    logger = logging.getLogger("hgraph")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return path


def export(trainer: Any, model: torch.nn.Module, path: str) -> str:
    """HF models: ``export_pretrained``; others: the state dict as ``model.safetensors``."""
    if hasattr(model, "save_pretrained"):
        from hgraph.training.export import export_pretrained

        return str(export_pretrained(trainer, model, path))
    state = trainer.state_dict()
    if trainer.rank == 0:
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(path) / "model.safetensors"))
    return str(Path(path) / "model.safetensors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="JSON or TOML config (see the README, 'hgraph train')")
    parser.add_argument("--world-size", type=int, help="override the config's world_size (local ranks only)")
    parser.add_argument("--timeout", type=float, default=1800.0)


def run(args: argparse.Namespace) -> int:
    cfg = read_config(args.config)
    if "RANK" in os.environ:  # under torchrun: SIGTERM (preemption) ends the iteration, checkpoints, exits 0
        from hgraph.runtime import preemption

        preemption.install()
    if args.world_size:
        cfg = replace(cfg, world_size=args.world_size)
    precheck(cfg)
    batches = length_batches(cfg) if cfg.data is None else None
    cost_table = None
    if cfg.auto and "RANK" in os.environ:
        raise InputError(f"config {cfg.source}: strategies: \"auto\" profiles on local ranks; under torchrun "
                         "list the strategies (run `hgraph train` locally once to see the proposal)")
    if cfg.auto:
        strategies, cost_table = auto_strategies(cfg)
        print(f"hgraph train: {len(strategies)} proposed strategies: " + "; ".join(strategies))
        cfg = replace(cfg, strategies=tuple(strategies))
    if "RANK" in os.environ:
        from hgraph.runtime.launch import init_from_env

        init_from_env("gloo")
        result = train_rank(cfg, batches, cost_table)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        from hgraph.runtime.launch import launch

        result = launch(train_rank, cfg.world_size, args=(cfg, batches, cost_table), timeout=args.timeout,
                        preemptible=True)[0]
    if "error" in result:
        raise InputError(result["error"])
    write_outputs(Path(cfg.out), result)
    return 0


def write_outputs(out: Path, result: dict[str, Any]) -> None:
    from hgraph.cli import plots

    out.mkdir(parents=True, exist_ok=True)
    first = result["summary"].get("first_iteration") or 0
    if first:  # a resumed run: the records of the iterations before the checkpoint, then this run's
        result = {**result, "history": _earlier(out / "history.json", first) + result["history"],
                  "evals": _earlier(out / "eval.json", first) + result["evals"]}
    (out / "history.json").write_text(json.dumps(result["history"], indent=1))
    (out / "eval.json").write_text(json.dumps(result["evals"], indent=1))
    (out / "summary.json").write_text(json.dumps(result["summary"], indent=1))
    if result["history"]:
        plots.train_and_heldout(out / "loss.png", result["history"], result["evals"])
    s = result["summary"]
    lines = [f"trained {s['iterations']} iterations, {s['tokens']} tokens in {s['wall_s']:.1f} s "
             f"({(s['tokens_per_s'] or 0):.0f} tokens/s)"]
    if s["loss_first"] is not None:
        lines.append(f"training loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}")
    if s["heldout_first"] is not None:
        lines.append(f"held-out loss {s['heldout_first']:.4f} -> {s['heldout_last']:.4f}")
    if s.get("preempted"):
        lines.append(f"stopped by a signal after iteration {s['first_iteration'] + s['iterations']} "
                     "(run again with checkpoint.resume = true to continue)")
    for key in ("checkpoint", "export", "metrics", "data_position"):
        if s.get(key):
            lines.append(f"{key.replace('_', ' ')}: {s[key]}")
    lines.append(f"wrote {out / 'history.json'}, eval.json, summary.json" + (", loss.png" if result["history"] else ""))
    print("\n".join(lines))


def _earlier(path: Path, iteration: int) -> list[dict[str, Any]]:
    """The records of ``path`` (a run's history.json or eval.json) before ``iteration``."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [r for r in records if isinstance(r, dict) and r.get("iteration", iteration) < iteration]
