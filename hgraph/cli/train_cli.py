"""``hgraph train CONFIG``: train a model described by a JSON or TOML config (see
``hgraph.training.train_config`` and docs/config.md) on local ranks, or one rank per process under torchrun
(``RANK`` set): NCCL when CUDA is available, gloo otherwise (``backend``).

Every iteration the planner picks the strategy, the pipelines' sequences and their packing
(``planner = "auto"``, the default): with the ``[planner] cost_table`` (a preset or a file), else
with ``T(l)`` profiled once and cached in ``$HGRAPH_CACHE``: on this machine's local ranks, or under
torchrun on the job's own ranks and devices (rank 0 prints the progress; a later run of the job reads
the cache). ``planner = "none"`` rotates through the strategies instead, and says so.

With ``data.paths``: documents from local files through ``hgraph.data`` (rank 0 reads; every rank
gets only its pipeline's tokens), held-out loss every ``eval.interval`` iterations, checkpoints
(``checkpoint.dir/step-N``, written in the background, the newest ``checkpoint.keep`` kept) with the
data position and planner state every ``checkpoint.interval`` (``checkpoint.resume`` continues
exactly from the newest: also after ``torchrun --max-restarts`` restarted the job), export at the end
(``export.dir``: HF ``save_pretrained`` format, or ``model.safetensors`` for other models; written
tensor by tensor, in HF shards with an index when large). Without it: the synthetic learnable
sequences of 0.1, lengths from a length file. An HF ``config.json`` or a local HF checkpoint
directory is built on the meta device: the Trainer initialises it layer by layer, or reads the
checkpoint by slices (docs/big_models.md). SIGTERM (to ``hgraph train`` or to its ranks under
torchrun): every rank finishes the iteration, a checkpoint is written, exit code 0. Metrics
(``[metrics]``, ``hgraph.runtime.metrics``): ``metrics.jsonl`` and TensorBoard event files, one
console line per iteration on rank 0; log records go to ``out/logs/rank<r>.log``. ``history.json``
(over restarts too), ``eval.json``, ``summary.json`` and ``loss.png`` in ``out``. Nothing in the
config is executed except importing the model factory it names.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from hgraph.cli import plots
from hgraph.cli.config_flags import add_config_flags, overrides
from hgraph.cli.model_spec import ModelSpec, model_vocab
from hgraph.cli.train_planning import check_fits, planner_table, profiled_table
from hgraph.cli.train_run import loaders, train_rank
from hgraph.core import atomic_files
from hgraph.core.degrees import Degrees
from hgraph.core.model_info import model_dims
from hgraph.core.strategy import Strategy, fits
from hgraph.errors import CommunicationError, HGraphError, InputError, StrategyError
from hgraph.planner.batches import make_batches, read_lengths, sample_path
from hgraph.planner.cost import CostModel
from hgraph.planner.proposal import propose
from hgraph.runtime import preemption
from hgraph.runtime.kernels.failures import DEFAULT_COMM_TIMEOUT
from hgraph.runtime.launch import choose_backend as backend_for
from hgraph.runtime.launch import init_from_env, launch
from hgraph.training.config_toml import to_toml
from hgraph.training.train_config import TrainConfig, read_config

__all__ = ["add_arguments", "run"]

SCHEMES = ("tp1", "tp2", "tp4", "tp8", "tp1,pp2", "tp2,pp2", "tp1,pp4")


def precheck(cfg: TrainConfig) -> None:
    """Everything that can be checked before ranks start: model, strategies against it, tokenizer
    vocabulary, first batch."""
    model = ModelSpec(cfg.model, cfg.seed, meta=True)()
    if not cfg.auto:
        dims = model_dims(model)
        for i, text in enumerate(cfg.strategies):
            try:
                Strategy.parse(text).check(cfg.world_size, dims)
            except StrategyError as exc:
                raise InputError(f"config {cfg.source}: strategies[{i}] = {text!r}: {exc}") from None
    if not cfg.documents:
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
    assert cfg.documents
    dims = model_dims(ModelSpec(cfg.model, cfg.seed, meta=True)())
    schemes = [text for text in SCHEMES if fits(Degrees.parse(text), cfg.world_size, dims)]
    table = profiled_table(cfg, ModelSpec(cfg.model, cfg.seed), schemes)
    train, _ = loaders(cfg)
    sample = [len(s) for b in train.first_batches(8) for s in b]
    found = propose(CostModel.from_table(json.loads(table)), cfg.world_size, sample, cfg.context,
                    tokens_per_iteration=cfg.data.batch_tokens, max_candidates=4)
    return [str(s) for s in found], table


def choose_backend(cfg: TrainConfig, world_size: int) -> str:
    """The process-group backend of a run: ``backend``, or from ``device``, or NCCL when CUDA is
    available with enough GPUs (under torchrun: one per local rank), gloo otherwise."""
    requested = cfg.backend
    if requested == "auto" and cfg.device != "auto":
        requested = "nccl" if cfg.device == "cuda" else "gloo"
    try:
        return backend_for(requested, world_size)
    except CommunicationError as exc:
        raise InputError(f"config {cfg.source}: backend / device: {exc}") from None


def length_batches(cfg: TrainConfig) -> list[list[int]]:
    d = cfg.data
    source = sample_path() if d.lengths == "wikipedia" else d.lengths
    lengths = [max(16, n // d.length_scale) for n in read_lengths(source)]
    return make_batches(lengths, d.batch_tokens, d.max_len, cfg.iterations, seed=cfg.seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Every config key is a flag (--section.key VALUE) that overrides the config's value; "
                     "docs/config.md lists them with their defaults. The run folder's config.toml is the "
                     "resolved config, and a config too.")
    parser.add_argument("config", help="JSON or TOML config (docs/config.md), or a run folder's config.toml")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for the whole run, local ranks only (default: none, run until done)")
    parser.add_argument("--comm-timeout", type=float, default=DEFAULT_COMM_TIMEOUT,
                        help="seconds a collective may wait before the run stops with an error naming the rank "
                        "(default: %(default)g)")
    add_config_flags(parser)


def configured(args: argparse.Namespace) -> TrainConfig:
    """The config file with the command line's keys, checked (under torchrun ``WORLD_SIZE`` decides
    ``world_size``)."""
    cfg = read_config(args.config, overrides(args))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        cfg = replace(cfg, world_size=int(os.environ["WORLD_SIZE"]))
    return cfg


def export_over_source(cfg: Any) -> str:
    """A one-line notice when ``export.dir`` is the model folder the run loads its weights from
    (the export replaces them once it is complete; a failed export leaves them), else ``""``."""
    if not cfg.export.dir or not Path(cfg.model).is_dir():
        return ""
    if Path(cfg.export.dir).resolve() != Path(cfg.model).resolve():
        return ""
    return (f"note: export.dir {cfg.export.dir} is the model folder this run loads from: its weights are "
            "replaced when the export completes (a failed export leaves them); give another export.dir to keep them")


def run(args: argparse.Namespace) -> int:
    cfg = configured(args)
    torchrun = "RANK" in os.environ
    lead = not torchrun or int(os.environ["RANK"]) == 0
    notice = export_over_source(cfg)
    if notice and lead:
        print(notice, file=sys.stderr)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torchrun else cfg.world_size
    backend = choose_backend(cfg, local_ranks)
    if torchrun:  # under torchrun: SIGTERM (preemption) ends the iteration, checkpoints, exits 0
        preemption.install()
    precheck(cfg)
    batches = None if cfg.documents else length_batches(cfg)
    cost_table = None
    if cfg.auto and torchrun:
        raise InputError(f"config {cfg.source}: strategies: \"auto\" profiles on local ranks, which hgraph does not "
                         "start under torchrun; run `hgraph train` with this config once without torchrun to see "
                         "the proposed strategies (the profile is cached), then list them in the config")
    if torchrun:  # the job's process group: a profile on its ranks, then training
        init_from_env(backend, timeout=args.comm_timeout)
    if cfg.auto:
        strategies, cost_table = auto_strategies(cfg)
        print(f"hgraph train: {len(strategies)} proposed strategies: " + "; ".join(strategies))
        cfg = replace(cfg, strategies=tuple(strategies))
        check_fits(cfg, cost_table)
    elif cfg.planner.mode == "auto":
        say = (lambda text: print(f"hgraph train: {text}", flush=True)) if lead else (lambda text: None)
        cost_table, source = planner_table(cfg, ModelSpec(cfg.model, cfg.seed), torchrun, say)
        check_fits(cfg, cost_table)
        if lead:
            print(f"hgraph train: planning every iteration over {len(cfg.strategies)} strategies "
                  f"({'; '.join(cfg.strategies)}) with {source}")
    elif lead:
        print(f"hgraph train: planner = \"none\": iteration i runs strategy i mod {len(cfg.strategies)} "
              f"({'; '.join(cfg.strategies)}); nothing is planned")
    if lead:  # the resolved config, a config of its own: `hgraph train OUT/config.toml` runs this again
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        atomic_files.write_text(Path(cfg.out) / "config.toml", to_toml(cfg))
    if torchrun:
        try:
            result = train_rank(cfg, batches, cost_table)
        except HGraphError as exc:
            leave_at_once_if_stopped(exc)
            raise
        if not lead:
            return 0
    else:
        result = launch(train_rank, cfg.world_size, args=(cfg, batches, cost_table), timeout=args.timeout,
                        backend=backend, comm_timeout=args.comm_timeout, preemptible=True)[0]
    if "error" in result:
        raise InputError(result["error"])
    write_outputs(Path(cfg.out), result)
    return 0


def leave_at_once_if_stopped(exc: HGraphError) -> None:
    """This torchrun worker failed (a peer died): there is no iteration to finish and no checkpoint to
    write, so SIGTERM gets its default action back. If torchrun's SIGTERM already came (it stops the
    survivors of a lost rank before restarting the job), die of it now, after naming the error, instead
    of making the restart wait for this interpreter's teardown (seconds under load; torchrun waits up
    to 30 s)."""
    signalled = preemption.requested()
    preemption.uninstall()
    if signalled:
        print(f"hgraph train: error: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGTERM)


def write_outputs(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    first = result["summary"].get("first_iteration") or 0
    if first:  # a resumed run: the records of the iterations before the checkpoint, then this run's
        result = {**result, "history": _earlier(out / "history.json", first) + result["history"],
                  "evals": _earlier(out / "eval.json", first) + result["evals"]}
    atomic_files.write_text(out / "history.json", json.dumps(result["history"], indent=1))
    atomic_files.write_text(out / "eval.json", json.dumps(result["evals"], indent=1))
    atomic_files.write_text(out / "summary.json", json.dumps(result["summary"], indent=1))
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
