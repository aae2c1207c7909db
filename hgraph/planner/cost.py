"""The cost model: per-stage time ``T(l) = a*l^2 + b*l + c`` and MaxLen for each parallel scheme.

A ``CostModel`` is the planner's only view of hardware and model. It comes from a cost table (the
JSON format of the bundled presets, see ``from_table``), from ``hgraph.planner.analytic`` (FLOP
counts and alpha-beta communication) or from ``hgraph profile`` (measured and fitted). All three
produce the same table format, so every model can be written out and read back.

A scheme is one stage's degrees: a ``hgraph.core.degrees.Degrees`` with ``vpp = 1`` (a pipeline's
``stage_key``), printed in the strategy syntax (``tp2,pp4``; ``tp1,pp1``, the form printed before,
still parses).

Context parallelism: a table lists the schemes it was measured for; an entry may carry ``"cp": n``
(the analytic model writes such entries, with the ring-attention communication in ``b``). A cp > 1
scheme that the table does not list is not guessed: ``stage_cost`` raises ``CostModelError``;
``hgraph.planner.context.with_context_parallel`` adds cp schemes derived from the table's own entries.
An entry may say where it came from (``"source": "analytic"``, ``"profiled"``...); ``source(scheme)``
returns it and ``str`` shows it.

Expert parallelism: an entry may carry ``"ep": n`` (the MoE layers' experts split over ``n`` groups of
the stage's ranks, ``hgraph.core.strategy``); its ``T(l)`` holds the all-to-all and the expert load
imbalance (``hgraph.planner.experts``). MaxLen is the one of the same ``(tp, pp, cp)``: a rank holds
no more expert bytes under ep than with the experts tp-sharded (``E·P/(cp·tp)`` against ``E·P/tp``),
and the routed rows are costed at balanced routing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hgraph.core import atomic_files
from hgraph.core.degrees import Degrees
from hgraph.errors import CostModelError, StrategyError
from hgraph.planner.memory import MemoryRegression, get_field, get_section, integer, number, only_keys

PRESETS = ("llama7b_a800", "llama13b_a800", "llama32b_a800")

_TOP_KEYS = {"strategies", "memory_regression", "model_config", "cluster_config", "comm_cost"}
_ENTRY_KEYS = {"tp", "pp", "cp", "ep", "a", "b", "c", "source"}
_CLUSTER_KEYS = {"gpus_per_node", "gpu_memory_bound", "utilization_seqlen", "world_size"}


@dataclass(frozen=True)
class StageCost:
    """Time of one pipeline stage for one micro-batch, in milliseconds: ``T(l) = a*l^2 + b*l + c``.

    ``a`` is attention (quadratic per sequence), ``b`` linear work, ``c`` fixed per-micro-batch cost.
    """

    a: float
    b: float
    c: float

    def seq_time(self, length: float) -> float:
        """One sequence's share ``a*l^2 + b*l`` (no ``c``: that is paid once per micro-batch)."""
        return self.a * length * length + self.b * length

    def micro_batch_time(self, lengths: Iterable[float]) -> float:
        """``sum(a*l_i^2 + b*l_i) + c``: packed sequences never attend across their boundaries."""
        return sum(self.seq_time(l) for l in lengths) + self.c

    def __str__(self) -> str:
        return f"T(l) = {self.a:.4g}*l^2 + {self.b:.4g}*l + {self.c:.4g} ms"


# Recompute time as fractions of the attention (a) and linear (b) terms. Full recomputation replays
# a layer's forward: one of the four attention passes (forward, and the forward its backward recomputes,
# then two of gradient work) and one of the three linear passes. Selective replays only elementwise ops.
RECOMPUTE_TIME = {"none": (0.0, 0.0), "selective": (0.0, 0.05), "full": (0.25, 1 / 3)}


def recompute_cost(cost: StageCost, mode: str) -> StageCost:
    """``T(l)`` of a stage whose layers all run under ``mode`` (see ``RECOMPUTE_TIME``)."""
    if mode not in RECOMPUTE_TIME:
        raise CostModelError(f"recompute={mode!r}; expected one of {', '.join(RECOMPUTE_TIME)}")
    extra_a, extra_b = RECOMPUTE_TIME[mode]
    if mode == "none":
        return cost
    return StageCost(cost.a * (1 + extra_a), cost.b * (1 + extra_b), cost.c)


def choose_recompute(model: CostModel, scheme: Degrees, tokens: int, world_size: int | None = None) -> str | None:
    """The fastest recompute mode under which ``scheme`` fits a ``tokens``-token micro-batch (None
    when no mode does): the planner's per-scheme choice."""
    for mode in RECOMPUTE_TIME:  # fastest first
        if model.with_recompute({scheme: mode}).max_len(scheme, world_size) >= tokens:
            return mode
    return None


class CostModel:
    """Immutable map from scheme to ``StageCost`` and MaxLen, for one model on one kind of cluster.

    ``world_size`` (optional) is the GPU count the optimizer states are sharded over; it refines
    MaxLen (see ``hgraph.planner.memory``). ``with_world_size`` returns a copy with it set.
    """

    def __init__(
        self,
        name: str,
        stage_costs: Mapping[Degrees, StageCost],
        memory: MemoryRegression,
        gpus_per_node: int,
        world_size: int | None = None,
        extra: Mapping[str, Any] | None = None,
        sources: Mapping[Degrees, str] | None = None,
        recompute: str | Mapping[Degrees, str] = "none",
    ) -> None:
        if not stage_costs:
            raise CostModelError(f"cost model {name!r} has no schemes")
        for scheme in stage_costs:
            if scheme.vpp != 1:
                raise CostModelError(f"cost model {name!r}: scheme {scheme} has vpp={scheme.vpp}; a scheme "
                                     "is one stage's degrees (Degrees.stage_key), with vpp=1")
        self._name = name
        self._costs = dict(stage_costs)
        self._memory = memory
        self._gpus_per_node = integer(gpus_per_node, "cluster_config.gpus_per_node")
        self._world_size = None if world_size is None else integer(world_size, "world_size")
        self._extra = json.loads(json.dumps(dict(extra or {})))  # private deep copy
        self._sources = {s: str(v) for s, v in (sources or {}).items() if s in self._costs}
        for scheme in self._costs:
            self._memory.activation_bytes(scheme.tp)  # every scheme needs its A_tp
        self._recompute = dict(recompute) if isinstance(recompute, Mapping) else dict.fromkeys(self._costs, recompute)
        for scheme, mode in self._recompute.items():
            self._memory.kept_bytes(scheme.tp, mode)  # an unknown mode is an error here

    @property
    def name(self) -> str:
        return self._name

    @property
    def gpus_per_node(self) -> int:
        return self._gpus_per_node

    @property
    def world_size(self) -> int | None:
        return self._world_size

    @property
    def memory(self) -> MemoryRegression:
        return self._memory

    @property
    def schemes(self) -> tuple[Degrees, ...]:
        """Known schemes, in table order."""
        return tuple(self._costs)

    def recompute(self, scheme: Degrees) -> str:
        """The recompute mode ``scheme`` is costed with (``with_recompute``)."""
        return self._recompute.get(scheme, "none")

    def stage_cost(self, scheme: Degrees) -> StageCost:
        """Per-stage ``T(l)`` of ``scheme`` (with its recompute time); an unknown scheme raises
        ``CostModelError``."""
        try:
            return recompute_cost(self._costs[scheme], self.recompute(scheme))
        except KeyError:
            known = ", ".join(str(s) for s in self._costs)
            raise CostModelError(
                f"cost model {self._name!r} has no scheme {scheme}; known: {known}"
            ) from None

    def source(self, scheme: Degrees) -> str | None:
        """Where the scheme's entry came from (``"analytic"``, ...), None when the table does not say."""
        self.stage_cost(scheme)
        return self._sources.get(scheme)

    @property
    def extra(self) -> dict[str, Any]:
        """A copy of the table's extra fields (comments, ``comm_cost``, ``utilization_seqlen``)."""
        return json.loads(json.dumps(self._extra))

    def max_len(self, scheme: Degrees, world_size: int | None = None) -> int:
        """MaxLen (tokens per micro-batch, aligned down to 128) of a known scheme, DESIGN.md A5."""
        self.stage_cost(scheme)
        world = world_size if world_size is not None else self._world_size
        return self._memory.max_len(scheme.tp, scheme.pp, scheme.cp, world, self.recompute(scheme))

    def with_world_size(self, world_size: int) -> CostModel:
        """A copy whose MaxLen counts the optimizer shard of a ``world_size``-GPU world."""
        return CostModel(self._name, self._costs, self._memory, self._gpus_per_node, world_size, self._extra,
                         sources=self._sources, recompute=self._recompute)

    def with_gpu_memory(self, gpu_memory: float) -> CostModel:
        """A copy whose MaxLen is computed for ``gpu_memory`` bytes per device (a memory budget)."""
        memory = dataclasses.replace(self._memory, gpu_memory=float(gpu_memory))
        return CostModel(self._name, self._costs, memory, self._gpus_per_node, self._world_size, self._extra,
                         sources=self._sources, recompute=self._recompute)

    def with_recompute(self, recompute: str | Mapping[Degrees, str]) -> CostModel:
        """A copy costing every scheme (or each scheme of a mapping) with that recompute mode: its
        MaxLen grows and its ``T(l)`` gains the recompute time (``hgraph.planner.cost.recompute_cost``)."""
        return CostModel(self._name, self._costs, self._memory, self._gpus_per_node, self._world_size,
                         self._extra, sources=self._sources, recompute=recompute)

    def __repr__(self) -> str:
        world = f", world_size={self._world_size}" if self._world_size else ""
        return f"CostModel({self._name!r}, {len(self._costs)} schemes{world})"

    def __str__(self) -> str:
        lines = [repr(self)]
        for s, cost in self._costs.items():
            source = f"  [{self._sources[s]}]" if s in self._sources else ""
            lines.append(f"  {s!s:<14} {cost}  MaxLen {self.max_len(s)}{source}")
        return "\n".join(lines)

    # -- the table format -------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> CostModel:
        """One of the bundled tables: ``llama7b_a800``, ``llama13b_a800``, ``llama32b_a800``."""
        if name not in PRESETS:
            raise CostModelError(f"unknown cost model preset {name!r}; known: {', '.join(PRESETS)}")
        text = resources.files("hgraph.planner").joinpath("presets", f"{name}.json").read_text()
        return cls.from_table(json.loads(text), name=name)

    @classmethod
    def from_table(cls, table: str | Path | Mapping[str, Any], name: str | None = None) -> CostModel:
        """Build from a table (a dict, or the path of a JSON file), checking every field.

        Format: ``{"strategies": [{"tp", "pp", ["cp"], "a", "b", "c"}, ...], "memory_regression":
        {...}, "model_config": {"H", "L", "V"}, "cluster_config": {"gpus_per_node",
        "gpu_memory_bound", ["utilization_seqlen"], ["world_size"]}, ["comm_cost"]}``; keys that start
        with ``_`` are comments and are kept.
        """
        if isinstance(table, (str, Path)):
            path = Path(table)
            try:
                loaded = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise CostModelError(f"cost table {path} is not valid JSON: {exc}") from None
            return cls.from_table(loaded, name=name or path.stem)
        if not isinstance(table, Mapping):
            raise CostModelError(f"a cost table is a JSON object, got {type(table).__name__}")
        unknown = sorted(k for k in table if k not in _TOP_KEYS and not str(k).startswith("_"))
        if unknown:
            raise CostModelError(f"cost table has unknown keys {unknown}; allowed: {sorted(_TOP_KEYS)}")
        entries = get_field(table, "strategies", "")
        if not isinstance(entries, list) or not entries:
            raise CostModelError("cost table field strategies: expected a non-empty list of schemes")
        costs: dict[Degrees, StageCost] = {}
        sources: dict[Degrees, str] = {}
        for i, entry in enumerate(entries):
            scheme, cost = _read_entry(entry, f"strategies[{i}]")
            if scheme in costs:
                raise CostModelError(f"cost table field strategies[{i}]: scheme {scheme} appears twice")
            costs[scheme] = cost
            if "source" in entry:
                if not isinstance(entry["source"], str):
                    raise CostModelError(f"cost table field strategies[{i}].source: expected a string")
                sources[scheme] = entry["source"]
        cluster = get_section(table, "cluster_config")
        only_keys(cluster, "cluster_config", _CLUSTER_KEYS)
        extra: dict[str, Any] = {k: v for k, v in table.items() if str(k).startswith("_")}
        if "comm_cost" in table:
            comm = get_section(table, "comm_cost")
            extra["comm_cost"] = {k: number(v, f"comm_cost.{k}") for k, v in comm.items()}
        if "utilization_seqlen" in cluster:
            util = get_section(cluster, "utilization_seqlen", "cluster_config")
            extra["utilization_seqlen"] = {
                k: integer(v, f"cluster_config.utilization_seqlen.{k}") for k, v in util.items()
            }
        world = cluster.get("world_size")
        return cls(
            name=name or "table",
            stage_costs=costs,
            memory=MemoryRegression.from_table(table),
            gpus_per_node=integer(
                get_field(cluster, "gpus_per_node", "cluster_config"), "cluster_config.gpus_per_node"
            ),
            world_size=None if world is None else integer(world, "cluster_config.world_size"),
            extra=extra,
            sources=sources,
        )

    def to_table(self) -> dict[str, Any]:
        """The JSON table this model came from (round-trips through ``from_table``)."""
        strategies = []
        for s, cost in self._costs.items():
            entry: dict[str, Any] = {"tp": s.tp, "pp": s.pp}
            if s.cp > 1:
                entry["cp"] = s.cp
            if s.ep > 1:
                entry["ep"] = s.ep
            entry.update(a=cost.a, b=cost.b, c=cost.c)
            if s in self._sources:
                entry["source"] = self._sources[s]
            strategies.append(entry)
        table: dict[str, Any] = {"strategies": strategies, **self._memory.to_table()}
        gpu_memory = self._memory.gpu_memory
        cluster: dict[str, Any] = {
            "gpus_per_node": self._gpus_per_node,
            "gpu_memory_bound": int(gpu_memory) if gpu_memory.is_integer() else gpu_memory,
        }
        extra = json.loads(json.dumps(self._extra))
        if "utilization_seqlen" in extra:
            cluster["utilization_seqlen"] = extra.pop("utilization_seqlen")
        if self._world_size is not None:
            cluster["world_size"] = self._world_size
        table["cluster_config"] = cluster
        table.update(extra)
        return table

    def save(self, path: str | Path) -> None:
        """Write ``to_table()`` as JSON."""
        atomic_files.write_text(path, json.dumps(self.to_table(), indent=1) + "\n")


def _read_entry(entry: Any, where: str) -> tuple[Degrees, StageCost]:
    if not isinstance(entry, Mapping):
        raise CostModelError(f"cost table field {where}: expected an object, got {entry!r}")
    only_keys(entry, where, _ENTRY_KEYS)
    degrees = {k: integer(get_field(entry, k, where), f"{where}.{k}") for k in ("tp", "pp")}
    degrees["cp"] = integer(entry.get("cp", 1), f"{where}.cp")
    degrees["ep"] = integer(entry.get("ep", 1), f"{where}.ep")
    cost = StageCost(*(number(get_field(entry, k, where), f"{where}.{k}") for k in ("a", "b", "c")))
    try:
        return Degrees(degrees["tp"], degrees["pp"], degrees["cp"], ep=degrees["ep"]), cost
    except StrategyError as exc:
        raise CostModelError(f"cost table field {where}: {exc}") from None


def load_cost_model(name_or_path: str | Path) -> CostModel:
    """A preset by name, or a JSON table by path."""
    text = str(name_or_path)
    if text in PRESETS:
        return CostModel.preset(text)
    path = Path(text)
    if not path.exists():
        raise CostModelError(f"no cost table {text!r}: not a preset ({', '.join(PRESETS)}) and no such file")
    return CostModel.from_table(path)
