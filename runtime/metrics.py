"""Per-iteration metrics of a run: a JSONL stream, TensorBoard event files, W&B and one console line.

``Trainer(..., metrics=MetricsConfig("runs/x/metrics", peak_tflops=...))``: after every iteration
rank 0 writes one record with

* ``loss``, ``grad_norm`` (before clipping), ``lr`` (the rate this step used);
* ``tokens``, ``seconds`` (the whole step, planning included), ``tokens_per_s``;
* ``tflops`` (model FLOPs of the batch, ``hgraph.core.flops``, over the step time, all ranks together),
  ``mfu`` (``tflops / (peak_tflops * world_size)``; ``None`` without a declared ``peak_tflops``);
* ``peak_memory_mb``: per rank, the peak during this iteration (resident set size on CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA);
* ``exposed_comm_ms``: per rank, communication time not hidden behind compute
  (``hgraph.runtime.timeline.exposed_communication``);
* ``strategy`` (and its index), ``predicted_ms`` (the planner's, ``None`` without one), ``measured_ms``.

Every time is the device's (``hgraph.runtime.clock``: CUDA events on CUDA, so ``seconds``,
``measured_ms`` and ``exposed_comm_ms`` end when the work has finished, the optimizer's included);
``time`` is the record's wall-clock second on that clock's scale.

Files in ``dir``: ``metrics.jsonl`` (one JSON object per line, flushed per iteration) and
``tensorboard/`` (``tensorboard --logdir DIR/tensorboard``; written with ``torch.utils.tensorboard``,
i.e. the ``tensorboard`` package's event writer, whose thread writes the queued events to the file
every ``TENSORBOARD_FLUSH_SECS`` and on ``close``: steps do not wait for the disk). A run resumed at
iteration ``k`` drops the JSONL records from ``k`` on (the iterations it trains again) and starts a
new event file that tells TensorBoard to purge the old steps ``>= k``. ``wandb=True`` logs the
same scalars (``scalars``) to a Weights & Biases run (project ``$WANDB_PROJECT``, default
``hgraph``; its files in ``$WANDB_DIR``, default ``dir``; ``WANDB_MODE=offline`` keeps it local);
it needs the ``wandb`` package (``pip install wandb``). The per-rank values reach rank 0 in the
all-reduce that ends every iteration (no extra collective). ``console=True`` logs one line per
iteration at INFO on the ``hgraph.runtime.metrics`` logger (``hgraph train`` shows it on stdout).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from hgraph.errors import InputError
from hgraph.core import atomic_files
from hgraph.core.flops import ModelFlops
from hgraph.runtime.clock import wall_seconds

JSONL = "metrics.jsonl"
TENSORBOARD = "tensorboard"
MB = 1 << 20
TENSORBOARD_FLUSH_SECS = 5  # the event writer's flush interval; close() writes the rest
WANDB_PROJECT = "hgraph"  # when $WANDB_PROJECT is not set

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricsConfig:
    """Where and how rank 0 writes the per-iteration metrics (see the module docstring)."""

    dir: str
    jsonl: bool = True
    tensorboard: bool = True
    console: bool = False
    peak_tflops: Optional[float] = None  # per rank (device), as declared by its maker
    wandb: bool = False

    def __post_init__(self) -> None:
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise InputError(f"MetricsConfig peak_tflops={self.peak_tflops!r}; give the per-rank peak in TFLOP/s")
        if self.wandb:
            require_wandb("MetricsConfig wandb=True")


def require_wandb(where: str) -> None:
    """Raise ``InputError`` naming ``where`` (the key that asked for W&B) when ``wandb`` is not installed."""
    if importlib.util.find_spec("wandb") is None:
        raise InputError(f"{where} logs to Weights & Biases, but the wandb package is not installed; "
                         "pip install wandb (or hgraph[wandb]), or set it to false")


# ----------------------------------------------------------------------------- memory
def _proc_status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak: CUDA's statistics, or Linux's resident high-water mark (``clear_refs``).
    Returns whether a reset happened (else peaks run from the start of the process)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory since the last ``reset_peak_memory``: max allocated on CUDA, peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kb = _proc_status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return int(kb) * 1024


# ----------------------------------------------------------------------------- records
def _fmt(value: Optional[float], spec: str, none: str = "-") -> str:
    return none if value is None or not math.isfinite(value) else format(value, spec)


def console_line(r: dict[str, Any], iterations: Optional[int] = None) -> str:
    """One line of progress for iteration record ``r`` (a ``MetricsWriter.record`` result)."""
    total = f"/{iterations}" if iterations else ""
    mfu = f"  MFU {r['mfu']:.2%}" if r.get("mfu") is not None else ""
    memory = max(r["peak_memory_mb"]) if r.get("peak_memory_mb") else None
    exposed = max(r["exposed_comm_ms"]) if r.get("exposed_comm_ms") else None
    return (f"iter {r['iteration'] + 1}{total}  loss {r['loss']:.4f}  gnorm {_fmt(r['grad_norm'], '.3f')}  "
            f"lr {_fmt(r['lr'], '.2e')}  {r['tokens_per_s']:.0f} tok/s  {r['tflops']:.4f} TFLOPs{mfu}  "
            f"mem {_fmt(memory, '.0f')} MB  exposed {_fmt(exposed, '.1f')} ms  {r['strategy']}  "
            f"pred {_fmt(r['predicted_ms'], '.1f')} / meas {r['measured_ms']:.1f} ms")


class MetricsWriter:
    """Rank 0's writer: ``record`` turns one ``Trainer`` history record into the metrics and writes them."""

    def __init__(self, config: MetricsConfig, world_size: int, flops: Optional[ModelFlops],
                 iterations: Optional[int] = None) -> None:
        self.config, self.world_size, self.flops, self.iterations = config, world_size, flops, iterations
        self.directory = Path(config.dir)
        self._jsonl: Any = None
        self._tb: Any = None
        self._wandb: Any = None

    def start(self, iteration: int) -> None:
        """Open the files for a run that continues at ``iteration`` (0: a new run)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.config.jsonl:
            path = self.directory / JSONL
            if path.exists():
                _drop_from(path, iteration)
            self._jsonl = open(path, "a", encoding="utf-8")
        if self.config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops older files' events at steps >= iteration (a resumed run)
            self._tb = SummaryWriter(str(self.directory / TENSORBOARD), purge_step=iteration or None,
                                     max_queue=1000, flush_secs=TENSORBOARD_FLUSH_SECS)
        if self.config.wandb:
            import wandb

            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
                                     dir=os.environ.get("WANDB_DIR", str(self.directory)),
                                     config={"world_size": self.world_size, "iterations": self.iterations,
                                             "first_iteration": iteration})

    def record(self, h: dict[str, Any]) -> dict[str, Any]:
        """The metrics of history record ``h`` (see ``Trainer._train_on``), written to every sink."""
        if self._jsonl is None and self._tb is None and self._wandb is None and (
                self.config.jsonl or self.config.tensorboard or self.config.wandb):
            self.start(h["iteration"])
        seconds = h["seconds"]
        flops = self.flops.batch(h["lengths"]) if self.flops is not None else None
        tflops = flops / seconds / 1e12 if flops is not None and seconds > 0 else None
        peak = self.config.peak_tflops
        r = {
            "iteration": h["iteration"], "time": wall_seconds(), "loss": h["loss"], "grad_norm": h["grad_norm"],
            "lr": h.get("lr"), "tokens": sum(h["lengths"]), "sequences": len(h["lengths"]),
            "longest": max(h["lengths"]), "seconds": seconds, "tokens_per_s": sum(h["lengths"]) / seconds,
            "model_flops": flops, "tflops": tflops,
            "mfu": tflops / (peak * self.world_size) if tflops is not None and peak else None,
            "peak_memory_mb": [b / MB for b in h["peak_memory_bytes"]] if h.get("peak_memory_bytes") else None,
            "exposed_comm_ms": h.get("exposed_comm_ms"),
            "strategy": h["strategy"], "strategy_index": h["strategy_index"],
            "predicted_ms": h["predicted_ms"], "measured_ms": h["measured_ms"],
        }
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(r) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for tag, value in scalars(r).items():
                self._tb.add_scalar(tag, value, r["iteration"], walltime=r["time"])
            self._tb.add_text("strategy", r["strategy"], r["iteration"], walltime=r["time"])
        if self._wandb is not None:
            self._wandb.log(scalars(r), step=r["iteration"])
        if self.config.console:
            log.info(console_line(r, self.iterations))
        return r

    def close(self) -> None:
        """Write out and close the files (the TensorBoard events still queued included)."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def scalars(r: dict[str, Any]) -> dict[str, float]:
    """The scalars of metrics record ``r`` by tag, as TensorBoard and W&B get them (``None`` values left out)."""
    out = {}
    for tag, key in (("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("train/lr", "lr"),
                     ("throughput/tokens_per_s", "tokens_per_s"), ("throughput/tflops", "tflops"),
                     ("throughput/mfu", "mfu"), ("time/step_s", "seconds"), ("time/measured_ms", "measured_ms"),
                     ("time/predicted_ms", "predicted_ms"), ("strategy/index", "strategy_index"),
                     ("batch/tokens", "tokens"), ("batch/longest", "longest")):
        if r[key] is not None:
            out[tag] = r[key]
    for name, values in (("memory/peak_mb", r["peak_memory_mb"]), ("comm/exposed_ms", r["exposed_comm_ms"])):
        if values:
            out[f"{name}_max"] = max(values)
            for rank, v in enumerate(values):
                out[f"{name}/rank{rank}"] = v
    return out


def _drop_from(path: Path, iteration: int) -> None:
    """Keep only the records of iterations before ``iteration`` (and no torn last line)."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["iteration"] < iteration:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a kill mid-write
    atomic_files.write_text(path, "".join(k + "\n" for k in kept))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (or of the ``metrics.jsonl`` in a directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / JSONL
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def per_rank(values: Sequence[float], missing: float = -1.0) -> Optional[list[float]]:
    """Per-rank values of the iteration all-reduce, ``None`` where no rank measured (``missing``)."""
    return None if all(v == missing for v in values) else [float(v) for v in values]
