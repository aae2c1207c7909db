"""Compile options: ``RecomputeConfig`` and ``OverlapConfig`` (values of ``hgraph.compile``'s
``recompute=`` and ``schedule=``) and ``CompileOptions``, what the passes and the runtime read;
``compile_options`` checks ``compile``'s keywords against each other and the strategies and returns
one ``CompileOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from hgraph.core.degrees import Degrees
from hgraph.core.errors import HGraphError, InputError, StrategyError
from hgraph.core.strategy import Strategy
from hgraph.lnk.topology import Topology
from hgraph.runtime.kernels.recompute import MODES
from hgraph.schedule.lowerings import PIPELINE_SCHEDULES, PLACEMENTS


@dataclass(frozen=True)
class RecomputeConfig:
    """Recomputation mode and the layers it applies to (all when neither ``layers`` nor ``every``)."""

    mode: str = "none"
    layers: Optional[frozenset[int]] = None
    every: Optional[int] = None
    keep_communication: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise HGraphError(f"recompute={self.mode!r}; expected one of {', '.join(MODES)}")
        if self.layers is not None and self.every is not None:
            raise HGraphError("RecomputeConfig: give layers= or every=, not both")
        if self.every is not None and (not isinstance(self.every, int) or self.every < 1):
            raise HGraphError(f"RecomputeConfig(every={self.every!r}); expected an integer >= 1")
        if self.layers is not None:
            object.__setattr__(self, "layers", frozenset(int(i) for i in self.layers))

    @classmethod
    def of(cls, value: Union[str, "RecomputeConfig", None]) -> "RecomputeConfig":
        """A config from ``compile``'s ``recompute=`` argument (a mode name or a config)."""
        if value is None:
            return cls()
        if isinstance(value, RecomputeConfig):
            return value
        if isinstance(value, str):
            return cls(value)
        raise HGraphError(f"recompute={value!r}; expected 'none', 'selective', 'full' or a RecomputeConfig")

    def applies_to(self, layer: int) -> bool:
        if self.mode == "none":
            return False
        if self.layers is not None:
            return layer in self.layers
        return self.every is None or layer % self.every == 0

    def fraction(self, num_layers: int) -> float:
        """Share of the model's ``num_layers`` layers that are recomputed."""
        if num_layers < 1:
            return 0.0
        return sum(self.applies_to(i) for i in range(num_layers)) / num_layers

    def __str__(self) -> str:
        if self.mode == "none":
            return "none"
        which = (
            f"layers {sorted(self.layers)}" if self.layers is not None
            else f"every {self.every} layers" if self.every is not None else "all layers"
        )
        reissue = ", collectives reissued" if not self.keep_communication else ""
        return f"{self.mode} ({which}{reissue})"


@dataclass(frozen=True)
class OverlapConfig:
    """Knobs of the overlap scheduler (``hgraph.compile(..., schedule=OverlapConfig(...))``)."""

    prefetch_layers: int = 1
    bucket_bytes: int = 1 << 20
    max_inflight_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.prefetch_layers < 0:
            raise InputError(f"prefetch_layers={self.prefetch_layers}; expected an integer >= 0")
        if self.bucket_bytes < 0:
            raise InputError(f"bucket_bytes={self.bucket_bytes}; expected >= 0 (0: one push per bucket)")
        if self.max_inflight_bytes is not None and self.max_inflight_bytes <= 0:
            raise InputError(f"max_inflight_bytes={self.max_inflight_bytes}; expected None or > 0")


@dataclass(frozen=True)
class CompileOptions:
    """Knobs of ``compile`` (all optional)."""

    compute_dtype: Optional[torch.dtype] = None
    sequence_parallel: bool = False
    vocab_parallel: bool = True
    schedule: str = "none"
    layer_costs: Optional[tuple[float, ...]] = None
    topology: Optional[Topology] = None
    overlap: Optional[OverlapConfig] = None  # when schedule == "overlap"
    recompute: RecomputeConfig = RecomputeConfig()
    recompute_by_scheme: tuple[tuple[Degrees, RecomputeConfig], ...] = ()  # keyed by recompute_key
    reduce_dtype: Optional[torch.dtype] = torch.float32
    coalesce: bool = False
    pipeline_schedule: str = "1f1b"  # hgraph.schedule.lowerings.PIPELINE_SCHEDULES

    def recompute_for(self, pipeline: Degrees) -> RecomputeConfig:
        """The recompute config of pipelines with these degrees."""
        return dict(self.recompute_by_scheme).get(recompute_key(pipeline), self.recompute)

    def __str__(self) -> str:
        changed = [f"{k}={getattr(self, k)}" for k in self.__dataclass_fields__
                   if getattr(self, k) != getattr(_DEFAULT_OPTIONS, k)]
        return "CompileOptions(" + ", ".join(changed) + ")"


_DEFAULT_OPTIONS = CompileOptions()


def compile_options(
    strategies: Sequence[Strategy],
    *,
    compute_dtype: Optional[torch.dtype],
    sequence_parallel: bool,
    vocab_parallel: bool,
    schedule: Union[str, OverlapConfig],
    layer_costs: Optional[Sequence[float]],
    topology: Optional[Topology],
    recompute: Union[str, RecomputeConfig, dict],
    reduce_dtype: Optional[torch.dtype],
    coalesce: bool,
    pipeline_schedule: str,
) -> CompileOptions:
    """``compile``'s options checked against each other and the strategies, as one ``CompileOptions``."""
    overlap = schedule if isinstance(schedule, OverlapConfig) else None
    if overlap is not None:
        schedule = "overlap"
    elif schedule not in PLACEMENTS:
        raise HGraphError(f"schedule={schedule!r}; expected {', '.join(map(repr, PLACEMENTS))} or an OverlapConfig")
    elif schedule == "overlap":
        overlap = OverlapConfig()
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise HGraphError(f"pipeline_schedule={pipeline_schedule!r}; expected one of {list(PIPELINE_SCHEDULES)}")
    interleaved = any(p.vpp > 1 for s in strategies for p in s.pipelines)
    if schedule == "overlap" and interleaved:
        raise HGraphError("interleaved pipelines (vpp > 1) with schedule='overlap' are not supported yet; "
                          "use schedule='none' or vpp=1")
    if pipeline_schedule != "1f1b" and interleaved:
        raise StrategyError(f"pipeline_schedule={pipeline_schedule!r} with an interleaved pipeline (vpp > 1): "
                            "vpp > 1 always runs interleaved 1F1B; use pipeline_schedule='1f1b' or vpp=1")
    if pipeline_schedule != "1f1b" and schedule == "overlap":
        raise HGraphError(
            f"pipeline_schedule={pipeline_schedule!r} with schedule='overlap' is not supported yet (the overlap "
            "runtime runs whole backwards); use schedule='none', or pipeline_schedule='1f1b'"
        )
    if coalesce and schedule == "overlap":
        raise HGraphError(
            "coalesce=True with schedule='overlap' is not supported yet (the overlap schedule starts pulls "
            "and pushes one parameter at a time); use schedule='none' with coalesce=True, or coalesce=False"
        )
    return CompileOptions(
        compute_dtype=compute_dtype,
        sequence_parallel=sequence_parallel,
        vocab_parallel=vocab_parallel,
        schedule=schedule,
        layer_costs=tuple(layer_costs) if layer_costs is not None else None,
        topology=topology,
        overlap=overlap,
        recompute=RecomputeConfig.of("none" if isinstance(recompute, dict) else recompute),
        recompute_by_scheme=_recompute_by_scheme(recompute),
        reduce_dtype=reduce_dtype,
        coalesce=coalesce,
        pipeline_schedule=pipeline_schedule,
    )


def recompute_key(pipeline: Degrees) -> Degrees:
    """What a per-scheme recompute config is keyed by: the degrees ``tp``, ``pp``, ``cp`` (one config
    for every ``vpp`` and ``ep`` of them)."""
    return Degrees(pipeline.tp, pipeline.pp, pipeline.cp)


def _recompute_by_scheme(recompute: Any) -> tuple:
    """``compile``'s per-scheme recompute dict as ``(recompute_key, RecomputeConfig)`` pairs."""
    if not isinstance(recompute, dict):
        return ()
    out = []
    for scheme, value in recompute.items():
        p = Degrees.parse(scheme) if isinstance(scheme, str) else scheme
        if not isinstance(p, Degrees):
            raise HGraphError(f"recompute key {scheme!r}; expected a scheme like 'tp2,pp2' or a Pipeline")
        out.append((recompute_key(p), RecomputeConfig.of(value)))
    return tuple(out)
