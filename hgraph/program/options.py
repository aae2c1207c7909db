"""Compile options as values: ``CompileOptions`` (``hgraph.compile(..., options=)``) with its nested
``ScheduleConfig`` (and ``OverlapConfig``), ``RecomputeConfig`` and ``BuildConfig``. Every value is
checked where it is made (``__post_init__``); what needs the strategies is ``CompileOptions.check``,
which ``compile`` calls. The passes and the runtime read the same ``CompileOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from hgraph.core.degrees import Degrees
from hgraph.core.strategy import Strategy
from hgraph.errors import HGraphError, InputError, StrategyError
from hgraph.lnk.topology import Topology
from hgraph.runtime.kernels.recompute import MODES
from hgraph.schedule.lowerings import PIPELINE_SCHEDULES

PACKING_MODES = ("auto", "require", "off")


@dataclass(frozen=True)
class RecomputeConfig:
    """Recomputation mode and the layers it applies to (all when neither ``layers`` nor ``every``)."""

    mode: str = "none"
    """``"none"``, ``"selective"`` (recompute elementwise ops) or ``"full"`` (keep only layer inputs)."""
    layers: Optional[frozenset[int]] = None
    """The layers recomputed (default: all, or every ``every``-th)."""
    every: Optional[int] = None
    """Recompute every ``every``-th layer (layer ``i`` with ``i % every == 0``)."""
    keep_communication: bool = True
    """Keep the forward's collectives' results instead of issuing them again in the recomputation."""

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
        """A config from a mode name (or a config, returned as is)."""
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


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """Knobs of the overlap scheduler (``ScheduleConfig(overlap=OverlapConfig(...))``)."""

    prefetch_layers: int = 1
    """How many layers ahead parameters are pulled."""
    bucket_bytes: int = 1 << 20
    """Gradients pushed together up to this many bytes (0: one push per bucket)."""
    max_inflight_bytes: Optional[int] = None
    """At most this many bytes of pulls in flight (none: no limit)."""

    def __post_init__(self) -> None:
        if self.prefetch_layers < 0:
            raise InputError(f"prefetch_layers={self.prefetch_layers}; expected an integer >= 0")
        if self.bucket_bytes < 0:
            raise InputError(f"bucket_bytes={self.bucket_bytes}; expected >= 0 (0: one push per bucket)")
        if self.max_inflight_bytes is not None and self.max_inflight_bytes <= 0:
            raise InputError(f"max_inflight_bytes={self.max_inflight_bytes}; expected None or > 0")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How an iteration is ordered: the pipeline schedule, overlapped communication, coalescing."""

    pipeline: str = "1f1b"
    """``"1f1b"`` or ``"zb1p"`` (zero-bubble ZB-H1: each backward split into an input-gradient and a
    weight-gradient step); a pipeline with ``vpp > 1`` runs interleaved 1F1B (``hgraph.schedule.actions``)."""
    overlap: Optional[OverlapConfig] = None
    """Prefetch pulls and start pushes early (same results); none: pull all, run, push all."""
    coalesce: bool = False
    """Pull and push each layer's parameters together, one merged call per group and kind, so an
    iteration issues O(layers) collectives instead of O(parameters); without ``overlap`` only."""

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINE_SCHEDULES:
            raise HGraphError(f"schedule.pipeline={self.pipeline!r}; expected one of {sorted(PIPELINE_SCHEDULES)}")
        if self.overlap is not None and not isinstance(self.overlap, OverlapConfig):
            raise HGraphError(f"schedule.overlap={self.overlap!r}; expected None or an OverlapConfig")
        if self.pipeline != "1f1b" and self.overlap is not None:
            raise HGraphError(
                f"schedule.pipeline={self.pipeline!r} with schedule.overlap is not supported yet (the overlap "
                "runtime runs whole backwards); use schedule.overlap=None, or schedule.pipeline='1f1b'"
            )
        if self.coalesce and self.overlap is not None:
            raise HGraphError(
                "schedule.coalesce=True with schedule.overlap is not supported yet (the overlap schedule starts "
                "pulls and pushes one parameter at a time); use schedule.overlap=None with coalesce=True, or "
                "coalesce=False"
            )


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """What is built at compile, and the on-disk plan cache."""

    rank: Union[int, None, str] = "auto"
    """The rank whose plans and programs are built now (``"auto"``: the process's own rank in an
    initialised process group of this world size, as under ``hgraph.launch`` / torchrun, else
    ``None``: every rank); any other rank's are built on first use and equal a full compile's."""
    verify: Optional[bool] = None
    """Dry-run every rank's actions at compile (default: world size <= ``VERIFY_WORLD``; it builds
    every rank's program)."""
    cache_dir: Optional[str] = None
    """Keep the compiled rank's Pull / Push plans here (or in ``$HGRAPH_COMPILE_CACHE``), keyed by what
    they are built from (JSON data, never code); ``compiled.cache_hit`` says whether they came from there."""
    trust_shared_cache: bool = False
    """Use a cache directory other users can write (everyone who can write it is trusted;
    docs/reliability.md, "Trust")."""

    def __post_init__(self) -> None:
        if not (self.rank is None or self.rank == "auto" or (isinstance(self.rank, int) and self.rank >= 0)):
            raise StrategyError(f"build.rank={self.rank!r}: expected 'auto', None or a rank >= 0")


RecomputeShapes = Mapping[Any, Union[str, RecomputeConfig]]


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Everything ``hgraph.compile`` can be told besides the model, strategies and example inputs."""

    compute_dtype: Optional[torch.dtype] = None
    """Mixed precision as ``torch.autocast`` computes it (e.g. ``torch.bfloat16``: parameters pulled in
    bf16, halving Pull bytes; matmuls and attention in bf16; norms, softmax and the loss in fp32;
    ``hgraph.passes.precision``); none (``"float32"`` in a config): fp32."""
    reduce_dtype: Optional[torch.dtype] = torch.float32
    """Dtype gradients are reduced in by Push Gradient (fp32, also under a bf16 ``compute_dtype``;
    none: the compute dtype)."""
    sequence_parallel: bool = False
    """Split the tokens outside attention and the MLP over tp (pads every micro-batch)."""
    vocab_parallel: bool = True
    """Shard the embedding and the output projection over the vocabulary."""
    layer_costs: Optional[tuple[float, ...]] = None
    """Per-layer cost for balancing pipeline stages (none: the parameter count)."""
    topology: Optional[Topology] = None
    """The machine's links, for planning Pull / Push (none: one flat network)."""
    packing: str = "auto"
    """``"auto"`` (several documents per micro-batch once packing is proved exact for this model, else
    one with a ``PackingWarning``), ``"require"`` (unproved: ``PackingError``) or ``"off"``."""
    recompute: Union[RecomputeConfig, RecomputeShapes] = RecomputeConfig()
    """One ``RecomputeConfig`` for every pipeline, or a mapping from pipeline shape (``"tp2,pp2"`` or a
    ``Pipeline``) to a mode name or config (shapes not listed: none), e.g. the planner's
    ``choose_recompute`` per shape."""
    schedule: ScheduleConfig = ScheduleConfig()
    """The pipeline schedule and overlapped communication."""
    build: BuildConfig = BuildConfig()
    """What is built now, verification and the plan cache."""
    passes: tuple[Any, ...] = ()
    """User ``hgraph.passes.pipeline.Pass`` objects, placed at named points (``after="localize"``)."""
    disable: frozenset[str] = frozenset()
    """Names of built-in passes to skip."""
    max_seq_len: Optional[int] = None
    """The longest sequence (tokens per row) the compiled graph must serve; none: the bound the model
    states, as torch.export finds it (a sliced position table, a ``block_size`` assert), else unbounded."""

    def __post_init__(self) -> None:
        if self.layer_costs is not None:
            object.__setattr__(self, "layer_costs", tuple(self.layer_costs))
        object.__setattr__(self, "passes", tuple(self.passes))
        if isinstance(self.disable, str):
            raise HGraphError(f"disable={self.disable!r}; expected a collection of pass names, e.g. ({self.disable!r},)")
        object.__setattr__(self, "disable", frozenset(self.disable))
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise HGraphError(f"max_seq_len={self.max_seq_len!r}; expected None or an int of at least 2")
        if self.packing not in PACKING_MODES:
            raise HGraphError(f"packing={self.packing!r}; expected one of {', '.join(map(repr, PACKING_MODES))}")
        for name, kind in (("schedule", ScheduleConfig), ("build", BuildConfig)):
            if not isinstance(getattr(self, name), kind):
                raise HGraphError(f"{name}={getattr(self, name)!r}; expected a {kind.__name__}")
        if isinstance(self.recompute, Mapping):
            object.__setattr__(self, "recompute", dict(self.recompute))  # a copy: the caller's may change
        elif not isinstance(self.recompute, RecomputeConfig):
            raise HGraphError(f"recompute={self.recompute!r}; expected a RecomputeConfig or a mapping from "
                              "pipeline shape to one, e.g. {'tp2,pp2': RecomputeConfig('full')}")
        _ = self.recompute_by_shape  # checks the mapping's keys and values

    @property
    def recompute_by_shape(self) -> dict[Degrees, RecomputeConfig]:
        """The recompute config per pipeline shape, keyed by ``recompute_key`` (empty for one config
        for all)."""
        if isinstance(self.recompute, RecomputeConfig):
            return {}
        out = {}
        for shape, value in self.recompute.items():
            p = Degrees.parse(shape) if isinstance(shape, str) else shape
            if not isinstance(p, Degrees):
                raise HGraphError(f"recompute key {shape!r}; expected a pipeline shape like 'tp2,pp2' or a Pipeline")
            out[recompute_key(p)] = RecomputeConfig.of(value)
        return out

    def recompute_for(self, pipeline: Degrees) -> RecomputeConfig:
        """The recompute config of pipelines with these degrees."""
        if isinstance(self.recompute, RecomputeConfig):
            return self.recompute
        return self.recompute_by_shape.get(recompute_key(pipeline), RecomputeConfig())

    def check(self, strategies: Sequence[Strategy]) -> None:
        """The checks that need the strategies (``compile`` runs them): interleaved pipelines run
        interleaved 1F1B without overlap; ``build.rank`` is a rank of the world."""
        interleaved = any(p.vpp > 1 for s in strategies for p in s.pipelines)
        if self.schedule.overlap is not None and interleaved:
            raise HGraphError("interleaved pipelines (vpp > 1) with schedule.overlap are not supported yet; "
                              "use schedule.overlap=None or vpp=1")
        if self.schedule.pipeline != "1f1b" and interleaved:
            raise StrategyError(f"schedule.pipeline={self.schedule.pipeline!r} with an interleaved pipeline (vpp > 1): "
                                "vpp > 1 always runs interleaved 1F1B; use schedule.pipeline='1f1b' or vpp=1")
        world = strategies[0].world_size
        rank = self.build.rank
        if isinstance(rank, int) and not rank < world:
            raise StrategyError(f"build.rank={rank!r}: expected 'auto', None or a rank in 0..{world - 1}")

    def __str__(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                   if getattr(self, f.name) != getattr(_DEFAULT_OPTIONS, f.name)]
        return "CompileOptions(" + ", ".join(changed) + ")"


_DEFAULT_OPTIONS = CompileOptions()


def recompute_key(pipeline: Degrees) -> Degrees:
    """What a per-shape recompute config is keyed by: the degrees ``tp``, ``pp``, ``cp`` (one config
    for every ``vpp`` and ``ep`` of them)."""
    return Degrees(pipeline.tp, pipeline.pp, pipeline.cp)


__all__ = ["PACKING_MODES", "BuildConfig", "CompileOptions", "OverlapConfig", "RecomputeConfig", "ScheduleConfig"]
