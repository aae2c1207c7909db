"""One rank's iteration under the overlap schedule (``schedule="overlap"``; see ``passes/schedule.py``).

The arithmetic is exactly that of ``executor.run_iteration`` (same programs, same plans, same
summation orders), only the moments at which communication is started and waited differ, so the
results are bit-identical. Pulls run asynchronously from the prelude and are waited inside the first
forward at each parameter's first use; pushes start in bucket order during the last backward as soon
as their gradients are final; pipeline sends are waited at the end of the iteration.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

import torch

from hgraph.actions import Action, Kind
from hgraph.actions import steps as action_steps
from hgraph.passes.schedule import PULL_TAG, PUSH_TAG, RankSchedule, early_recv, holds, overlap_graph
from hgraph.runtime.comm import Handle
from hgraph.runtime.context import current
from hgraph.runtime.failures import comm_step
from hgraph.runtime.reshard import start
from hgraph.runtime.stage import HEADER, IterationOutput, StageState, from_header, send_header, shards_device

_ACTIVE = threading.local()  # the running _Pulls of this thread (simulated ranks are threads)


def _use_param(placeholder: str) -> torch.Tensor:
    """Graph node of ``overlap_graph``: the pulled parameter, waiting its pull at its first use."""
    return _ACTIVE.pulls.use(placeholder)


class _Pulls:
    """Starts and waits Pull Parameter plans as the rank schedule says; records them on the timeline."""

    def __init__(
        self, program: Any, sched: RankSchedule, shards: dict[str, torch.Tensor], timeline: Any
    ) -> None:
        self.program, self.sched, self.shards, self.timeline = program, sched, shards, timeline
        self.comm = current().comm
        self.handles: dict[int, tuple[Handle, float]] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.pending = dict(sched.at_use)

    def run(self, ops: Sequence[tuple[str, int]]) -> None:
        for what, i in ops:
            pc = self.program.pulls[i]
            if what == "start":
                src = self.shards[pc.name]
                if self.program.compute_dtype is not None:
                    src = src.to(self.program.compute_dtype)
                self.handles[i] = (start(pc.pull.plan, src, self.comm, tag=PULL_TAG), time.time())
                continue
            if i not in self.handles:  # reaped already (a pull this rank only sends)
                continue
            handle, began = self.handles.pop(i)
            t0 = time.time()
            with comm_step(self.program.rank, f"pull_parameter {pc.name} (ranks {list(pc.pull.plan.ranks)})"):
                out = handle.wait()
            if self.timeline is not None:
                end = time.time()
                self.timeline.add("wait", f"pull {pc.name}", t0, end)
                self.timeline.add("pull_parameter", pc.name, began, end)
            if out is not None and holds(self.program, pc):
                self.params[pc.name] = out.detach().requires_grad_(True)

    def reap(self) -> None:
        """Complete the pulls this rank only sends that have finished (no blocking, nothing issued),
        so their buffers go and the timeline shows when they ended."""
        for i, (handle, began) in list(self.handles.items()):
            pc = self.program.pulls[i]
            if not holds(self.program, pc) and handle.ready():
                del self.handles[i]
                handle.wait()
                if self.timeline is not None:
                    self.timeline.add("pull_parameter", pc.name, began, time.time())

    def use(self, placeholder: str) -> torch.Tensor:
        name = self.program.param_of_placeholder[placeholder]
        ops = self.pending.pop(name, None)
        if ops:
            self.run(ops)
        return self.params[name]


class _Pushes:
    """Starts Push Gradient buckets in order once all their gradients are final; waits them at the end."""

    def __init__(
        self, program: Any, sched: RankSchedule, params: dict[str, torch.Tensor], timeline: Any,
        device: torch.device,
    ) -> None:
        self.program, self.sched, self.params, self.timeline = program, sched, params, timeline
        self.device = device  # for push buffers on ranks that hold no gradient
        self.comm = current().comm
        self.ready = {i for i, pc in enumerate(program.pushes) if pc.name not in params}
        self.next_bucket = 0
        self.handles: list[tuple[int, Handle, float]] = []
        self.results: dict[int, Any] = {}
        self.armed = False
        self.hooks = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._final(i))
            for i, pc in enumerate(program.pushes)
            if (p := params.get(pc.name)) is not None
        ]

    def _final(self, i: int) -> None:
        if self.armed:
            self.ready.add(i)
            self.advance()

    def arm(self) -> None:
        """From now on a gradient that is accumulated is final (the last backward begins)."""
        self.armed = True
        self.advance()

    def advance(self, everything: bool = False) -> None:
        buckets = self.sched.buckets
        while self.next_bucket < len(buckets):
            bucket = buckets[self.next_bucket]
            if not everything and not all(i in self.ready for i in bucket):
                break
            for i in bucket:
                pc = self.program.pushes[i]
                grad = self.program.push_source(self.params.get(pc.name))
                handle = start(pc.push.plan, grad, self.comm, dtype=self.program.push_dtype, device=self.device,
                               tag=PUSH_TAG)
                self.handles.append((i, handle, time.time()))
            self.next_bucket += 1

    def reap(self) -> None:
        """Complete the pushes that have finished (no blocking, nothing issued)."""
        for i, handle, began in self.handles:
            if i not in self.results and handle.ready():
                self.results[i] = handle.wait()
                if self.timeline is not None:
                    self.timeline.add("push_gradient", self.program.pushes[i].name, began, time.time())

    def finish(self, shards: dict[str, torch.Tensor]) -> dict[str, Optional[torch.Tensor]]:
        self.advance(everything=True)
        for h in self.hooks:
            h.remove()
        out: dict[str, Optional[torch.Tensor]] = {}
        for i, handle, began in self.handles:
            pc = self.program.pushes[i]
            if i in self.results:
                shard = self.results[i]
                out[pc.name] = None if shard is None else shard.to(shards[pc.name].dtype)
                continue
            t0 = time.time()
            with comm_step(self.program.rank, f"push_gradient {pc.name} (ranks {list(pc.push.plan.ranks)})"):
                shard = handle.wait()
            if self.timeline is not None:
                end = time.time()
                self.timeline.add("wait", f"push {pc.name}", t0, end)
                self.timeline.add("push_gradient", pc.name, began, end)
            out[pc.name] = None if shard is None else shard.to(shards[pc.name].dtype)
        return {pc.name: out[pc.name] for pc in self.program.pushes}


def run_iteration_overlap(
    program: Any,
    sched: RankSchedule,
    shards: dict[str, torch.Tensor],
    micro_batches: Sequence[dict[str, torch.Tensor]],
    loss_scale: float,
    timeline: Any = None,
) -> Any:
    """``executor.run_iteration`` with the overlap schedule ``sched``; same results, bit for bit."""
    comm = current().comm
    sg = program.stage_graph
    device = shards_device(shards)
    gm = _overlap_module(program)
    pulls = _Pulls(program, sched, shards, timeline)
    _ACTIVE.pulls = pulls
    pulls.run(sched.prelude)
    state = StageState(sg, loss_scale)
    received, outputs, grads_in = state.received, state.outputs, state.grads_in
    sends: list[tuple[Handle, float, str]] = []
    steps = action_steps(program.pipeline_actions(len(micro_batches)))
    last_b = max((k for k, s in enumerate(steps) if s[0].kind is Kind.BACKWARD), default=None)
    pushes: Optional[_Pushes] = None
    first_forward = True

    def forward(mb: int) -> None:
        nonlocal first_forward
        # Parameters are None here: the wait nodes of this graph copy fill them at first use.
        outs = gm(*([None] * len(sg.params)), *state.data_args(micro_batches[mb], mb))
        if first_forward:
            pulls.run(sched.after_forward)
            first_forward = False
        state.record(mb, outs)

    backward = state.backward

    early: dict[int, tuple[Handle, list]] = {}  # step index -> activation headers received early

    def reap() -> None:
        """Complete whatever finished in the background (never blocks, issues nothing)."""
        pulls.reap()
        if pushes is not None:
            pushes.reap()
        for entry in [e for e in sends if e[0].ready()]:
            sends.remove(entry)
            entry[0].wait()
            if timeline is not None:
                timeline.add("communicate_activation", f"send {entry[2]}", entry[1], time.time())

    def post_headers(step: tuple[Action, ...]) -> tuple[Handle, list]:
        bufs = [(a.peer, torch.zeros(HEADER, dtype=torch.int64, device=device))
                for a in step if a.kind is Kind.RECV_ACT for _ in sg.recv]
        return comm.start_exchange([], bufs), bufs

    def communicate(k: int, step: tuple[Action, ...]) -> None:
        """Sends (headers and data) are started and waited at the end; receives are waited here,
        their headers posted one compute step early when the schedule allows."""
        t0 = time.time()
        label = " + ".join(map(str, step))
        headers_out = [
            (a.peer, send_header(t)) for a in step if a.kind is Kind.SEND_ACT for t in outputs[a.mb]
        ]
        if headers_out:
            sends.append((comm.start_exchange(headers_out, []), time.time(), f"headers {label}"))
        headers_in: list = []
        if any(a.kind is Kind.RECV_ACT for a in step):
            handle, headers_in = early.pop(k) if k in early else post_headers(step)
            handle.wait()
        out, inn = [], []
        header_iter = iter(headers_in)
        for a in step:
            if a.kind is Kind.SEND_ACT:
                out += [(a.peer, t.detach()) for t in outputs[a.mb]]
            elif a.kind is Kind.SEND_GRAD:
                grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in received[a.mb]]
                out += [(a.peer, g) for g in grads]
            elif a.kind is Kind.RECV_ACT:
                received[a.mb] = [from_header(next(header_iter)[1]) for _ in sg.recv]
                inn += [(a.peer, b) for b in received[a.mb]]
            elif a.kind is Kind.RECV_GRAD:
                grads_in[a.mb] = [torch.empty_like(t) for t in outputs[a.mb]]
                inn += [(a.peer, b) for b in grads_in[a.mb]]
        if out:
            sends.append((comm.start_exchange(out, []), time.time(), label))
        if inn:
            comm.start_exchange([], inn).wait()
        for a in step:
            if a.kind is Kind.SEND_GRAD:
                received.pop(a.mb)
            elif a.kind is Kind.RECV_ACT:
                received[a.mb] = [b.requires_grad_(b.is_floating_point()) for b in received[a.mb]]
        if early_recv(steps, k) is not None:
            early[k + 2] = post_headers(steps[k + 2])
        if timeline is not None:
            timeline.add("communicate_activation", label, t0, time.time())

    try:
        for k, step in enumerate(steps):
            action = step[0]
            if action.kind is Kind.FORWARD:
                t0 = time.time()
                forward(action.mb)
                if pushes is None:
                    pushes = _Pushes(program, sched, pulls.params, timeline, device)
                if timeline is not None:
                    timeline.add("forward", f"forward mb{action.mb}", t0, time.time())
            elif action.kind is Kind.BACKWARD:
                t0 = time.time()
                if k == last_b:
                    pushes.arm()
                backward(action.mb)
                if timeline is not None:
                    timeline.add("backward", f"backward mb{action.mb}", t0, time.time())
            else:
                peers = ", ".join(sorted({f"rank {a.peer}" for a in step}))
                with comm_step(program.rank, f"communicate_activation {' + '.join(map(str, step))} ({peers})"):
                    communicate(k, step)
            reap()
        if first_forward:  # no micro-batch on this pipeline: the parameters are still pulled
            for _, ops in sched.at_use:
                pulls.run(ops)
            pulls.run(sched.after_forward)
        if pushes is None:
            pushes = _Pushes(program, sched, pulls.params, timeline, device)
        pulls.run(sched.at_end)
        reap()
        for handle, began, label in sends:
            t0 = time.time()
            with comm_step(program.rank, f"communicate_activation send {label} (next/previous stage)"):
                handle.wait()
            if timeline is not None:
                timeline.add("wait", f"send {label}", t0, time.time())
                timeline.add("communicate_activation", f"send {label}", began, time.time())
        grad_shards = pushes.finish(shards)
    finally:
        _ACTIVE.pulls = None
    reported = state.loss_total if program.reports_loss else 0.0
    return IterationOutput(reported, grad_shards, len(micro_batches))


def _overlap_module(program: Any) -> Any:
    """The stage graph with wait nodes at first uses, built once per program."""
    gm = getattr(program, "_overlap_gm", None)
    if gm is None:
        gm = overlap_graph(program.stage_graph.gm, program.stage_graph.params, _use_param)
        program._overlap_gm = gm
    return gm
