"""Context parallelism in the cost model: cp schemes derived from a table's own cp = 1 entries.

The published tables were measured for (tp, pp) schemes only. ``with_context_parallel(model, (1, 2,
4))`` adds, for every (tp, pp) entry and every cp degree, the scheme (tp, pp, cp) with an **analytic**
``T(l)`` (each such entry says ``"source": "analytic-cp"``; a scheme the table lists already, e.g.
profiled by ``hgraph profile --schemes tp1,cp2``, keeps its own entry). A micro-batch's tokens are
split over the cp ranks in ``2·cp`` load-balanced chunks (the runtime's zigzag layout,
``hgraph.core.batch.cp_chunk_indices``), so every rank does ``1/cp`` of the causal attention and of
every per-token term, and the ranks exchange K and V in a ring::

    a_cp = a / cp
    b_cp = b / cp + ring_ms_per_token
    c_cp = c + Ls · 3·(cp − 1) · latency

    ring_ms_per_token = Ls · 3·(cp − 1)/cp · 2·2·H_kv/tp bytes / bandwidth

per stage of ``Ls = ceil(L/pp)`` layers: forward sends the local K and V chunk (bf16, ``H_kv/tp``
wide) ``cp − 1`` times, backward sends K, V and their gradients (twice that). ``bandwidth`` and
``latency`` are those of the slowest link of the cp ring in the LNK topology model
(``hgraph.lnk.topology.Topology``, ``gpus_per_node`` from the table; pipelines placed node-aligned, as
the proposal places them): NVLink while ``tp·cp`` fits in a node, the NIC beyond. The exchange is
counted as not overlapped with attention, so the analytic time is an upper bound of that model.
MaxLen of a cp scheme is the table's memory regression with the tokens split cp ways
(``hgraph.planner.memory``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from hgraph.errors import CostModelError
from hgraph.lnk.topology import Topology
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel, StageCost

ANALYTIC = "analytic-cp"
BF16 = 2


def ring_link(topology: Topology, tp: int, cp: int) -> tuple[float, float]:
    """``(latency s, bandwidth bytes/s)`` of the slowest link of the cp ring of a stage placed at rank 0
    (stage ranks in row-major ``(cp, tp)`` order: ring members ``0, tp, 2·tp, ...``)."""
    members = [k * tp for k in range(cp)]
    links = [topology.link(a, b) for a, b in zip(members, members[1:] + members[:1])]
    return max(links, key=lambda link: link[0] + 1.0 / link[1])


def cp_stage_cost(
    base: StageCost, tp: int, pp: int, cp: int, layers: int, kv_hidden: int, topology: Topology
) -> StageCost:
    """The analytic ``T(l)`` of scheme (tp, pp, cp) from the (tp, pp) entry ``base`` (module docstring)."""
    if cp == 1:
        return base
    stage_layers = math.ceil(layers / pp)
    latency, bandwidth = ring_link(topology, tp, cp)
    ring_bytes = stage_layers * 3 * (cp - 1) / cp * 2 * BF16 * kv_hidden / tp
    ring_ms = ring_bytes / bandwidth * 1e3
    return StageCost(base.a / cp, base.b / cp + ring_ms, base.c + stage_layers * 3 * (cp - 1) * latency * 1e3)


def parse_degrees(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; anything else raises ``CostModelError`` naming the flag."""
    try:
        degrees = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        degrees = ()
    if not degrees or degrees[0] < 1:
        raise CostModelError(f"--context-parallel {text!r}: give cp degrees >= 1, e.g. 1,2,4")
    return degrees


def with_context_parallel(
    cost_model: CostModel,
    degrees: Iterable[int],
    topology: Topology | None = None,
    kv_hidden: int | None = None,
) -> CostModel:
    """A copy of ``cost_model`` whose schemes are those with cp in ``degrees`` (1 keeps the table's
    plain schemes), cp > 1 ones derived from the (tp, pp) entries when the table does not list them.

    ``topology`` defaults to the LNK model's figures with the table's ``gpus_per_node``; ``kv_hidden``
    (the K/V projection width) defaults to the hidden size (multi-head attention, as in the tables).
    """
    wanted = sorted(set(degrees))
    if not wanted or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in wanted):
        raise CostModelError(f"context-parallel degrees {list(degrees)!r}; give integers >= 1, e.g. (1, 2, 4)")
    topo = topology or Topology(ranks_per_node=cost_model.gpus_per_node)
    config = cost_model.to_table()["model_config"]
    layers, width = int(config["L"]), int(kv_hidden or config["H"])
    costs: dict[Degrees, StageCost] = {}
    sources: dict[Degrees, str] = {}
    for scheme in cost_model.schemes:
        if scheme.cp in wanted:
            costs[scheme] = cost_model.stage_cost(scheme)
            if cost_model.source(scheme):
                sources[scheme] = cost_model.source(scheme)
    for scheme in cost_model.schemes:
        if scheme.cp != 1 or scheme.ep != 1:
            continue
        for cp in wanted:
            derived = Degrees(scheme.tp, scheme.pp, cp)
            if cp > 1 and derived not in costs:
                costs[derived] = cp_stage_cost(cost_model.stage_cost(scheme), scheme.tp, scheme.pp, cp, layers, width, topo)
                sources[derived] = ANALYTIC
    if not costs:
        raise CostModelError(
            f"cost model {cost_model.name!r} has no scheme with cp in {wanted} and no cp = 1 entry to derive one from"
        )
    extra = cost_model.extra
    if any(v == ANALYTIC for v in sources.values()):
        extra["_context_parallel"] = (
            f"Entries marked source={ANALYTIC!r} are analytic: the cp = 1 entry's a and b split over cp, plus "
            f"the ring K/V exchange at the slowest ring link of {topo} (not overlapped); "
            "see hgraph.planner.context."
        )
    return CostModel(
        cost_model.name, costs, cost_model.memory, cost_model.gpus_per_node, cost_model.world_size, extra, sources
    )
