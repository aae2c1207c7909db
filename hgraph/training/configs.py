"""The ``Trainer``'s options as values: ``AdamWConfig`` (the optimizer), ``RunConfig`` (how each
step runs) and ``LRScheduleConfig`` (the learning-rate schedule of ``hgraph train``), each checked
where it is made (``__post_init__``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from hgraph.core.batch import DEFAULT_MICRO_BATCH_TOKENS
from hgraph.errors import InputError, TrainingError
from hgraph.runtime.initial_shards import PathLike
from hgraph.runtime.metrics import MetricsConfig


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    """The sharded AdamW (``torch.optim.AdamW``'s update on each rank's fp32 master shards)."""

    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    grad_clip: Optional[float] = None
    """Clip the global gradient norm to this (none: no clipping; in a config, a large value switches it off)."""
    lr_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None
    """Called with the optimizer, returns a ``torch.optim.lr_scheduler`` stepped once per iteration."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        lr, betas, eps, weight_decay = self.lr, self.betas, self.eps, self.weight_decay
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
            raise TrainingError(
                f"invalid AdamW settings lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}; "
                "need lr, eps, weight_decay >= 0 and 0 <= beta < 1 (optimizer=AdamWConfig(...))"
            )
        if self.grad_clip is not None and not self.grad_clip >= 0:
            raise TrainingError(f"optimizer.grad_clip={self.grad_clip!r}; expected None (no clipping) or a norm >= 0")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise TrainingError(f"optimizer.lr_scheduler={self.lr_scheduler!r}; expected None or a callable "
                                "optimizer -> torch.optim.lr_scheduler")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How the ``Trainer`` runs each step, where its shards come from and what it measures."""

    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS
    """Tokens per micro-batch of the default dispatch (without a planner)."""
    timeline: bool = False
    """Record this rank's intervals of every step (``runtime/timeline.py``; ``gather_timeline()``)."""
    device: Union[str, torch.device, None] = None
    """Where shards, micro-batches and every tensor handed to a collective live (none: the
    communicator's device, i.e. this rank's GPU under NCCL, else CPU)."""
    metrics: Optional[MetricsConfig] = None
    """Metrics rank 0 writes (``hgraph.runtime.metrics``); every rank measures its memory and exposed
    communication."""
    weights: Optional[PathLike] = None
    """A safetensors checkpoint (a file, a directory with ``model.safetensors``, or an HF sharded
    checkpoint) the fp32 master shards are read from, each rank reading only its slices; none: a
    meta-built model is initialised layer by layer from ``init_seed``, an eager one's values are used."""
    init_seed: int = 0
    """Seed of the layer-wise initialisation of a meta-built model (``hgraph.frontend.layerwise_init``)."""
    release_model: bool = False
    """Once the shards exist, free the model's parameters (they become meta tensors), so no full copy
    stays in the process (docs/big_models.md)."""

    def __post_init__(self) -> None:
        if isinstance(self.micro_batch_tokens, bool) or not isinstance(self.micro_batch_tokens, int) \
                or self.micro_batch_tokens < 1:
            raise InputError(f"run.micro_batch_tokens={self.micro_batch_tokens!r}; expected an integer >= 1")
        if isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int):
            raise InputError(f"run.init_seed={self.init_seed!r}; expected an integer")
        if self.metrics is not None and not isinstance(self.metrics, MetricsConfig):
            raise InputError(f"run.metrics={self.metrics!r}; expected None or a MetricsConfig")


LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """A learning-rate schedule over a run of ``iterations``: linear warmup, then constant or cosine."""

    kind: str = "constant"
    """``"constant"`` or ``"cosine"`` (after warmup, cosine down to ``min_lr_ratio`` at the last iteration)."""
    warmup: int = 0
    """Iterations of linear learning-rate warmup."""
    min_lr_ratio: float = 0.1
    """The cosine schedule's final learning rate, as a fraction of ``lr``."""

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise InputError(f"lr_schedule.kind={self.kind!r}; expected one of {', '.join(map(repr, LR_SCHEDULES))}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise InputError(f"lr_schedule.warmup={self.warmup!r}; expected an integer >= 0")
        if not self.min_lr_ratio >= 0:
            raise InputError(f"lr_schedule.min_lr_ratio={self.min_lr_ratio!r}; expected >= 0")

    @property
    def constant(self) -> bool:
        """Whether the learning rate never changes (no warmup, constant)."""
        return self.kind == "constant" and not self.warmup

    def factor(self, step: int, iterations: int) -> float:
        """The learning rate of ``step`` as a fraction of ``lr`` (``torch.optim.lr_scheduler.LambdaLR``'s)."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, iterations - self.warmup))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


__all__ = ["LR_SCHEDULES", "AdamWConfig", "LRScheduleConfig", "RunConfig"]
