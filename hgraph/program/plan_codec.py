"""Compile products as plain data: the Pull / Push plans of ``hgraph.compile`` to JSON and back.

The compile cache (``hgraph.compiler.compile_cache``) stores what ``encode_plans`` returns and rebuilds the
products with ``decode_plans``; nothing is unpickled and nothing read is executed. The data are the
frozen dataclasses' fields, each distinct value written once and referred to by its index, so the
layers that share a layout or a plan share it again after decoding:

* ``topologies``: ``[ranks_per_node, intra_bandwidth, intra_latency, inter_bandwidth, inter_latency]``;
* ``layouts``: ``{"shape", "ranks", "mesh", "placements"}`` (placements in their string form,
  ``S(0)``, ``S(0:8+4+4)``, ``R``, ``P``) or a union ``{"hetero", "layouts": [index, ...]}``;
* ``plans``: a ``RankPlan`` or ``ReshardPlan`` with its ``src`` / ``dst`` layout indices and its steps,
  each a list tagged by kind: ``["copy", rank, box, accumulate]``, ``["send", src, dst, box, phase,
  accumulate]``, ``["all_gather", group, dim, box, chunks]``, ``["reduce_scatter", group, dim, box,
  chunks]``, ``["all_reduce", group, box]``, ``["all_to_all", group, src_dim, dst_dim, boxes]``;
* ``programs``: ``[strategy index, rank, {parameter: {"holders", "pull", "push"}}]``, a pull or push
  being ``{"kind", "tensor", "src", "dst", "bytes", "plan", "direction"}`` (layout and plan indices).

``decode_plans`` checks every field's type and every reference and raises ``EntryError`` on anything
else (the cache then reports the entry and rebuilds it); layouts and topologies are rebuilt through
their constructors, which validate them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Union

from hgraph.core.layout import AnyLayout, Layout, LayoutUnion
from hgraph.core.placement import parse_placement
from hgraph.lnk.plan import AllGather, AllReduce, AllToAll, LocalCopy, ReduceScatter, ReshardPlan, Step, Transfer
from hgraph.lnk.rank_plan import RankPlan
from hgraph.lnk.topology import Topology
from hgraph.program.products import ACTIVATION, PULL, PUSH, CommSubgraph, ParameterComm

Plans = dict[tuple[int, int], dict[str, ParameterComm]]  # (strategy index, rank) -> parameter -> comm


class EntryError(ValueError):
    """Data that are not an encoding of compile products (names what is wrong where)."""


# ---------------------------------------------------------------------------------------- encoding
class _Table:
    """Distinct values in first-seen order; ``index`` adds a value (encoded by ``encode``) once."""

    def __init__(self, encode: Callable[[Any], Any]) -> None:
        self.encode, self.rows, self._by_id, self._by_value = encode, [], {}, {}

    def index(self, value: Any) -> int:
        found = self._by_id.get(id(value))
        if found is None:
            found = self._by_value.get(value)
            if found is None:
                row = self.encode(value)  # may add the values it refers to first
                found = self._by_value[value] = len(self.rows)
                self.rows.append(row)
            self._by_id[id(value)] = found
        return found


def _boxes(boxes: Any) -> list:
    return [list(map(list, box)) for box in boxes]


def _step(step: Step) -> list:
    if isinstance(step, LocalCopy):
        return ["copy", step.rank, list(map(list, step.box)), step.accumulate]
    if isinstance(step, Transfer):
        return ["send", step.src, step.dst, list(map(list, step.box)), step.phase, step.accumulate]
    if isinstance(step, (AllGather, ReduceScatter)):
        kind = "all_gather" if isinstance(step, AllGather) else "reduce_scatter"
        return [kind, list(step.group), step.dim, list(map(list, step.box)), list(map(list, step.chunks))]
    if isinstance(step, AllReduce):
        return ["all_reduce", list(step.group), list(map(list, step.box))]
    if isinstance(step, AllToAll):
        return ["all_to_all", list(step.group), step.src_dim, step.dst_dim, [_boxes(row) for row in step.boxes]]
    raise TypeError(f"no encoding for plan step {step!r}")


def encode_plans(plans: Plans) -> dict[str, Any]:
    """``plans`` as JSON-ready data (see the module docstring)."""
    topologies = _Table(lambda t: [t.ranks_per_node, t.intra_bandwidth, t.intra_latency,
                                   t.inter_bandwidth, t.inter_latency])

    def layout(lay: AnyLayout) -> dict[str, Any]:
        if isinstance(lay, LayoutUnion):
            return {"hetero": lay.hetero, "layouts": [layouts.index(inner) for inner in lay.layouts]}
        return {"shape": list(lay.shape), "ranks": list(lay.ranks), "mesh": list(lay.mesh),
                "placements": [str(p) for p in lay.placements]}

    layouts = _Table(layout)

    def plan(p: Union[RankPlan, ReshardPlan]) -> dict[str, Any]:
        row = {"src": layouts.index(p.src), "dst": layouts.index(p.dst), "itemsize": p.itemsize,
               "steps": [_step(s) for s in p.steps], "lower_bound_bytes": p.lower_bound_bytes,
               "topology": topologies.index(p.topology), "noop": p.noop}
        if isinstance(p, RankPlan):
            row.update(rank=p.rank, first=sorted(p.first), bytes_moved=p.bytes_moved, local=p.local)
        return row

    plan_rows = _Table(plan)

    def comm(sub: CommSubgraph) -> dict[str, Any]:
        assert sub.plan is not None and not isinstance(sub.src, str) and not isinstance(sub.dst, str), sub
        return {"kind": sub.kind, "tensor": sub.tensor, "src": layouts.index(sub.src), "dst": layouts.index(sub.dst),
                "bytes": sub.bytes, "plan": plan_rows.index(sub.plan), "direction": sub.direction}

    programs = [[index, rank, {name: {"holders": [list(h) for h in pc.holders], "pull": comm(pc.pull),
                                      "push": comm(pc.push)} for name, pc in comms.items()}]
                for (index, rank), comms in plans.items()]
    return {"topologies": topologies.rows, "layouts": layouts.rows, "plans": plan_rows.rows, "programs": programs}


# ---------------------------------------------------------------------------------------- decoding
def _fail(where: str, expected: str, value: Any) -> EntryError:
    text = repr(value)
    return EntryError(f"{where}: expected {expected}, got {text[:60] + '...' if len(text) > 60 else text}")


def _int(value: Any, where: str) -> int:
    if type(value) is not int:
        raise _fail(where, "an integer", value)
    return value


def _float(value: Any, where: str) -> float:
    if type(value) not in (int, float):
        raise _fail(where, "a number", value)
    return float(value)


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _fail(where, "true or false", value)
    return value


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _fail(where, "a string", value)
    return value


def _list(value: Any, where: str, length: int = -1) -> list:
    if type(value) is not list or (length >= 0 and len(value) != length):
        raise _fail(where, "a list" + (f" of {length}" if length >= 0 else ""), value)
    return value


def _dict(value: Any, where: str, keys: frozenset[str]) -> dict:
    if type(value) is not dict or value.keys() != keys:
        raise _fail(where, "an object with keys " + ", ".join(sorted(keys)), value)
    return value


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if type(value) is not list or any(type(v) is not int for v in value):
        raise _fail(where, "a list of integers", value)
    return tuple(value)


def _pairs(value: Any, where: str) -> tuple[tuple[int, int], ...]:
    """A box (``[[start, stop], ...]``) or a list of chunk bounds."""
    if type(value) is not list:
        raise _fail(where, "a list of [start, stop] pairs", value)
    out = []
    for pair in value:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int or type(pair[1]) is not int:
            raise _fail(where, "a list of [start, stop] pairs", value)
        out.append((pair[0], pair[1]))
    return tuple(out)


def _decode_step(row: Any, where: str = "step") -> Step:
    kind = row[0] if type(row) is list and row else None
    if kind == "copy":
        _, rank, box, accumulate = _list(row, where, 4)
        return LocalCopy(_int(rank, where), _pairs(box, where), _bool(accumulate, where))
    if kind == "send":
        _, src, dst, box, phase, accumulate = _list(row, where, 6)
        if phase not in ("A", "B"):
            raise _fail(where, "phase 'A' or 'B'", phase)
        return Transfer(_int(src, where), _int(dst, where), _pairs(box, where), phase, _bool(accumulate, where))
    if kind in ("all_gather", "reduce_scatter"):
        _, group, dim, box, chunks = _list(row, where, 5)
        cls = AllGather if kind == "all_gather" else ReduceScatter
        return cls(_ints(group, where), _int(dim, where), _pairs(box, where), _pairs(chunks, where))
    if kind == "all_reduce":
        _, group, box = _list(row, where, 3)
        return AllReduce(_ints(group, where), _pairs(box, where))
    if kind == "all_to_all":
        _, group, src_dim, dst_dim, boxes = _list(row, where, 5)
        grid = tuple(tuple(_pairs(box, where) for box in _list(r, where)) for r in _list(boxes, where))
        return AllToAll(_ints(group, where), _int(src_dim, where), _int(dst_dim, where), grid)
    raise _fail(where, "a step tagged copy, send, all_gather, reduce_scatter, all_reduce or all_to_all", row)


_TOP = frozenset({"topologies", "layouts", "plans", "programs"})
_LAYOUT = frozenset({"shape", "ranks", "mesh", "placements"})
_UNION = frozenset({"hetero", "layouts"})
_FULL_PLAN = frozenset({"src", "dst", "itemsize", "steps", "lower_bound_bytes", "topology", "noop"})
_RANK_PLAN = _FULL_PLAN | {"rank", "first", "bytes_moved", "local"}
_COMM = frozenset({"kind", "tensor", "src", "dst", "bytes", "plan", "direction"})
_PARAMETER = frozenset({"holders", "pull", "push"})


def _ref(table: list, value: Any, where: str) -> Any:
    if type(value) is not int or not 0 <= value < len(table):
        raise _fail(where, f"an index below {len(table)}", value)
    return table[value]


def decode_plans(data: Any) -> Plans:
    """The products ``encode_plans`` encoded; ``EntryError`` on data of any other shape."""
    data = _dict(data, "entry", _TOP)
    topologies = []
    for i, row in enumerate(_list(data["topologies"], "topologies")):
        where = f"topologies[{i}]"
        rpn, *rates = _list(row, where, 5)
        topologies.append(Topology(_int(rpn, where), *(_float(r, where) for r in rates)))
    layouts: list[AnyLayout] = []
    placement = functools.lru_cache(maxsize=None)(parse_placement)  # few distinct strings, many layouts
    for i, row in enumerate(_list(data["layouts"], "layouts")):
        where = f"layouts[{i}]"
        if type(row) is dict and row.keys() == _UNION:
            parts = tuple(_ref(layouts, j, where) for j in _list(row["layouts"], where))
            layouts.append(LayoutUnion(parts, _str(row["hetero"], where)))
            continue
        row = _dict(row, where, _LAYOUT)
        placements = tuple(placement(_str(p, where)) for p in _list(row["placements"], where))
        layouts.append(Layout(_ints(row["shape"], where), _ints(row["ranks"], where), _ints(row["mesh"], where),
                              placements))
    plans: list[Union[RankPlan, ReshardPlan]] = []
    for i, row in enumerate(_list(data["plans"], "plans")):
        where = f"plans[{i}]"
        is_rank = type(row) is dict and "rank" in row
        row = _dict(row, where, _RANK_PLAN if is_rank else _FULL_PLAN)
        src, dst = _ref(layouts, row["src"], where + ".src"), _ref(layouts, row["dst"], where + ".dst")
        try:
            steps = tuple(map(_decode_step, _list(row["steps"], where)))
        except EntryError as exc:
            raise EntryError(f"{where}.steps: {exc}") from None
        common = dict(itemsize=_int(row["itemsize"], where), steps=steps,
                      lower_bound_bytes=_int(row["lower_bound_bytes"], where),
                      topology=_ref(topologies, row["topology"], where + ".topology"), noop=_bool(row["noop"], where))
        if is_rank:
            first = frozenset(_ints(row["first"], where + ".first"))
            plans.append(RankPlan(src, dst, rank=_int(row["rank"], where), first=first,
                                  bytes_moved=_int(row["bytes_moved"], where), local=_bool(row["local"], where),
                                  **common))
        else:
            plans.append(ReshardPlan(src, dst, **common))

    def comm(row: Any, where: str) -> CommSubgraph:
        row = _dict(row, where, _COMM)
        plan = _ref(plans, row["plan"], where + ".plan")
        if row["kind"] not in (PULL, PUSH, ACTIVATION) or row["direction"] not in ("forward", "backward"):
            raise _fail(where, "a pull, push or activation, forward or backward", (row["kind"], row["direction"]))
        return CommSubgraph(row["kind"], _str(row["tensor"], where), _ref(layouts, row["src"], where + ".src"),
                            _ref(layouts, row["dst"], where + ".dst"), _int(row["bytes"], where), plan, row["direction"])

    out: Plans = {}
    for i, row in enumerate(_list(data["programs"], "programs")):
        where = f"programs[{i}]"
        index, rank, params = _list(row, where, 3)
        if type(params) is not dict:
            raise _fail(where, "an object of parameters", params)
        comms = {}
        for name, value in params.items():
            at = f"{where}.{name}"
            value = _dict(value, at, _PARAMETER)
            holders = tuple(_pairs(value["holders"], at + ".holders"))
            comms[name] = ParameterComm(name, holders, comm(value["pull"], at + ".pull"), comm(value["push"], at + ".push"))
        out[(_int(index, where), _int(rank, where))] = comms
    return out
