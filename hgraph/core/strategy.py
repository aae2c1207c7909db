"""Parallel strategies: a ``Strategy`` is a set of ``Pipeline`` replicas on disjoint ranks.

Each pipeline is one model replica: its ``Degrees`` (``hgraph.core.degrees``: tensor- (tp),
pipeline- (pp), context- (cp), virtual-stage (vpp) and expert-parallel (ep) degree) plus its ranks.
Inside a pipeline, rank order is stage-major, then cp, then tp (tp innermost), so a TP group is a run
of consecutive ranks and stays inside one node when pipelines are placed largest-TP first.
``Strategy.check`` is the one check against the world size and the model's dimensions (compile,
``hgraph train`` and the demo call it).

Expert parallelism (``ep``) reuses a stage's ``cp x tp`` ranks as an expert mesh ``(ep, etp)`` with
``etp = cp·tp / ep``, row-major over the stage's ranks: rank ``i`` of the stage holds expert group
``i // etp`` (a run of ``etp`` consecutive ranks, which cut those experts tensor-parallel) and
exchanges tokens with the ranks ``i % etp + k·etp`` (its ``ep`` group).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Optional, Sequence

from hgraph.core.degrees import Degrees, parse_degrees
from hgraph.errors import StrategyError


@dataclass(frozen=True)
class Pipeline(Degrees):
    """One model replica: its ``Degrees`` (``pp`` stages, each a ``cp x tp`` mesh of ranks; with
    ``vpp > 1`` the chunks ``s, s + pp, ...`` of ``pp * vpp`` virtual stages on stage ``s``; with
    ``ep > 1`` the experts split over the stage's ranks, see the module docstring) plus its ranks.
    ``str`` is the degrees' (``"tp2,pp2"``)."""

    ranks: Optional[tuple[int, ...]] = None
    """The pipeline's ranks, stage-major (``None``: a ``Strategy`` assigns them)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ranks is not None:
            ranks = tuple(int(r) for r in self.ranks)
            object.__setattr__(self, "ranks", ranks)
            if len(ranks) != self.size:
                raise StrategyError(
                    f"Pipeline(tp={self.tp}, pp={self.pp}, cp={self.cp}) needs {self.size} ranks, "
                    f"got {len(ranks)}: {ranks}"
                )
            if len(set(ranks)) != len(ranks):
                raise StrategyError(f"Pipeline ranks {ranks} contain duplicates")
            if any(r < 0 for r in ranks):
                raise StrategyError(f"Pipeline ranks {ranks} contain a negative rank")

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Ranks of stage ``stage`` in row-major ``(cp, tp)`` order."""
        if self.ranks is None:
            raise StrategyError("this pipeline has no ranks yet; build it inside a Strategy")
        if not 0 <= stage < self.pp:
            raise StrategyError(f"stage {stage} out of range for pp={self.pp}")
        n = self.cp * self.tp
        return self.ranks[stage * n : (stage + 1) * n]

    def stage_of(self, rank: int) -> int:
        """Which stage ``rank`` belongs to."""
        assert self.ranks is not None
        return self.ranks.index(rank) // (self.cp * self.tp)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The process groups ``rank`` belongs to in this pipeline: its ``tp`` and ``cp`` groups (a
        stage's ranks are cp-major: position ``c * tp + t``), its whole ``stage`` and the ``pipeline``;
        with ``ep > 1`` also its ``ep`` group (the ranks it exchanges tokens with) and ``etp`` group
        (the ranks holding its experts, see ``expert_mesh``)."""
        ranks = self.stage_ranks(self.stage_of(rank))
        position = ranks.index(rank)
        c, t = divmod(position, self.tp)
        groups = {
            "tp": tuple(ranks[c * self.tp + j] for j in range(self.tp)),
            "cp": tuple(ranks[j * self.tp + t] for j in range(self.cp)),
            "stage": tuple(ranks),
            "pipeline": tuple(self.ranks or ()),
        }
        if self.ep > 1:
            etp = self.expert_mesh[1]
            g, e = divmod(position, etp)
            groups["ep"] = tuple(ranks[k * etp + e] for k in range(self.ep))
            groups["etp"] = tuple(ranks[g * etp + k] for k in range(etp))
        return groups


@dataclass(frozen=True)
class Strategy:
    """A set of pipelines on disjoint ranks; ranks are assigned when omitted.

    Automatic placement orders pipelines by TP (largest first) and packs them onto consecutive
    ranks, so with power-of-two degrees every TP group stays inside a node of ``gpus_per_node``.
    """

    pipelines: tuple[Pipeline, ...]
    gpus_per_node: int = field(default=8, compare=False)

    def __post_init__(self) -> None:
        pipelines = tuple(self.pipelines)
        if not pipelines:
            raise StrategyError("a Strategy needs at least one Pipeline")
        for p in pipelines:
            if not isinstance(p, Pipeline):
                raise StrategyError(f"Strategy takes Pipeline objects, got {p!r}")
        if any(p.ranks is None for p in pipelines):
            pipelines = _assign_ranks(pipelines)
        seen: dict[int, int] = {}
        for i, p in enumerate(pipelines):
            assert p.ranks is not None
            for r in p.ranks:
                if r in seen:
                    raise StrategyError(
                        f"rank {r} is used by pipeline {seen[r]} ({pipelines[seen[r]]}) and pipeline {i} ({p}); "
                        "pipelines of one strategy need disjoint ranks"
                    )
                seen[r] = i
        object.__setattr__(self, "pipelines", pipelines)
        ranks = sorted(seen)
        if ranks != list(range(len(ranks))):
            missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
            raise StrategyError(
                f"strategy {self} leaves ranks {missing} unused; ranks must be exactly 0..{len(ranks) - 1}"
            )

    @property
    def world_size(self) -> int:
        return sum(p.size for p in self.pipelines)

    def pipeline_of(self, rank: int) -> int:
        """Index of the pipeline that owns ``rank``."""
        for i, p in enumerate(self.pipelines):
            assert p.ranks is not None
            if rank in p.ranks:
                return i
        raise StrategyError(f"rank {rank} is not used by strategy {self} (world size {self.world_size})")

    def check(self, world_size: int, model_dims: Optional[Mapping[str, int]] = None) -> None:
        """The one check of a strategy against the world and the model: raise ``StrategyError`` unless
        it uses exactly ``world_size`` ranks and fits ``model_dims`` (``hgraph.core.model_info.
        model_dims``: tp divides the heads, the hidden size and the vocabulary, and the key/value heads
        unless tp is a multiple of them (each is then replicated, as Megatron does); ``pp * vpp`` at
        most the layers; ep divides the routed experts)."""
        if self.world_size != world_size:
            raise StrategyError(
                f"strategy {self} uses {self.world_size} ranks but the world has {world_size}; "
                "every strategy must cover the whole world"
            )
        dims = model_dims or {}
        for p in self.pipelines:
            for key, label in (("heads", "attention heads"), ("kv_heads", "key/value heads"),
                               ("hidden", "hidden size"), ("vocab", "vocabulary")):
                if key == "kv_heads" and key in dims and p.tp % dims[key] == 0:
                    continue  # fewer key/value heads than tp ranks: each is replicated (Megatron)
                if key in dims and dims[key] % p.tp:
                    raise StrategyError(
                        f"strategy {self}: tp={p.tp} does not divide the {label} ({dims[key]}); "
                        f"use a tp that divides {dims[key]}"
                    )
            if "layers" in dims and p.pp > dims["layers"]:
                raise StrategyError(
                    f"strategy {self}: pp={p.pp} exceeds the model's {dims['layers']} layers; use pp <= {dims['layers']}"
                )
            if "layers" in dims and p.pp * p.vpp > dims["layers"]:
                raise StrategyError(
                    f"strategy {self}: pp*vpp={p.pp * p.vpp} virtual stages exceed the model's {dims['layers']} "
                    f"layers; use vpp <= {dims['layers'] // p.pp}"
                )
            if p.ep > 1:
                self._check_experts(p.ep, dims)

    def _check_experts(self, ep: int, dims: Mapping[str, int]) -> None:
        """``ep`` needs routed experts in the model, and a number of them it divides."""
        experts = dims.get("experts")
        if not experts:
            raise StrategyError(
                f"strategy {self}: ep={ep} but the model has no routed experts (its config names no "
                "num_local_experts / num_experts / n_routed_experts); use ep=1 for a dense model"
            )
        if experts % ep:
            raise StrategyError(
                f"strategy {self}: ep={ep} does not divide the model's {experts} experts; "
                f"use an ep dividing {experts}"
            )

    @classmethod
    def parse(cls, text: str, gpus_per_node: int = 8) -> "Strategy":
        """Parse the form ``str`` prints: pipelines joined by ``+``, each ``[Nx ]degrees`` with degrees
        ``tp``, ``ep``, ``pp``, ``cp``, ``vpp`` (omitted: 1), e.g. ``"tp2,pp2 + 2x tp1"``,
        ``"tp1,pp2,vpp2"`` or ``"tp4,ep4 + 2x tp2"``. The older printed form ``"(tp4) + 2×(tp2)"`` is
        read too."""
        pipelines: list[Pipeline] = []
        for part in text.split("+"):
            part = part.strip()
            if not part:
                raise StrategyError(f"cannot parse strategy {text!r}: empty pipeline")
            count = 1
            m = re.match(r"^(\d+)\s*[x×*]\s*(.*)$", part)
            if m:
                count, part = int(m.group(1)), m.group(2)
            degrees = parse_degrees(part)
            if isinstance(degrees, str):
                raise StrategyError(f"cannot parse {degrees!r} in strategy {text!r}; use e.g. 'tp2,pp2 + 2x tp1'")
            pipelines.extend(Pipeline(**degrees) for _ in range(count))
        return cls(tuple(pipelines), gpus_per_node=gpus_per_node)

    def __str__(self) -> str:
        groups: list[tuple[str, int]] = []
        for p in self.pipelines:
            s = str(p)
            if groups and groups[-1][0] == s:
                groups[-1] = (s, groups[-1][1] + 1)
            else:
                groups.append((s, 1))
        return " + ".join(s if n == 1 else f"{n}x {s}" for s, n in groups)


def _assign_ranks(pipelines: Sequence[Pipeline]) -> tuple[Pipeline, ...]:
    """Give ranks to pipelines without them, largest TP first, on the lowest free ranks."""
    taken = {r for p in pipelines if p.ranks is not None for r in p.ranks}
    order = sorted(
        (i for i, p in enumerate(pipelines) if p.ranks is None),
        key=lambda i: (-pipelines[i].tp, -pipelines[i].size, i),
    )
    out = list(pipelines)
    next_rank = 0
    for i in order:
        ranks: list[int] = []
        while len(ranks) < pipelines[i].size:
            if next_rank not in taken:
                ranks.append(next_rank)
            next_rank += 1
        out[i] = replace(pipelines[i], ranks=tuple(ranks))
    # Keep the largest-TP-first order visible in the strategy itself.
    return tuple(sorted(out, key=lambda p: p.ranks[0] if p.ranks else 0))


def fits(degrees: Degrees, world_size: int, model_dims: Optional[Mapping[str, int]] = None) -> bool:
    """Whether data-parallel copies of ``degrees`` fill ``world_size`` ranks and pass ``Strategy.check``
    against ``model_dims``: the filter of the schemes ``hgraph train`` and the demo profile."""
    try:
        strategy = homogeneous(world_size, degrees.tp, degrees.pp, degrees.cp, degrees.ep, vpp=degrees.vpp)
        strategy.check(world_size, model_dims)
    except StrategyError:
        return False
    return True


def homogeneous(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *, vpp: int = 1) -> Strategy:
    """``world_size / (tp*pp*cp)`` identical pipelines (plain data parallelism over replicas)."""
    size = tp * pp * cp
    if world_size % size:
        raise StrategyError(f"tp*pp*cp={size} does not divide world size {world_size}")
    return Strategy(tuple(Pipeline(tp=tp, pp=pp, cp=cp, vpp=vpp, ep=ep) for _ in range(world_size // size)))


def as_strategies(strategies: Iterable[Strategy | Pipeline | str] | Strategy | Pipeline | str) -> list[Strategy]:
    """Normalise user input: Strategies, Pipelines or their readable string form; one of them alone
    (``"tp2 + 2x tp1"``) is one strategy."""
    if isinstance(strategies, (str, Strategy, Pipeline)):
        strategies = [strategies]
    if not isinstance(strategies, Iterable):
        raise StrategyError(f"strategies={strategies!r}; give a strategy such as 'tp2 + 2x tp1', a Strategy, "
                            "or a list of them")
    out = []
    for s in strategies:
        if isinstance(s, Strategy):
            out.append(s)
        elif isinstance(s, Pipeline):
            out.append(Strategy((s,)))
        elif isinstance(s, str):
            out.append(Strategy.parse(s))
        else:
            raise StrategyError(f"cannot use {s!r} as a strategy; give a Strategy, a Pipeline or e.g. 'tp2 + 2x tp1'")
    return out
