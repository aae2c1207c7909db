"""The ``hgraph train`` config (JSON or TOML), parsed and checked: every problem is one
``InputError`` line naming the field (``data.context``) or the file. Every field, its default and
its meaning: docs/config.md.

Top level: ``model`` (``module:factory``, an HF ``config.json``, or an HF checkpoint directory:
local, or a hub id in the local HF cache), ``strategies`` (a list, or ``"auto"``: profile + propose), ``world_size``,
``iterations``, ``seed``, ``out``; how it runs: ``backend``, ``device``; ``planner`` (``"auto"``,
``"none"`` or a table). The library's option types, one table each (``config_sections.py``):
``optimizer`` (``AdamWConfig``), ``lr_schedule`` (``LRScheduleConfig``), ``compile``
(``CompileOptions``, with ``compile.recompute``, ``compile.schedule``, ``compile.schedule.overlap``,
``compile.build``) and ``run`` (``RunConfig``). Tables: ``data``
(``paths``, ``format``, ``text_field``, ``tokenizer``, ``context``, ``tokens_per_iteration``,
``long_documents``, ``seed``, ``window``; without ``paths``: synthetic sequences with the lengths of
a length file, ``lengths``, ``max_len``, ``length_scale``), ``eval`` (``paths``, ``interval``,
``batches``), ``checkpoint`` (``dir``: a folder of ``step-N`` checkpoints, ``interval``,
``resume``: continue from the newest, ``keep``: how many to keep, ``async``: write in the
background), ``export`` (``dir``), ``planner`` (``cost_table``, ``memory_gb``), ``metrics``
(``dir``, default ``<out>/metrics``; ``jsonl``, ``tensorboard``, ``console``: one line per
iteration; ``wandb``: the TensorBoard scalars to Weights & Biases; ``peak_tflops``: per rank, for MFU). ``"hgraph:stdlib"`` as ``data.paths`` /
``eval.paths`` / ``data.tokenizer`` names the embedded corpus (training / held-out files) and its
BPE. Input paths (model files, data, tokenizer, eval, cost table) are relative to the config file
(a model or tokenizer that is no file there and reads as a hub id, ``"gpt2"``, stays a hub id);
output directories (``out``, checkpoint, export) to the working directory.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hgraph.data.hub import is_hub_id
from hgraph.errors import InputError
from hgraph.program.options import CompileOptions
from hgraph.runtime.metrics import require_wandb
from hgraph.training.config_sections import TOP_SECTIONS, read_sections
from hgraph.training.configs import AdamWConfig, LRScheduleConfig, RunConfig

STDLIB = "hgraph:stdlib"  # data.paths / eval.paths / data.tokenizer: the embedded corpus and its BPE
TOP = {"model", "strategies", "world_size", "iterations", "seed", "data", "eval", "checkpoint", "export", "planner",
       "metrics", "out", "backend", "device", *(s.name for s in TOP_SECTIONS)}
CHOICES = {  # top-level keys with a fixed set of values (the first is the default)
    "backend": ("auto", "nccl", "gloo"),
    "device": ("auto", "cpu", "cuda"),
}
MOVED = {  # keys of the top level before the option tables -> where they are now
    "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "grad_clip": "optimizer.grad_clip",
    "warmup": "lr_schedule.warmup", "min_lr_ratio": "lr_schedule.min_lr_ratio",
    "compute_dtype": "compile.compute_dtype", "reduce_dtype": "compile.reduce_dtype",
    "recompute": "compile.recompute.mode", "pipeline_schedule": "compile.schedule.pipeline",
}
PLANNERS = ("auto", "none")  # planner = "auto": plan every iteration; "none": rotate the strategies
TABLES = {
    "data": {"paths", "format", "text_field", "tokenizer", "context", "tokens_per_iteration", "long_documents",
             "seed", "window", "lengths", "max_len", "length_scale"},
    "eval": {"paths", "interval", "batches"},
    "checkpoint": {"dir", "interval", "resume", "keep", "async"},
    "export": {"dir"},
    "planner": {"cost_table", "memory_gb"},
    "metrics": {"dir", "jsonl", "tensorboard", "console", "wandb", "peak_tflops"},
}


@dataclass(frozen=True)
class DataConfig:
    """Documents from local files (``hgraph.data``)."""

    paths: tuple[str, ...]
    tokenizer: str
    format: str = "text"
    text_field: str = "text"
    context: int = 512
    tokens_per_iteration: int = 4096
    long_documents: str = "split"
    seed: int = 0
    window: int = 256


@dataclass(frozen=True)
class TrainConfig:
    model: str
    strategies: tuple[str, ...]  # ("auto",): profile + propose
    world_size: int = 4
    iterations: int = 10
    optimizer: AdamWConfig = AdamWConfig(grad_clip=1.0)  # [optimizer]
    lr_schedule: LRScheduleConfig = LRScheduleConfig()  # [lr_schedule]
    compile: CompileOptions = CompileOptions()  # [compile] with its nested tables
    run: RunConfig = RunConfig()  # [run]
    seed: int = 0  # model initialisation (factories and HF configs)
    # synthetic sequences (no data.paths)
    lengths: str = "wikipedia"
    tokens_per_iteration: int = 2048
    max_len: int = 512
    length_scale: int = 8
    data: Optional[DataConfig] = None
    eval_paths: tuple[str, ...] = ()
    eval_interval: int = 0
    eval_batches: int = 4
    checkpoint_dir: Optional[str] = None
    checkpoint_interval: int = 0
    resume: bool = False
    checkpoint_keep: int = 2
    checkpoint_async: bool = True
    export_dir: Optional[str] = None
    planner: str = "auto"  # PLANNERS
    cost_table: Optional[str] = None  # a preset name or a JSON file; None: profile this machine (cached)
    memory_gb: Optional[float] = None  # the memory budget behind MaxLen of a profiled cost model
    out: str = "runs/train"
    backend: str = "auto"
    device: str = "auto"
    metrics_dir: Optional[str] = None  # None: <out>/metrics
    metrics_jsonl: bool = True
    metrics_tensorboard: bool = True
    metrics_console: bool = True
    metrics_wandb: bool = False
    peak_tflops: Optional[float] = None
    source: str = field(default="", compare=False)

    @property
    def auto(self) -> bool:
        return self.strategies == ("auto",)

    @property
    def context(self) -> int:
        """The longest sequence a batch may hold: ``data.context``, or ``data.max_len`` (synthetic)."""
        return self.data.context if self.data is not None else self.max_len


def check_choices(cfg: TrainConfig) -> TrainConfig:
    """``InputError`` naming the field for a value outside ``CHOICES`` or a combination that cannot
    run; ``cfg`` otherwise (also after command-line overrides)."""
    where = f"config {cfg.source}: " if cfg.source else ""
    for key, allowed in CHOICES.items():
        value = getattr(cfg, key)
        if value not in allowed:
            raise InputError(f"{where}{key}: {value!r}; expected one of {', '.join(map(repr, allowed))}")
    if cfg.planner not in PLANNERS:
        raise InputError(f"{where}planner: {cfg.planner!r}; expected \"auto\", \"none\" or a [planner] table")
    if (cfg.backend, cfg.device) in (("nccl", "cpu"), ("gloo", "cuda")):
        raise InputError(f"{where}backend = {cfg.backend!r} with device = {cfg.device!r}: NCCL runs on GPUs, gloo "
                         "here on CPUs; set device = \"auto\" (or backend = \"auto\")")
    if cfg.planner == "none" and (cfg.cost_table or cfg.memory_gb):
        raise InputError(f"{where}planner: \"none\" rotates the strategies; drop [planner] cost_table / memory_gb "
                         "or plan with planner = \"auto\"")
    return cfg


def _load(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"config {path}: no such file")
    text = p.read_text(encoding="utf-8")
    try:
        raw = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"config {path}: bad TOML ({exc})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"config {path}: bad JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise InputError(f"config {path}: expected an object of settings, got {type(raw).__name__}")
    return raw


class _Fields:
    """Typed reads from one table of the config, with errors naming ``table.key``."""

    def __init__(self, path: str, table: dict[str, Any], prefix: str = "") -> None:
        self.path, self.table, self.prefix = path, table, prefix

    def fail(self, key: str, message: str) -> InputError:
        return InputError(f"config {self.path}: {self.prefix}{key}: {message}")

    def get(self, key: str, kind: type, default: Any = None, minimum: Optional[float] = None) -> Any:
        if key not in self.table:
            return default
        value = self.table[key]
        if value is None and default is None:
            return None
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise self.fail(key, f"expected {kind.__name__}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise self.fail(key, f"{value}; expected a finite number")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"{value} is below the minimum {minimum:g}")
        return value

    def paths(self, key: str) -> tuple[str, ...]:
        value = self.table.get(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(key, f"expected a path or a list of paths, got {value!r}")
        base = Path(self.path).parent
        return tuple(v if v == STDLIB or os.path.isabs(os.path.expanduser(v)) else str(base / v) for v in value)

    def path_or_hub_id(self, key: str) -> str:
        """One path relative to the config file, or a hub id (``"gpt2"``) as written when no such file is there."""
        value = self.paths(key)[0]
        written = self.table[key] if isinstance(self.table[key], str) else self.table[key][0]
        return written if is_hub_id(written) and not os.path.exists(value) else value


def _cost_table(planner: _Fields) -> Optional[str]:
    """``planner.cost_table``: a preset name as is, a file relative to the config."""
    value = planner.get("cost_table", str)
    if value is None or "/" not in value and not value.endswith(".json"):
        return value
    return planner.paths("cost_table")[0]


def read_config(path: str) -> TrainConfig:
    """Parse and check a config file (JSON, or TOML when it ends in ``.toml``)."""
    raw = _load(path)
    moved = sorted(set(raw) & set(MOVED))
    if moved:
        raise InputError(f"config {path}: " + "; ".join(
            f"{k}: now {MOVED[k]} (the [{MOVED[k].rpartition('.')[0]}] table)" for k in moved) + "; see docs/config.md")
    if "schedule" in raw:
        raise InputError(f"config {path}: schedule: now the [compile.schedule.overlap] table (present: overlap on); "
                         "see docs/config.md")
    if "lr_schedule" in raw and isinstance(raw["lr_schedule"], str):
        raise InputError(f"config {path}: lr_schedule: now a table, lr_schedule.kind = {raw['lr_schedule']!r}; "
                         "see docs/config.md")
    unknown = set(raw) - TOP
    if unknown:
        raise InputError(f"config {path}: unknown keys {sorted(unknown)}; known: {sorted(TOP)}")
    for key in ("model", "strategies"):
        if key not in raw:
            raise InputError(f"config {path}: missing required key {key!r}")
    top = _Fields(path, raw)
    tables = {}
    planner = "auto"
    if isinstance(raw.get("planner"), str):  # planner = "none" | "auto" instead of a [planner] table
        planner = raw.pop("planner")
    for name, known in TABLES.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise top.fail(name, f"expected a table of settings, got {table!r}")
        extra = set(table) - known
        if extra:
            raise top.fail(name, f"unknown keys {sorted(extra)}; known: {sorted(known)}")
        tables[name] = _Fields(path, table, f"{name}.")
    strategies = raw["strategies"]
    if strategies == "auto":
        strategies = ["auto"]
    if not isinstance(strategies, list) or not strategies or not all(isinstance(s, str) for s in strategies):
        raise top.fail("strategies", 'expected "auto" or a non-empty list like ["tp2", "2x tp1"]')
    d, e, c, m = tables["data"], tables["eval"], tables["checkpoint"], tables["metrics"]
    data = None
    if "paths" in d.table:
        if "tokenizer" not in d.table:
            raise d.fail("tokenizer", "missing: a tokenizers JSON file, an HF tokenizer directory or hub id")
        data = DataConfig(
            paths=d.paths("paths"), tokenizer=d.path_or_hub_id("tokenizer"), format=d.get("format", str, "text"),
            text_field=d.get("text_field", str, "text"), context=d.get("context", int, 512, 2),
            tokens_per_iteration=d.get("tokens_per_iteration", int, 4096, 2),
            long_documents=d.get("long_documents", str, "split"), seed=d.get("seed", int, 0),
            window=d.get("window", int, 256, 1),
        )
        if data.tokens_per_iteration < data.context:
            raise d.fail("tokens_per_iteration", f"{data.tokens_per_iteration} is below data.context={data.context}")
    elif e.table.get("paths"):
        raise e.fail("paths", "held-out evaluation needs data.paths and data.tokenizer (real documents)")
    checkpoint_dir = c.get("dir", str)
    model = top.get("model", str)
    relative = Path(path).parent / os.path.expanduser(model)
    if not os.path.isabs(os.path.expanduser(model)) and relative.exists():
        model = str(relative)  # an HF config file or checkpoint directory next to the config
    cfg = TrainConfig(
        model=model,
        strategies=tuple(strategies),
        world_size=top.get("world_size", int, 4, 1),
        iterations=top.get("iterations", int, 10, 1),
        **read_sections(path, raw),
        seed=top.get("seed", int, 0),
        lengths=d.get("lengths", str, "wikipedia"),
        tokens_per_iteration=d.get("tokens_per_iteration", int, 2048, 2),
        max_len=d.get("max_len", int, 512, 2),
        length_scale=d.get("length_scale", int, 8, 1),
        data=data,
        eval_paths=e.paths("paths"),
        eval_interval=e.get("interval", int, 0, 0),
        eval_batches=e.get("batches", int, 4, 1),
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval=c.get("interval", int, 0, 0),
        resume=c.get("resume", bool, False),
        checkpoint_keep=c.get("keep", int, 2, 0),
        checkpoint_async=c.get("async", bool, True),
        export_dir=tables["export"].get("dir", str),
        planner=planner,
        cost_table=_cost_table(tables["planner"]),
        memory_gb=tables["planner"].get("memory_gb", float, None, 0),
        out=top.get("out", str, "runs/train"),
        metrics_dir=m.get("dir", str),
        metrics_jsonl=m.get("jsonl", bool, True),
        metrics_tensorboard=m.get("tensorboard", bool, True),
        metrics_console=m.get("console", bool, True),
        metrics_wandb=m.get("wandb", bool, False),
        peak_tflops=m.get("peak_tflops", float, None, 0),
        source=path,
        **{key: top.get(key, str, allowed[0]) for key, allowed in CHOICES.items()},
    )
    check_choices(cfg)
    if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
        raise m.fail("peak_tflops", f"{cfg.peak_tflops}; give the per-rank peak in TFLOP/s (> 0)")
    if cfg.metrics_wandb:
        require_wandb(f"config {path}: metrics.wandb = true")
    if (cfg.checkpoint_interval or cfg.resume) and cfg.checkpoint_dir is None:
        raise InputError(f"config {path}: checkpoint.dir: missing (checkpoint.interval/resume need a directory)")
    if cfg.auto and cfg.data is None:
        raise top.fail("strategies", '"auto" proposes strategies from the lengths of real documents; set data.paths')
    return cfg
