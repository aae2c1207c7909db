"""The overlap scheduler: when each rank starts and waits its Pull Parameters and Push Gradients.

With ``hgraph.compile(..., schedule="overlap")`` every rank runs a ``RankSchedule`` instead of
"all pulls, then 1F1B, then all pushes":

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
  iteration; the activation headers of the next forward are received early (posted one compute
  step ahead), so the sender never waits for the receiver to reach its step.

Everything here is decided from the program alone (no timing), so the order is deterministic.
``dry_run`` executes the per-rank communication order of all ranks of a strategy against each other
(collectives match by start order per group, point-to-point messages per pair) and raises
``ScheduleError`` on a mismatch or a wait that could never finish, before anything runs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional, Sequence

import torch
from torch import fx

from hgraph.products import Op as Op
from hgraph.products import OverlapConfig as OverlapConfig
from hgraph.products import RankSchedule as RankSchedule
from hgraph.products import layer_of as layer_of
from hgraph.runtime.reshard import comm_steps
from hgraph.actions import COMPUTE, Action, Kind, ScheduleError
from hgraph.actions import steps as action_steps

PULL_TAG, PUSH_TAG = 1, 2  # point-to-point tags of pull and push plans (activations: 0)


def first_use_order(program: Any) -> list[str]:
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


def holds(program: Any, pc: Any) -> bool:
    return any(h == (program.pipeline, program.stage) for h in pc.holders)


def _dst_bytes(pc: Any, rank: int) -> int:
    plan = pc.pull.plan
    if rank not in plan.dst.ranks:
        return 0
    return int(torch.Size(plan.dst.local_shape(rank)).numel()) * plan.itemsize


def build(program: Any, config: OverlapConfig) -> RankSchedule:
    """The overlap schedule of one rank (see the module docstring for the rules)."""
    pulls = program.pulls
    names = [pc.name for pc in pulls]
    index = {n: i for i, n in enumerate(names)}
    layers = layer_of(names)
    held = [holds(program, pc) for pc in pulls]
    used = [n for n in first_use_order(program) if n in index and held[index[n]]]
    nbytes = [_dst_bytes(pc, program.rank) if h else 0 for pc, h in zip(pulls, held)]
    started, waited = 0, set()
    inflight: list[int] = []  # held pulls started, not waited, oldest first

    def start_upto(last: int, ops: list[Op]) -> None:
        nonlocal started
        while started <= min(last, len(pulls) - 1):
            i = started
            cap = config.max_inflight_bytes
            while cap is not None and inflight and sum(nbytes[j] for j in inflight) + nbytes[i] > cap:
                j = inflight.pop(0)
                ops.append(("wait", j))
                waited.add(j)
            ops.append(("start", i))
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

    prelude: list[Op] = []
    first_layer = layers[index[used[0]]] if used else float("inf")
    start_upto(window_end(first_layer - 1) if used else len(pulls) - 1, prelude)
    at_use = []
    for name in used:
        i = index[name]
        ops: list[Op] = []
        start_upto(max(i, window_end(layers[i])), ops)
        if i not in waited:
            ops.append(("wait", i))
            waited.add(i)
            inflight.remove(i)
        at_use.append((name, tuple(ops)))
    after: list[Op] = []
    start_upto(len(pulls) - 1, after)
    for i in range(len(pulls)):  # held but unused by the forward graph: needed before the backward
        if held[i] and i not in waited:
            after.append(("wait", i))
            waited.add(i)
    at_end = tuple(("wait", i) for i in range(len(pulls)) if i not in waited)
    return RankSchedule(program.rank, tuple(prelude), tuple(at_use), tuple(after), at_end,
                        push_buckets(program, config), tuple(names))


def push_buckets(program: Any, config: OverlapConfig) -> tuple[tuple[int, ...], ...]:
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


# ----------------------------------------------------------------------------- graph rewrite
def overlap_graph(gm: fx.GraphModule, params: Sequence[str], use_param: Any) -> fx.GraphModule:
    """A copy of a stage graph where each parameter placeholder's first use goes through
    ``use_param(placeholder_name)`` (which waits its pull); the placeholders then receive ``None``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    params = set(params)
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.name not in params or not node.users:
            continue
        first = next(n for n in graph.nodes if n in node.users)
        with graph.inserting_before(first):
            ready = graph.call_function(use_param, (node.name,))
        node.replace_all_uses_with(ready, delete_user_cb=lambda n: n is not ready)
    graph.lint()
    return fx.GraphModule(gm, graph)


# ----------------------------------------------------------------------------- dry run
def rank_events(program: Any, sched: RankSchedule, num_micro_batches: int) -> list[tuple]:
    """The communication ``program`` issues with ``sched``, in order: ``("start", key, call)`` and
    ``("wait", key)``; ``call`` is ``("collective", kind, group)`` or ``("p2p", sends, recvs, tag)``.
    Mirrors ``runtime.executor`` (overlap mode) step by step."""
    rank = program.rank
    events: list[tuple] = []

    def plan_ops(kind: str, i: int, plan: Any, what: str) -> None:
        tag = PULL_TAG if kind == "pull" else PUSH_TAG
        calls = [(s, c if c[0] == "collective" else (*c, tag)) for s, c in comm_steps(plan, rank)]
        at_start = bool(calls) and calls[0][0]
        if what == "start":
            if at_start:
                events.append(("start", (kind, i, 0), calls[0][1]))
            return
        if at_start:
            events.append(("wait", (kind, i, 0)))
        for j, (_, call) in enumerate(calls[1:] if at_start else calls, 1 if at_start else 0):
            events.append(("start", (kind, i, j), call))
            events.append(("wait", (kind, i, j)))

    def pull_ops(ops: Sequence[Op]) -> None:
        for what, i in ops:
            plan_ops("pull", i, program.pulls[i].pull.plan, what)

    def start_pushes() -> None:
        for bucket in sched.buckets:
            for i in bucket:
                plan_ops("push", i, program.pushes[i].push.plan, "start")

    pull_ops(sched.prelude)
    sends: list[tuple] = []
    steps = action_steps(program.pipeline_actions(num_micro_batches))
    last_b = max((k for k, s in enumerate(steps) if s[0].kind is Kind.BACKWARD), default=None)
    first_f = True
    early: set[int] = set()
    for k, step in enumerate(steps):
        kind = step[0].kind
        if kind is Kind.FORWARD:
            if first_f:
                for _, ops in sched.at_use:
                    pull_ops(ops)
                pull_ops(sched.after_forward)
                first_f = False
        elif kind is Kind.BACKWARD:
            if k == last_b:
                start_pushes()
        else:
            hdr_out = tuple(a.peer for a in step if a.kind is Kind.SEND_ACT)
            hdr_in = tuple(a.peer for a in step if a.kind is Kind.RECV_ACT)
            out = tuple(a.peer for a in step if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD))
            inn = tuple(a.peer for a in step if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD))
            if hdr_out:  # activation headers (shapes) and data: sends are waited at the end
                events.append(("start", ("hsend", k), ("p2p", hdr_out, (), 0)))
                sends.append(("hsend", k))
            if hdr_in:
                if k not in early:
                    events.append(("start", ("hdr", k), ("p2p", (), hdr_in, 0)))
                early.discard(k)
                events.append(("wait", ("hdr", k)))
            if out:
                events.append(("start", ("send", k), ("p2p", out, (), 0)))
                sends.append(("send", k))
            if inn:
                events.append(("start", ("recv", k), ("p2p", (), inn, 0)))
                events.append(("wait", ("recv", k)))
            nxt = early_recv(steps, k)
            if nxt is not None:
                peer = next(a.peer for a in steps[k + 2] if a.kind is Kind.RECV_ACT)
                events.append(("start", ("hdr", k + 2), ("p2p", (), (peer,), 0)))
                early.add(k + 2)
    if first_f:
        for _, ops in sched.at_use:
            pull_ops(ops)
        pull_ops(sched.after_forward)
    if last_b is None:
        start_pushes()
    pull_ops(sched.at_end)
    events += [("wait", s) for s in sends]
    for bucket in sched.buckets:
        for i in bucket:
            plan_ops("push", i, program.pushes[i].push.plan, "wait")
    return events


def early_recv(steps: Sequence[tuple[Action, ...]], k: int) -> Optional[int]:
    """If comm step ``k`` is followed by one compute step and then a step that receives activations,
    the micro-batch whose activation headers are posted at the end of step ``k`` (receives early)."""
    if k + 2 >= len(steps) or steps[k + 1][0].kind not in COMPUTE:
        return None
    return next((a.mb for a in steps[k + 2] if a.kind is Kind.RECV_ACT), None)


def dry_run(events: dict[int, list[tuple]]) -> None:
    """Run every rank's event list against the others; raise ``ScheduleError`` if two ranks start
    different operations at the same position on a group, or some wait can never complete.

    A start never blocks. A collective's wait completes once every member started it; a
    point-to-point wait completes once each receive's matching send (same position on that pair)
    was started."""
    group_log: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    sent: dict[tuple[int, int, int], list] = defaultdict(list)  # per (src, dst, tag): message ids
    received: dict[tuple[int, int, int], int] = defaultdict(int)
    pending: dict[tuple[int, Any], list] = {}  # (rank, key) -> what its wait needs
    pos = {r: 0 for r in events}
    progress = True
    while progress:
        progress = False
        for rank, evs in events.items():
            while pos[rank] < len(evs):
                ev = evs[pos[rank]]
                if ev[0] == "start":
                    _, key, call = ev
                    if call[0] == "collective":
                        _, kind, group = call
                        log = group_log[tuple(group)]
                        slot = len(log[rank])
                        log[rank].append((key, kind))
                        for other, seq in log.items():
                            if other != rank and len(seq) > slot and seq[slot][1] != kind:
                                raise ScheduleError(
                                    f"collective order mismatch on group {tuple(group)} at position {slot}: "
                                    f"rank {rank} starts {kind} {key}, "
                                    f"rank {other} starts {seq[slot][1]} {seq[slot][0]}"
                                )
                            if other != rank and len(seq) > slot and seq[slot][0][:2] != key[:2]:
                                raise ScheduleError(
                                    f"collective order mismatch on group {tuple(group)} at position {slot}: "
                                    f"rank {rank} starts {key}, rank {other} starts {seq[slot][0]}"
                                )
                        pending[(rank, key)] = [("coll", tuple(group), slot)]
                    else:
                        _, outs, ins, tag = call
                        need = []
                        for dst in outs:
                            sent[(rank, dst, tag)].append(key[:2] if tag else None)
                        for src in ins:
                            received[(src, rank, tag)] += 1
                            channel = (src, rank, tag)
                            need.append(("p2p", channel, received[channel], key[:2] if tag else None))
                        pending[(rank, key)] = need
                else:
                    need = pending.get((rank, ev[1]), [])
                    if not all(_satisfied(n, group_log, sent) for n in need):
                        break
                pos[rank] += 1
                progress = True
    stuck = {r: events[r][pos[r]] for r in events if pos[r] < len(events[r])}
    if stuck:
        detail = "; ".join(f"rank {r} waits {ev[1]}" for r, ev in sorted(stuck.items()))
        raise ScheduleError(f"overlap schedule would hang: {detail}")


def _satisfied(need: tuple, group_log: dict, sent: dict) -> bool:
    if need[0] == "coll":
        _, group, slot = need
        log = group_log[group]
        return all(len(log[m]) > slot for m in group)
    _, channel, count, ident = need
    log = sent[channel]
    if len(log) < count:
        return False
    if log[count - 1] != ident:
        src, dst, tag = channel
        raise ScheduleError(
            f"point-to-point order mismatch from rank {src} to rank {dst} (tag {tag}): message {count - 1} "
            f"is {log[count - 1]} on the sender but {ident} on the receiver"
        )
    return True


def check(
    programs: Sequence[Any], schedules: Sequence[RankSchedule], num_micro_batches: Sequence[int]
) -> None:
    """Dry-run the overlap schedules of every rank of one strategy (``num_micro_batches`` per rank)."""
    dry_run({p.rank: rank_events(p, s, m) for p, s, m in zip(programs, schedules, num_micro_batches)})
