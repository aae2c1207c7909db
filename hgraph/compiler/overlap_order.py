"""The overlap order: when each rank starts and waits its Pull Parameters and Push Gradients.

With ``hgraph.compile(..., schedule="overlap")`` every rank runs its pulls and pushes in the order
``overlap_order`` emits (a ``PullPushOrder`` of actions) instead of "all pulls, then 1F1B, then all
pushes":

* **Pulls** start in the global layer order (the same on every rank, so collectives match) and are
  prefetched ``prefetch_layers`` layers ahead of the layer being computed. Each wait is sunk to just
  before the first use of the parameter inside the first forward (``overlap_graph`` puts a wait node
  there), so layer ``k`` computes while layer ``k + 1 ... k + d`` arrive. ``max_inflight_bytes``
  caps the received bytes in flight on a rank (older pulls are waited first). Pulls a rank only
  sends (it does not compute with the parameter) start as early as possible and are waited at the
  end of the iteration.
* **Pushes** are cut into buckets of at least ``bucket_bytes`` (consecutive in reverse layer order;
  a bucket is a unit of start, the plans stay separate so sums are bit-identical) and start in that
  order during the last backward, as soon as every gradient of the bucket is final (a
  post-accumulate-grad hook); all are waited at the end.
* **Pipeline sends** (activation headers and data) are asynchronous, waited at the end of the
  iteration (as under ``schedule="none"``).

Everything here is decided from the program alone (no timing), so the order is deterministic: the
compiler's ``schedule`` step computes it (``overlap_order``) when it builds the ``RankProgram``, and
``RankProgram.actions`` places it around the rank's pipeline actions (``hgraph.schedule.lowerings.place``),
which the one executor runs and the one dry run (``hgraph.schedule.replay.dry_run``, through
``CompiledModel.check_actions``) checks against every other rank before anything runs.
"""

from __future__ import annotations

import torch

from hgraph.core.layer_names import layer_runs
from hgraph.program.options import OverlapConfig
from hgraph.program.products import ParameterComm
from hgraph.program.rank_program import RankProgram
from hgraph.schedule.actions import Action, Kind
from hgraph.schedule.lowerings import PullPushOrder


def first_use_order(program: RankProgram) -> list[str]:
    """Parameter names in the order the stage forward first uses them."""
    params = set(program.stage_graph.params)
    seen: dict[str, None] = {}
    for node in program.stage_graph.gm.graph.nodes:
        if node.op == "placeholder":
            continue
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" and arg.name in params:
                seen.setdefault(program.param_of_placeholder[arg.name], None)
    return list(seen)


def holds(program: RankProgram, pc: ParameterComm) -> bool:
    return any(h == (program.pipeline, program.stage) for h in pc.holders)


def _dst_bytes(pc: ParameterComm, rank: int) -> int:
    plan = pc.pull.plan
    if rank not in plan.dst.ranks:
        return 0
    return int(torch.Size(plan.dst.local_shape(rank)).numel()) * plan.itemsize


def overlap_order(program: RankProgram, config: OverlapConfig) -> PullPushOrder:
    """The overlap order of one rank's program as actions (see the module docstring for the rules):
    pull waits at a parameter's first use are attached to the first forward (``at`` the parameter),
    push starts to the last backward (``at`` the first push of their bucket)."""
    pulls = program.pulls
    names = [pc.name for pc in pulls]
    index = {n: i for i, n in enumerate(names)}
    layers = layer_runs(names)
    held = [holds(program, pc) for pc in pulls]
    used = [n for n in first_use_order(program) if n in index and held[index[n]]]
    nbytes = [_dst_bytes(pc, program.rank) if h else 0 for pc, h in zip(pulls, held)]
    started, waited = 0, set()
    inflight: list[int] = []  # held pulls started, not waited, oldest first

    def start(i: int, at: str | None = None) -> Action:
        return Action(Kind.PULL_START, group=names[i], at=at)

    def wait(i: int, at: str | None = None) -> Action:
        return Action(Kind.PULL_WAIT, group=names[i], at=at)

    def start_upto(last: int, ops: list[Action], at: str | None = None) -> None:
        nonlocal started
        while started <= min(last, len(pulls) - 1):
            i = started
            cap = config.max_inflight_bytes
            while cap is not None and inflight and sum(nbytes[j] for j in inflight) + nbytes[i] > cap:
                j = inflight.pop(0)
                ops.append(wait(j, at))
                waited.add(j)
            ops.append(start(i, at))
            if held[i]:
                inflight.append(i)
            started += 1

    def window_end(layer: float) -> int:
        """Index of the last pull whose layer is within ``prefetch_layers`` after ``layer``."""
        last = -1
        for i, lay in enumerate(layers):
            if lay <= layer + config.prefetch_layers:
                last = i
        return last

    prelude: list[Action] = []
    first_layer = layers[index[used[0]]] if used else float("inf")
    start_upto(window_end(first_layer - 1) if used else len(pulls) - 1, prelude)
    forward: list[Action] = []  # attached at each parameter's first use, then after the forward
    for name in used:
        i = index[name]
        start_upto(max(i, window_end(layers[i])), forward, name)
        if i not in waited:
            forward.append(wait(i, name))
            waited.add(i)
            inflight.remove(i)
    start_upto(len(pulls) - 1, forward)
    for i in range(len(pulls)):  # held but unused by the forward graph: needed before the backward
        if held[i] and i not in waited:
            forward.append(wait(i))
            waited.add(i)
    end = [wait(i) for i in range(len(pulls)) if i not in waited]  # the pulls this rank only sends
    pushes = [pc.name for pc in program.pushes]
    buckets = push_buckets(program, config)
    backward = [Action(Kind.PUSH_START, group=pushes[i], at=pushes[b[0]]) for b in buckets for i in b]
    end += [Action(Kind.PUSH_WAIT, group=pushes[i]) for b in buckets for i in b]
    return PullPushOrder(tuple(prelude), tuple(forward), tuple(backward), tuple(end))


def push_buckets(program: RankProgram, config: OverlapConfig) -> tuple[tuple[int, ...], ...]:
    """Consecutive pushes (reverse layer order) grouped until a bucket holds ``bucket_bytes``; the
    same on every rank (it uses global tensor bytes)."""
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for i, pc in enumerate(program.pushes):
        current.append(i)
        size += int(pc.push.bytes)
        if size >= config.bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)
