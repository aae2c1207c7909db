"""MaxLen: the most tokens one micro-batch may hold on a pipeline without running out of memory.

The memory model is the regression of DESIGN.md A5, with the constants of a cost table's
``memory_regression`` section (bytes throughout)::

    MaxLen(tp, pp, cp) = align128( (mem - safe_bound - gap(tp*cp) - states) / (L * (H/tp) * A_tp / cp) )

    states = (1 - alpha) * S_stage0 / tp  +  alpha * S_model / world_size
    S_layer  = B * H**2                  model-state bytes of one layer (16 B/param: bf16 weight and
                                         gradient, fp32 master, Adam m and v)
    S_vocab  = 16 * V * H                one vocabulary matrix (embedding or LM head)
    S_stage0 = ceil(L/pp) * S_layer + S_vocab * (2 if pp == 1 else 1)
    S_model  = L * S_layer + 2 * S_vocab

* ``A_tp``: activation bytes per token, per ``H/tp`` hidden units, per layer (one value per tp);
  activations are counted for all ``L`` layers whatever ``pp`` is, because under 1F1B stage 0 keeps
  ``pp`` micro-batches of ``L/pp`` layers in flight. Context parallelism splits the tokens ``cp`` ways.
* ``alpha``: the fraction of model-state bytes (12 of 16: fp32 master and Adam) that lives in the
  optimizer's homogeneous ZeRO layout, sharded over all ``world_size`` ranks (DESIGN.md A3); the rest
  (bf16 weight and gradient) is sharded only by the pipeline's own TP and PP. Stage 0 (embedding, and
  the LM head too when pp = 1) is the stage that bounds MaxLen.
* ``gap``: CUDA/NCCL context bytes keyed by the GPUs of one stage mesh: ``gpu1``, ``gpu2``, ``gpu4``...
  (the smallest key >= tp*cp), ``node`` beyond the largest one. ``mem`` is ``gpu_memory_bound``.

Activation recomputation (``hgraph.compile(recompute=...)``) changes what a layer keeps per token
between its forward and its backward; with ``a = (H/tp) * A_tp`` one layer's bytes without
recomputation and ``n`` of the ``L`` layers recomputed::

    activations = (L - n) * a + n * kept + (a - kept if n else 0)        (divided by cp)
    kept(full)      = itemsize * H * (1 + 2 * [tp > 1])   the layer input, plus the two all-reduced
                                                          outputs (attention, MLP) a TP layer keeps so
                                                          that its collectives are not reissued (at
                                                          most a; only the input with
                                                          keep_communication=False)
    kept(selective) = SELECTIVE_KEPT * a                  matmul, attention and collective outputs

The last term is the working set of the one layer being recomputed in backward. ``SELECTIVE_KEPT``
(0.53) was measured with ``benchmarks/recompute_bench.py`` (Llama, ffn = 4 H, fp32 on CPU); GPU runs
of ``benchmarks/gpu_bench.py`` check all three against measured peaks.

When the world size is unknown the ZeRO share is left out (the limit of a large world); pass the
planner's GPU count for the exact value: the difference is ``alpha * S_model / world_size`` bytes.
"""

from __future__ import annotations

import math
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hgraph.errors import CostModelError

ALIGN = 128
RECOMPUTE_MODES = ("none", "selective", "full")
SELECTIVE_KEPT = 0.53


@dataclass(frozen=True)
class MemoryRegression:
    """The MaxLen constants of one model on one kind of device (see the module docstring)."""

    activation: tuple[tuple[int, float], ...]  # (tp, A_tp), bytes per token per H/tp per layer
    bytes_per_layer_h2: float  # B
    alpha: float
    gap: tuple[tuple[str, float], ...]  # ("gpu1", bytes), ..., ("node", bytes)
    safe_bound: float
    gpu_memory: float
    hidden: int
    layers: int
    vocab: int
    itemsize: int = 2  # bytes of one activation element (bf16 in the A800 tables)

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise CostModelError(f"memory_regression.alpha={self.alpha!r}; it is a fraction in [0, 1]")
        for key, _ in self.gap:
            if key != "node" and not re.fullmatch(r"gpu[1-9]\d*", key):
                raise CostModelError(
                    f"memory_regression.gap key {key!r}; use 'gpuN' (GPUs of one stage) or 'node'"
                )
        if not self.activation:
            raise CostModelError("memory_regression.A is empty; it needs one entry 'tpN' per TP degree")
        for name in ("hidden", "layers", "vocab"):
            if getattr(self, name) < 1:
                raise CostModelError(f"model_config {name}={getattr(self, name)!r}; it must be >= 1")

    def activation_bytes(self, tp: int) -> float:
        """``A_tp``; a TP degree the regression was not fitted for is an error."""
        for t, value in self.activation:
            if t == tp:
                return value
        known = ", ".join(f"tp{t}" for t, _ in self.activation)
        raise CostModelError(f"memory_regression.A has no entry for tp{tp}; known: {known}")

    def gap_bytes(self, stage_gpus: int) -> float:
        """Context bytes for a stage mesh of ``stage_gpus`` GPUs: smallest ``gpuN`` >= it, else ``node``."""
        sized = sorted((int(k[3:]), v) for k, v in self.gap if k != "node")
        for n, value in sized:
            if n >= stage_gpus:
                return value
        for k, value in self.gap:
            if k == "node":
                return value
        known = ", ".join(k for k, _ in self.gap)
        raise CostModelError(
            f"memory_regression.gap has no entry for a stage of {stage_gpus} GPUs (known: {known}); "
            "add 'node'"
        )

    def model_state_bytes(self, tp: int, pp: int, world_size: int | None = None) -> float:
        """Model-state bytes on one GPU of stage 0 (the ZeRO share only when ``world_size`` is given)."""
        layer = self.bytes_per_layer_h2 * self.hidden**2
        vocab = 16.0 * self.vocab * self.hidden
        stage0 = math.ceil(self.layers / pp) * layer + vocab * (2 if pp == 1 else 1)
        states = (1.0 - self.alpha) * stage0 / tp
        if world_size is not None:
            states += self.alpha * (self.layers * layer + 2 * vocab) / world_size
        return states

    def kept_bytes(self, tp: int, recompute: str, keep_communication: bool = True) -> float:
        """Bytes per token one layer keeps for its backward under ``recompute`` (module docstring);
        ``keep_communication=False``: full recomputation reissues the collectives instead."""
        layer = (self.hidden / tp) * self.activation_bytes(tp)
        if recompute == "none":
            return layer
        if recompute == "selective":
            return SELECTIVE_KEPT * layer
        if recompute == "full":
            return min(layer, self.itemsize * self.hidden * (3 if tp > 1 and keep_communication else 1))
        raise CostModelError(f"recompute={recompute!r}; expected one of {', '.join(RECOMPUTE_MODES)}")

    def token_bytes(
        self, tp: int, cp: int = 1, recompute: str = "none", recomputed_layers: int | None = None,
        keep_communication: bool = True,
    ) -> float:
        """Activation bytes one token of a micro-batch costs on one GPU of stage 0, with
        ``recomputed_layers`` (default: all) of the layers under ``recompute``."""
        layer = (self.hidden / tp) * self.activation_bytes(tp)
        kept = self.kept_bytes(tp, recompute, keep_communication)
        n = 0 if recompute == "none" else self.layers if recomputed_layers is None else recomputed_layers
        if not 0 <= n <= self.layers:
            raise CostModelError(f"recomputed_layers={n}; the model has {self.layers} layers")
        return ((self.layers - n) * layer + n * kept + (layer - kept if n else 0.0)) / cp

    def max_len(
        self, tp: int, pp: int, cp: int = 1, world_size: int | None = None, recompute: str = "none",
        recomputed_layers: int | None = None, keep_communication: bool = True,
    ) -> int:
        """MaxLen in tokens, aligned down to 128; 0 when the model states alone do not fit."""
        if world_size is not None and world_size < tp * pp * cp:
            raise CostModelError(
                f"world_size={world_size} is smaller than the {tp * pp * cp} GPUs of scheme "
                f"tp{tp},pp{pp},cp{cp}"
            )
        free = (
            self.gpu_memory
            - self.safe_bound
            - self.gap_bytes(tp * cp)
            - self.model_state_bytes(tp, pp, world_size)
        )
        if free <= 0:
            return 0
        tokens = int(free // self.token_bytes(tp, cp, recompute, recomputed_layers, keep_communication))
        return tokens // ALIGN * ALIGN

    # -- the table format -------------------------------------------------------------------------

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> MemoryRegression:
        """Read ``memory_regression``, ``model_config`` and ``cluster_config.gpu_memory_bound``."""
        reg = get_section(table, "memory_regression")
        model = get_section(table, "model_config")
        cluster = get_section(table, "cluster_config")
        only_keys(reg, "memory_regression", {"A", "B", "alpha", "gap", "safe_bound"})
        only_keys(model, "model_config", {"H", "L", "V"})
        a_section = get_section(reg, "A", "memory_regression")
        activation = []
        for key, value in a_section.items():
            m = re.fullmatch(r"tp([1-9]\d*)", str(key))
            if not m:
                raise CostModelError(f"memory_regression.A key {key!r}; use 'tpN', e.g. 'tp8'")
            activation.append((int(m.group(1)), number(value, f"memory_regression.A.{key}", positive=True)))
        gap_section = get_section(reg, "gap", "memory_regression")
        gap = tuple((str(k), number(v, f"memory_regression.gap.{k}")) for k, v in gap_section.items())
        return cls(
            activation=tuple(sorted(activation)),
            bytes_per_layer_h2=number(get_field(reg, "B", "memory_regression"), "memory_regression.B"),
            alpha=number(get_field(reg, "alpha", "memory_regression"), "memory_regression.alpha"),
            gap=gap,
            safe_bound=number(
                get_field(reg, "safe_bound", "memory_regression"), "memory_regression.safe_bound"
            ),
            gpu_memory=number(
                get_field(cluster, "gpu_memory_bound", "cluster_config"),
                "cluster_config.gpu_memory_bound",
                positive=True,
            ),
            hidden=integer(get_field(model, "H", "model_config"), "model_config.H"),
            layers=integer(get_field(model, "L", "model_config"), "model_config.L"),
            vocab=integer(get_field(model, "V", "model_config"), "model_config.V"),
        )

    def to_table(self) -> dict[str, Any]:
        """The ``memory_regression`` and ``model_config`` sections (``gpu_memory_bound`` is the caller's)."""
        return {
            "memory_regression": {
                "A": {f"tp{t}": _plain(v) for t, v in self.activation},
                "B": _plain(self.bytes_per_layer_h2),
                "alpha": self.alpha,
                "gap": {k: _plain(v) for k, v in self.gap},
                "safe_bound": _plain(self.safe_bound),
            },
            "model_config": {"H": self.hidden, "L": self.layers, "V": self.vocab},
        }


# -- strict field readers, shared with cost.py -----------------------------------------------------


def number(value: Any, where: str, positive: bool = False) -> float:
    """A finite real >= 0 (> 0 when ``positive``), else ``CostModelError`` naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostModelError(f"cost table field {where}: expected a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise CostModelError(f"cost table field {where}: expected a finite number {bound}, got {value!r}")
    return float(value)


def integer(value: Any, where: str, minimum: int = 1) -> int:
    """An integer >= ``minimum`` (a float with an integral value is accepted), else ``CostModelError``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CostModelError(f"cost table field {where}: expected an integer >= {minimum}, got {value!r}")
    return value


def get_field(section: Mapping[str, Any], key: str, parent: str) -> Any:
    if key not in section:
        raise CostModelError(f"cost table field {_dotted(parent, key)} is missing")
    return section[key]


def get_section(parent_section: Mapping[str, Any], key: str, parent: str = "") -> Mapping[str, Any]:
    value = get_field(parent_section, key, parent)
    if not isinstance(value, Mapping):
        raise CostModelError(
            f"cost table field {_dotted(parent, key)}: expected an object, got {type(value).__name__}"
        )
    return value


def _dotted(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def only_keys(section: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise CostModelError(
            f"cost table section {where} has unknown keys {unknown}; allowed: {sorted(allowed)}"
        )


def _plain(value: float) -> float | int:
    """Write integral floats as ints so tables stay readable and round-trip exactly."""
    return int(value) if float(value).is_integer() else value


def budget_below(memory: MemoryRegression, tp: int, pp: int, cp: int, world_size: int | None, tokens: int) -> float:
    """The largest GPU memory (bytes) under which scheme ``tp, pp, cp`` takes fewer than ``tokens``
    tokens (MaxLen < tokens): a memory budget that makes documents of ``tokens`` tokens bind."""
    if tokens <= ALIGN:
        raise CostModelError(f"tokens={tokens}: a budget binding below it needs tokens > {ALIGN}")
    probe = dataclasses.replace(memory, gpu_memory=0.0)
    fixed = probe.safe_bound + probe.gap_bytes(tp * cp) + probe.model_state_bytes(tp, pp, world_size)
    per_token = probe.token_bytes(tp, cp)
    limit = (tokens - 1) // ALIGN * ALIGN  # the largest aligned MaxLen below tokens
    gpu_memory = fixed + per_token * (limit + ALIGN) - 1.0  # just short of the next aligned step
    return gpu_memory

