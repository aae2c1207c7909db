"""The ``hgraph train`` config: ``TrainConfig`` and its tables, the one definition of every key, its
default and its meaning (the string under each field). A TOML or JSON file is read into it
(``read_config``, through ``config_sections.read_table``); the ``--section.key`` flags
(``hgraph.cli.config_flags``), the run folder's ``config.toml`` (``config_toml``) and docs/config.md
(``config_reference``) are derived from it. Input paths are relative to the config file (a model or
tokenizer that is no file there and reads as a hub id stays a hub id); output directories to the
working directory.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from hgraph.data.hub import is_hub_id
from hgraph.errors import InputError
from hgraph.program.options import CompileOptions
from hgraph.runtime.metrics import require_wandb
from hgraph.training.config_sections import (
    ConfigKey, all_keys, config_tables, get_dotted, read_table, set_dotted, setting,
)
from hgraph.training.configs import AdamWConfig, LRScheduleConfig, RunConfig

STDLIB = "hgraph:stdlib"  # data.paths / eval.paths / data.tokenizer: the embedded corpus and its BPE
MOVED = {  # keys of the top level before the option tables -> where they are now
    "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "grad_clip": "optimizer.grad_clip",
    "warmup": "lr_schedule.warmup", "min_lr_ratio": "lr_schedule.min_lr_ratio",
    "compute_dtype": "compile.compute_dtype", "reduce_dtype": "compile.reduce_dtype",
    "recompute": "compile.recompute.mode", "pipeline_schedule": "compile.schedule.pipeline",
}
DOCUMENT_TOKENS, SYNTHETIC_TOKENS = 4096, 2048  # data.tokens_per_iteration's default with / without paths


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The ``[data]`` table: documents or synthetic sequences."""

    paths: tuple[str, ...] = setting((), resolve="files")
    """Files, directories or globs; ``"hgraph:stdlib"`` is the embedded corpus (this interpreter's
    standard library); none: synthetic sequences."""
    tokenizer: Optional[str] = setting(None, resolve="file_or_name")
    """With ``paths`` (required): a ``tokenizers`` JSON file or an ``AutoTokenizer`` directory, local or
    a hub id in the local HF cache (as ``model``); ``"hgraph:stdlib"`` is a 512-token BPE of the
    standard library, trained locally once."""
    format: str = setting("text", choices=("text", "lines", "jsonl", "parquet"))
    """``"text"`` (a file per document), ``"lines"``, ``"jsonl"`` or ``"parquet"``."""
    text_field: str = "text"
    """The field holding the text in JSON Lines and Parquet."""
    context: int = setting(512, minimum=2)
    """Longest sequence: longer documents are split into pieces (or cut, ``long_documents``)."""
    tokens_per_iteration: Optional[int] = setting(None, minimum=2)
    """Tokens per global batch (none: 4096 with ``paths``, 2048 for synthetic sequences)."""
    long_documents: str = setting("split", choices=("split", "cut"))
    """``"split"`` documents longer than ``context`` into pieces, or ``"cut"`` them."""
    seed: int = 0
    """Shuffle seed."""
    window: int = setting(256, minimum=1)
    """Documents shuffled together (a window at a time)."""
    lengths: str = setting("wikipedia", resolve="file_or_name")
    """Synthetic sequences: a length file (one integer per line) or ``"wikipedia"``, a bundled sample of
    20,000 tokenized Wikipedia document lengths."""
    max_len: int = setting(512, minimum=2)
    """Synthetic sequences: the longest (longer lengths are truncated)."""
    length_scale: int = setting(8, minimum=1)
    """Synthetic sequences: divide every length by this (small models on CPU)."""

    def __post_init__(self) -> None:
        if self.paths and self.tokenizer is None:
            raise InputError("data.tokenizer: missing: a tokenizers JSON file, an HF tokenizer directory or hub id")
        if self.paths and self.batch_tokens < self.context:
            raise InputError(f"data.tokens_per_iteration: {self.batch_tokens} is below data.context={self.context}")

    @property
    def batch_tokens(self) -> int:
        """Tokens per global batch: ``tokens_per_iteration`` or its default."""
        if self.tokens_per_iteration is not None:
            return self.tokens_per_iteration
        return DOCUMENT_TOKENS if self.paths else SYNTHETIC_TOKENS


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The ``[eval]`` table: held-out loss."""

    paths: tuple[str, ...] = setting((), resolve="files")
    """Held-out documents (needs ``data.paths``); ``"hgraph:stdlib"``: the corpus's held-out files."""
    interval: int = setting(0, minimum=0)
    """Held-out loss every this many iterations; 0: never."""
    batches: int = setting(4, minimum=1)
    """Held-out batches per evaluation."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The ``[checkpoint]`` table."""

    dir: Optional[str] = None
    """Where ``step-N`` checkpoints go (needed by ``interval`` and ``resume``)."""
    interval: int = setting(0, minimum=0)
    """Save every this many iterations and at the end; 0: never."""
    resume: bool = False
    """Continue from the newest complete ``step-N`` checkpoint in ``dir`` if there is one (the same
    batches as without a stop; also after ``torchrun --max-restarts`` restarted the job)."""
    keep: int = setting(2, minimum=0)
    """How many ``step-N`` checkpoints to keep (the oldest beyond it deleted after a new one is
    complete); 0: keep all."""
    async_: bool = True
    """Write in the background (shards copied to host, then written while training goes on; one write
    in flight)."""


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """The ``[export]`` table."""

    dir: Optional[str] = None
    """Where: HF ``save_pretrained`` format for HF models, else ``model.safetensors``; none: no export."""


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """The ``[planner]`` table (``planner = "none"`` is short for ``[planner] mode = "none"``)."""

    mode: str = setting("auto", choices=("auto", "none"))
    """``"auto"``: plan every iteration with ``cost_table``, else with ``T(l)`` profiled on this
    machine's local ranks once and cached in ``$HGRAPH_CACHE`` (under torchrun: on the job's own
    ranks, [distributed.md](distributed.md)); ``"none"``: iteration ``i`` runs strategy ``i mod N``,
    said on the console."""
    cost_table: Optional[str] = setting(None, resolve="file_or_name")
    """The cost model: a preset (``"llama7b_a800"``, ``"llama13b_a800"``, ``"llama32b_a800"``, from
    published A800 tables) or a cost table JSON file (``hgraph profile --out``); none: profile this
    machine (under torchrun: the job's own ranks)."""
    memory_gb: Optional[float] = setting(None, minimum=0)
    """Memory budget (GB per rank) behind MaxLen of a profiled cost model (none: 0.25); a sequence
    longer than every strategy's MaxLen cannot run."""


@dataclass(frozen=True, kw_only=True)
class MetricsSinks:
    """The ``[metrics]`` table: what becomes the run's ``hgraph.runtime.metrics.MetricsConfig``."""

    dir: Optional[str] = None
    """Where metrics go; none: ``<out>/metrics``."""
    jsonl: bool = True
    """One record per iteration in ``metrics.jsonl`` (loss, grad norm, lr, tokens/s, TFLOPs/MFU, peak
    memory and exposed communication per rank, strategy, predicted / measured time)."""
    tensorboard: bool = True
    """The same figures as TensorBoard event files in ``<dir>/tensorboard``."""
    console: bool = True
    """One console line per iteration on rank 0 (log records go to ``out/logs/rank<r>.log``)."""
    wandb: bool = False
    """The TensorBoard scalars to a Weights & Biases run too (project ``$WANDB_PROJECT``, default
    ``hgraph``; files in ``$WANDB_DIR``, default ``dir``; ``WANDB_MODE=offline`` keeps it local); needs
    ``pip install wandb``, refused without it."""
    peak_tflops: Optional[float] = None
    """The per-rank peak TFLOP/s the maker states, for MFU; none: no MFU."""

    def __post_init__(self) -> None:
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise InputError(f"metrics.peak_tflops: {self.peak_tflops}; give the per-rank peak in TFLOP/s (> 0)")
        if self.wandb:
            require_wandb("metrics.wandb = true")


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``hgraph train`` runs: the model, its strategies and the tables below."""

    model: str = field(metadata={"resolve": "file_or_name"})
    """``"module:factory"`` (a function returning the model), an HF ``config.json`` (random init with
    ``seed``), or an HF checkpoint directory (``from_pretrained``): a local one, or a hub id
    (``"gpt2"``, ``"org/name"``) in the local HF cache (never downloaded: ``hf download ID``)."""
    strategies: tuple[str, ...]
    """The strategies to compile (``["tp2,pp2 + 2x tp1", "4x tp1"]``: pipelines joined by ``+``,
    ``Nx`` repeats, degrees ``tp``, ``pp``, ``cp``, ``vpp``; each covers ``world_size`` ranks), or
    ``"auto"``: profile this machine and propose strategies from the data's lengths (needs
    ``data.paths``; not under torchrun)."""
    world_size: int = setting(4, minimum=1)
    """Local ranks to start; under torchrun ``WORLD_SIZE`` decides."""
    iterations: int = setting(10, minimum=1)
    """Training iterations (the run stops earlier when the data are over)."""
    seed: int = 0
    """Model initialisation (factories and HF configs) and synthetic batches."""
    out: str = "runs/train"
    """Run folder: ``config.toml`` (this config, resolved), ``history.json``, ``eval.json``,
    ``summary.json``, ``loss.png``."""
    backend: str = setting("auto", choices=("auto", "nccl", "gloo"))
    """``"auto"``: NCCL when CUDA is available with a GPU per local rank, else gloo."""
    device: str = setting("auto", choices=("auto", "cpu", "cuda"))
    """``"auto"`` follows the backend (NCCL: each rank's GPU; gloo: CPU); ``"cuda"`` asks for NCCL,
    ``"cpu"`` for gloo."""
    data: DataConfig = DataConfig()
    """Training data: documents from local files (with ``paths``; nothing is downloaded), else learnable
    synthetic sequences with lengths drawn from a length file (``lengths``, ``max_len``, ``length_scale``)."""
    eval: EvalConfig = EvalConfig()
    """Held-out loss (forward only) on documents of their own."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints: the shards, the data position and the planner state (docs/long_runs.md)."""
    export: ExportConfig = ExportConfig()
    """The trained model, written at the end."""
    planner: PlannerConfig = PlannerConfig()
    """How each iteration's strategy, dispatch and packing are chosen."""
    metrics: MetricsSinks = MetricsSinks()
    """Per-iteration metrics rank 0 writes (``hgraph.runtime.metrics``)."""
    optimizer: AdamWConfig = AdamWConfig(grad_clip=1.0)
    """The sharded AdamW (``hgraph.AdamWConfig``; ``hgraph train`` clips at 1.0)."""
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    """The learning-rate schedule (``LRScheduleConfig``, handed to the optimizer as its ``lr_scheduler``)."""
    compile: CompileOptions = CompileOptions()
    """How the model is compiled (``hgraph.CompileOptions``)."""
    run: RunConfig = RunConfig()
    """How the ``Trainer`` runs (``hgraph.RunConfig``; device, metrics and weights come from the keys above)."""
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f"config {self.source}: " if self.source else ""
        object.__setattr__(self, "strategies", tuple(self.strategies))
        if not self.strategies:
            raise InputError(f'{where}strategies: expected "auto" or a non-empty list like ["tp2", "2x tp1"]')
        if (self.backend, self.device) in (("nccl", "cpu"), ("gloo", "cuda")):
            raise InputError(f"{where}backend = {self.backend!r} with device = {self.device!r}: NCCL runs on GPUs, "
                             "gloo here on CPUs; set device = \"auto\" (or backend = \"auto\")")
        if self.planner.mode == "none" and (self.planner.cost_table or self.planner.memory_gb):
            raise InputError(f"{where}planner: \"none\" rotates the strategies; drop [planner] cost_table / "
                             "memory_gb or plan with planner = \"auto\"")
        if (self.checkpoint.interval or self.checkpoint.resume) and self.checkpoint.dir is None:
            raise InputError(f"{where}checkpoint.dir: missing (checkpoint.interval/resume need a directory)")
        if self.eval.paths and not self.data.paths:
            raise InputError(f"{where}eval.paths: held-out evaluation needs data.paths and data.tokenizer "
                             "(real documents)")
        if self.auto and not self.data.paths:
            raise InputError(f'{where}strategies: "auto" proposes strategies from the lengths of real documents; '
                             "set data.paths")

    @property
    def auto(self) -> bool:
        return self.strategies == ("auto",)

    @property
    def documents(self) -> bool:
        """Whether the run trains on documents (``data.paths``), not synthetic sequences."""
        return bool(self.data.paths)

    @property
    def context(self) -> int:
        """The longest sequence a batch may hold: ``data.context``, or ``data.max_len`` (synthetic)."""
        return self.data.context if self.documents else self.data.max_len


def train_keys() -> list[ConfigKey]:
    """Every key of the config, table by table."""
    return all_keys(config_tables(TrainConfig))


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


def _refuse_moved(path: str, raw: dict[str, Any]) -> None:
    """Keys of an older config format: where they are now."""
    moved = sorted(set(raw) & set(MOVED))
    if moved:
        raise InputError(f"config {path}: " + "; ".join(
            f"{k}: now {MOVED[k]} (the [{MOVED[k].rpartition('.')[0]}] table)" for k in moved) + "; see docs/config.md")
    if "schedule" in raw:
        raise InputError(f"config {path}: schedule: now the [compile.schedule.overlap] table (present: overlap on); "
                         "see docs/config.md")
    if isinstance(raw.get("lr_schedule"), str):
        raise InputError(f"config {path}: lr_schedule: now a table, lr_schedule.kind = {raw['lr_schedule']!r}; "
                         "see docs/config.md")


def resolve_input(key: ConfigKey, value: str, base: Path) -> str:
    """An input path of ``key`` relative to ``base`` (the config's folder, or the working directory
    for a flag); a name (hub id, preset, ``module:factory``, ``"wikipedia"``) as written."""
    expanded = os.path.expanduser(value)
    if value == STDLIB or os.path.isabs(expanded):
        return value
    there = base / expanded
    if key.resolve == "files" or there.exists():
        return str(there)
    if is_hub_id(value) or "/" not in value and not value.endswith(".json"):
        return value
    return str(there)


def _resolved(key: ConfigKey, value: Any, base: Path) -> Any:
    """``value`` of ``key`` with its input paths resolved (``resolve_input``); other values as they are."""
    if key.resolve and isinstance(value, str):
        return resolve_input(key, value, base)
    if key.resolve and isinstance(value, (list, tuple)):
        return [resolve_input(key, v, base) if isinstance(v, str) else v for v in value]
    return value


def _resolve_inputs(values: dict[str, Any], base: Path) -> None:
    """Every input path in the nested ``values``, resolved in place."""
    for key in train_keys():
        value = get_dotted(values, key.name)
        if key.resolve and value is not None:
            set_dotted(values, key.name, _resolved(key, value, base))


def read_config(path: str, overrides: Optional[Mapping[str, Any]] = None) -> TrainConfig:
    """Parse and check a config file (JSON, or TOML when it ends in ``.toml``); ``overrides`` (dotted
    key -> value, the command line's) replace its keys, their paths relative to the working directory."""
    raw = _load(path)
    _refuse_moved(path, raw)
    if isinstance(raw.get("planner"), str):  # planner = "none" | "auto": short for [planner] mode
        raw["planner"] = {"mode": raw["planner"]}
    _resolve_inputs(raw, Path(path).parent)
    keys = {k.name: k for k in train_keys()}
    for name, on in (overrides or {}).items():  # a switch table: on keeps (or makes) it, off drops it
        if name not in keys:
            _switch(raw, name, on)
    for name, value in (overrides or {}).items():
        if name in keys:
            set_dotted(raw, name, _resolved(keys[name], value, Path.cwd()))
    cfg = read_table(path, raw, config_tables(TrainConfig))
    return replace(cfg, source=path)


def _switch(raw: dict[str, Any], name: str, on: bool) -> None:
    parent, _, last = name.rpartition(".")
    table = get_dotted(raw, parent) if parent else raw
    if on and not isinstance(get_dotted(raw, name), dict):
        set_dotted(raw, name, {})
    elif not on and isinstance(table, dict):
        table.pop(last, None)


__all__ = ["STDLIB", "CheckpointConfig", "DataConfig", "EvalConfig", "ExportConfig", "MetricsSinks", "PlannerConfig",
           "TrainConfig", "read_config", "resolve_input", "train_keys"]
