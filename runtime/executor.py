"""Run one rank's program for one iteration: its action list (``RankProgram.actions``), either schedule.

The same code runs on real processes (``ProcessGroupComm``) and on simulated ranks
(``ThreadComm`` in ``compiled.simulate``): all communication goes through the communicator it is
given, which the stage programs receive in their ``RankContext`` argument.

Loss scaling: a stage program returns the *summed* token loss of its micro-batch; every backward
starts from ``loss * loss_scale`` with ``loss_scale = 1 / tokens of the whole iteration``, so the
pushed gradients are those of the global token-mean loss whatever the dispatch and packing.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Optional, Sequence

import torch

from hgraph.program.rank_program import RankProgram, layer_buckets
from hgraph.runtime.clock import DeviceClock, Mark
from hgraph.runtime.kernels.coalesce import execute_coalesced
from hgraph.runtime.kernels.comm import CommTag, Communicator, Handle
from hgraph.runtime.kernels.context import RankContext
from hgraph.runtime.kernels.failures import comm_step
from hgraph.runtime.kernels.reshard import execute, start
from hgraph.runtime.stage import HEADER, IterationOutput, StageState, from_header, send_header, shards_device
from hgraph.schedule.actions import COMPUTE, P2P, Action, Kind, ScheduleError, steps



def _run_bucket(plans: list[Any], sources: list[Optional[torch.Tensor]], comm: Any, **kw: Any) -> list:
    if len(plans) == 1:
        return [execute(plans[0], sources[0], comm, **kw)]
    return execute_coalesced(plans, sources, comm, **kw)


def _label(kind: str, bucket: list[Any], plans: list[Any]) -> str:
    ranks = sorted({r for p in plans for r in p.ranks})
    names = bucket[0].name if len(bucket) == 1 else f"{bucket[0].name} .. {bucket[-1].name} ({len(bucket)} coalesced)"
    return f"{kind} {names} (ranks {ranks})"


def pull_parameters(program: RankProgram, shards: dict[str, torch.Tensor], comm: Communicator) -> dict[str, torch.Tensor]:
    """Run every Pull Parameter of ``program`` (its evaluation list of no micro-batch); returns the
    compute-layout parameters this rank holds (leaves). For graph tracing."""
    executor = Executor(program, shards, [], 1.0, forward_only=True, comm=comm)
    executor.run(program.actions(0, mode="eval"))
    return executor.params


class Executor:
    """Interprets one rank's action list (``hgraph.schedule.actions``) for one iteration, one method per kind.

    Blocking (``schedule="none"``): a PULL/PUSH start runs its plan to the end (the wait only hands
    the result over). Overlapped (``overlap=True``, ``schedule="overlap"``): a start issues the plan's
    first round (``reshard.start``), the wait completes it, and the actions attached to a compute
    action (``Action.at``) run inside it: pull ops at the parameter's first use (the forward runs
    ``overlap_graph``, whose use nodes call ``use``), push starts from post-accumulate-grad hooks as
    soon as their bucket's gradients are final; finished transfers are reaped after every step.
    An exchange posts its sends and receives together and waits the receives. ``on_step(when,
    action)`` is called around every compute action (profiling); ``timeline`` records every step.
    Timeline intervals are marks of ``clock`` (``hgraph.runtime.clock``: CUDA events on CUDA), read
    once the iteration's work is issued, so they time the device's work, not its launch.
    ``forward_only`` (evaluation, ``RankProgram.actions(m, mode="eval")`` under ``torch.no_grad``): each
    forward's loss is summed as it comes and its activations are dropped once sent.
    ``comm`` is this rank's communicator; the stage programs get ``rank_context`` (the rank, ``comm`` and
    the program's groups) as their last argument, and their routing counts are collected in ``routing``.
    """

    def __init__(
        self, program: RankProgram, shards: dict[str, torch.Tensor], micro_batches: Sequence[dict[str, torch.Tensor]],
        loss_scale: float, timeline: Any = None, overlap: bool = False, forward_only: bool = False, *,
        comm: Communicator, clock: Optional[DeviceClock] = None,
    ) -> None:
        self.program, self.shards, self.micro_batches, self.timeline = program, shards, micro_batches, timeline
        self.overlap, self.forward_only = overlap, forward_only
        self.comm = comm
        self.rank_context = RankContext(program.rank, comm, program.groups)
        self.routing: list[torch.Tensor] = []
        self.device = shards_device(shards)
        self.clock = clock if clock is not None or timeline is None else DeviceClock(self.device)
        self.intervals: list[tuple[str, str, Mark, Mark]] = []  # timeline intervals, read at the end of run
        self.states = [StageState(sg, loss_scale) for sg in program.chunks]
        self.params: dict[str, torch.Tensor] = {}
        self.grad_shards: dict[str, Optional[torch.Tensor]] = {}
        self.pull_buckets = {b[0].name: b for b in layer_buckets(program.pulls, program.coalesce)}
        self.push_buckets = {b[0].name: b for b in layer_buckets(program.pushes, program.coalesce)}
        self.results: dict[tuple[Kind, str], list] = {}
        self.handles: dict[tuple[Kind, str], tuple[Handle, Optional[Mark]]] = {}  # overlapped starts in flight
        self.inside: list[Action] = []  # attached actions of the running compute action, not yet run
        self.ready: set[str] = set()  # pushes of the running backward whose gradients are final
        self.stage_ranks = list(program.groups["stage"])
        self.sends: list[Handle] = []  # activation sends posted, not yet waited

    def drain_sends(self) -> None:
        """Wait for every activation send posted so far (their receivers are all posted by now)."""
        if self.sends:
            with comm_step(self.program.rank, "communicate_activation: waiting for sends to the pipeline peers"):
                for handle in self.sends:
                    handle.wait()
            self.sends = []

    def mark(self) -> Optional[Mark]:
        """This point of the device's work, when a timeline records it."""
        return None if self.timeline is None or self.clock is None else self.clock.mark()

    def record(self, kind: str, name: str, start: Optional[Mark], end: Optional[Mark] = None) -> None:
        """A timeline interval from ``start`` to ``end`` (default: now), read at the end of ``run``."""
        if self.clock is not None and start is not None:
            self.intervals.append((kind, name, start, self.clock.mark() if end is None else end))

    def write_timeline(self) -> None:
        """Read the marks of the recorded intervals (on CUDA: waits for their events) into the timeline."""
        if self.timeline is not None and self.clock is not None:
            for kind, name, start, end in self.intervals:
                self.timeline.add(kind, name, self.clock.seconds(start), self.clock.seconds(end))
        self.intervals = []

    def run(self, actions: Sequence[Action], on_step: Optional[Callable[[str, Action], None]] = None) -> IterationOutput:
        todo = steps(actions)
        pipeline_end = max((k for k, s in enumerate(todo) if s[0].kind in COMPUTE | P2P), default=-1)
        k = 0
        while k < len(todo):
            step, k = todo[k], k + 1
            head, t0 = step[0], self.mark()
            attached = []
            while head.kind in COMPUTE and k < len(todo) and todo[k][0].at is not None:
                attached.append(todo[k][0])
                k += 1
            if head.kind in P2P:
                peers = ", ".join(sorted({f"rank {a.peer}" for a in step}))
                with comm_step(self.program.rank, f"communicate_activation {' + '.join(map(str, step))} ({peers})"):
                    self.exchange(step)
                self.record("communicate_activation", " + ".join(map(str, step)), t0)
            elif head.kind not in COMPUTE:
                if k - 1 > pipeline_end:
                    self.drain_sends()
                self.do(head)
            else:
                if on_step is not None:
                    on_step("begin", head)
                self.inside = attached
                self.do(head)
                for a in self.take(len(self.inside)):  # whatever the compute did not run itself
                    self.do(a)
                if on_step is not None:
                    on_step("end", head)
                kind = "forward" if head.kind is Kind.FORWARD else "backward"
                self.record(kind, f"{_COMPUTE_NAMES[head.kind]} mb{head.mb}", t0)
            if self.overlap:
                self.reap()
        self.drain_sends()
        self.write_timeline()
        reported = sum(st.loss_total for st in self.states) if self.program.reports_loss else 0.0
        pushed = {pc.name: self.grad_shards[pc.name] for pc in self.program.pushes if pc.name in self.grad_shards}
        return IterationOutput(reported, pushed, len(self.micro_batches), self.routing)

    def do(self, a: Action) -> None:
        getattr(self, a.kind.name.lower())(a)

    def take(self, n: int) -> list[Action]:
        """The first ``n`` attached actions still to run, removed from ``inside``."""
        out, self.inside = self.inside[:n], self.inside[n:]
        return out

    # -- parameters
    def holds(self, pc: Any) -> bool:
        """Whether this rank computes with the pulled parameter ``pc`` (else it only sends it)."""
        return any(h == (self.program.pipeline, self.program.stage) for h in pc.holders)

    def pull_start(self, a: Action) -> None:
        program, bucket = self.program, self.pull_buckets[a.group]
        sources = [self.shards[pc.name] if program.compute_dtype is None
                   else self.shards[pc.name].to(program.compute_dtype) for pc in bucket]
        plans = [pc.pull.plan for pc in bucket]
        t0 = self.mark()
        if self.overlap:  # no coalescing under the overlap schedule: one plan per name
            self.handles[(Kind.PULL_START, a.group)] = (start(plans[0], sources[0], self.comm, tag=CommTag.PULL), t0)
            return
        with comm_step(program.rank, _label("pull_parameter", bucket, plans)):
            self.results[(Kind.PULL_START, a.group)] = _run_bucket(plans, sources, self.comm)
        self.record("pull_parameter", a.group, t0)

    def finish(self, key: tuple[Kind, str], kind: str, plans: list[Any]) -> list:
        """The results of the start ``key``: handed over (blocking, reaped) or waited for now."""
        if key in self.results:
            return self.results.pop(key)
        handle, began = self.handles.pop(key)
        t0 = self.mark()
        with comm_step(self.program.rank, f"{kind} {key[1]} (ranks {list(plans[0].ranks)})"):
            out = handle.wait()
        end = self.mark()
        self.record("wait", f"{kind.split('_')[0]} {key[1]}", t0, end)
        self.record(kind, key[1], began, end)
        return [out]

    def reap(self) -> None:
        """Complete the overlapped transfers that have finished and that no compute waits for (pushes,
        pulls this rank only sends): no blocking, nothing issued."""
        for (kind, name), (handle, began) in list(self.handles.items()):
            if (kind is Kind.PUSH_START or not self.holds(self.pull_buckets[name][0])) and handle.ready():
                del self.handles[(kind, name)]
                self.results[(kind, name)] = [handle.wait()]
                self.record("pull_parameter" if kind is Kind.PULL_START else "push_gradient", name, began)

    def pull_wait(self, a: Action) -> None:
        bucket = self.pull_buckets[a.group]
        outs = self.finish((Kind.PULL_START, a.group), "pull_parameter", [pc.pull.plan for pc in bucket])
        for pc, out in zip(bucket, outs):
            if out is not None and self.holds(pc):
                self.params[pc.name] = out.detach().requires_grad_(True)

    def use(self, placeholder: str) -> torch.Tensor:
        """A parameter at its first use inside the forward: run the attached pull ops up to the last
        one for it first (the use nodes of ``program.overlap_graph`` call this)."""
        name = self.program.param_of_placeholder[placeholder]
        last = max((i for i, a in enumerate(self.inside) if a.at == name), default=-1)
        for a in self.take(last + 1):
            self.do(a)
        return self.params[name]

    def push_start(self, a: Action) -> None:
        program, bucket = self.program, self.push_buckets[a.group]
        grads = [program.push_source(self.params.get(pc.name)) for pc in bucket]
        plans = [pc.push.plan for pc in bucket]
        t0 = self.mark()
        if self.overlap:
            self.handles[(Kind.PUSH_START, a.group)] = (start(
                plans[0], grads[0], self.comm, dtype=program.push_dtype, device=self.device, tag=CommTag.PUSH), t0)
            return
        with comm_step(program.rank, _label("push_gradient", bucket, plans)):
            self.results[(Kind.PUSH_START, a.group)] = _run_bucket(
                plans, grads, self.comm, dtype=program.push_dtype, device=self.device)
        self.record("push_gradient", a.group, t0)

    def final(self, name: str) -> None:
        """Post-accumulate-grad hook of a pushed parameter in the backward that starts pushes: start
        the leading buckets whose gradients are all final, in order."""
        self.ready.add(name)
        while self.inside:
            bucket = [a for a in self.inside if a.at == self.inside[0].at]
            if not all(a.group in self.ready for a in bucket):
                return
            for a in self.take(len(bucket)):
                self.do(a)

    def push_wait(self, a: Action) -> None:
        bucket = self.push_buckets[a.group]
        for pc, shard in zip(bucket, self.finish((Kind.PUSH_START, a.group), "push_gradient",
                                                 [pc.push.plan for pc in bucket])):
            self.grad_shards[pc.name] = None if shard is None else shard.to(self.shards[pc.name].dtype)
            held = self.params.get(pc.name)
            if held is not None:
                held.grad = None  # pushed: its shard is what the optimizer reads; free the compute-layout gradient

    def optimizer(self, a: Action) -> None:
        """The optimizer step runs in the trainer on the pushed shards; nothing is left to do here."""

    # -- compute
    def _compute(self, a: Action, fn: Callable[[int], None]) -> None:
        what = f"{_COMPUTE_NAMES[a.kind]} of micro-batch {a.mb} (stage ranks {self.stage_ranks})"
        with comm_step(self.program.rank, what):
            fn(a.mb)

    def forward(self, a: Action) -> None:
        state, program = self.states[a.chunk], self.program
        sg = state.stage_graph

        def run(mb: int) -> None:
            data = [*state.data_args(self.micro_batches[mb], mb), self.rank_context]
            if not self.inside:
                params = [self.params[program.param_of_placeholder[n]] for n in sg.params]
                self.routing += state.record(mb, sg.gm(*params, *data))
            elif program.overlap_graph is None or a.chunk != 0:
                raise ScheduleError(f"rank {program.rank}: {a} has attached pulls but no overlap graph "
                                    "(only chunk 0 of a program compiled with schedule='overlap' has one)")
            else:  # the parameters are None here: the use nodes fill them in through self.use
                self.routing += state.record(mb, program.overlap_graph(self.use, *([None] * len(sg.params)), *data))
            if self.forward_only:
                state.settle(mb)

        self._compute(a, run)

    def backward(self, a: Action) -> None:
        hooks = []
        if self.inside:  # push starts attached: their gradients are final in this backward
            self.ready = {x.group for x in self.inside if self.params.get(x.group) is None}
            hooks = [self.params[x.group].register_post_accumulate_grad_hook(lambda _p, n=x.group: self.final(n))
                     for x in self.inside if self.params.get(x.group) is not None]
        try:
            self._compute(a, self.states[a.chunk].backward)
        finally:
            for hook in hooks:
                hook.remove()

    def backward_input(self, a: Action) -> None:
        self._compute(a, self.states[a.chunk].backward_input)

    def backward_weight(self, a: Action) -> None:
        state = self.states[a.chunk]
        held = [self.params[self.program.param_of_placeholder[n]] for n in state.stage_graph.params]
        self._compute(a, lambda mb: state.backward_weight(mb, held))

    # -- activations
    def exchange(self, step: tuple[Action, ...]) -> None:
        """One batched exchange: post every send (activation shapes, activations, gradients), wait
        for the receives. Sends are waited only before the first parameter action after the pipeline
        (``drain_sends``), as the dry run assumes: a backend whose sends wait for their receiver (gloo)
        then cannot deadlock on a peer that receives later. Activation receives wait for their shapes
        first. Shapes, activations and gradients travel on separate tags, so each stream matches in
        order whatever the mix of a step."""
        states, comm = self.states, self.comm
        outputs = [(a, t) for a in step if a.kind is Kind.SEND_ACT for t in states[a.chunk].outputs[a.mb]]
        headers = [(a.peer, send_header(t)) for a, t in outputs]
        acts = [(a.peer, t.detach()) for a, t in outputs]
        grads = [(a.peer, r.grad if r.grad is not None else torch.zeros_like(r))
                 for a in step if a.kind is Kind.SEND_GRAD for r in states[a.chunk].received[a.mb]]
        grad_recvs = []
        for a in step:
            if a.kind is Kind.RECV_GRAD:
                state = states[a.chunk]
                state.grads_in[a.mb] = [torch.empty_like(t) for t in state.outputs[a.mb]]
                grad_recvs += [(a.peer, b) for b in state.grads_in[a.mb]]
        header_recvs = [(a.peer, torch.zeros(HEADER, dtype=torch.int64, device=self.device))
                        for a in step if a.kind is Kind.RECV_ACT for _ in states[a.chunk].stage_graph.recv]
        self.sends += [comm.start_exchange(headers, [], tag=CommTag.HEADER),
                       comm.start_exchange(acts, [], tag=CommTag.ACTIVATION),
                       comm.start_exchange(grads, [], tag=CommTag.GRADIENT)]
        handles = [comm.start_exchange([], grad_recvs, tag=CommTag.GRADIENT)]
        comm.start_exchange([], header_recvs, tag=CommTag.HEADER).wait()
        shapes = iter(header_recvs)
        act_recvs = []
        for a in step:
            if a.kind is Kind.RECV_ACT:
                state = states[a.chunk]
                state.received[a.mb] = [from_header(next(shapes)[1]) for _ in state.stage_graph.recv]
                act_recvs += [(a.peer, b) for b in state.received[a.mb]]
        handles.append(comm.start_exchange([], act_recvs, tag=CommTag.ACTIVATION))
        for handle in handles:
            handle.wait()
        for a in step:
            received = states[a.chunk].received
            if a.kind is Kind.SEND_GRAD:
                received.pop(a.mb)  # its gradients are gone to the previous stage
            elif a.kind is Kind.SEND_ACT and self.forward_only:
                states[a.chunk].outputs.pop(a.mb)  # no backward needs them
            elif a.kind is Kind.RECV_ACT and not self.forward_only:
                received[a.mb] = [b.requires_grad_(True) if b.is_floating_point() else b for b in received[a.mb]]


_COMPUTE_NAMES = MappingProxyType({Kind.FORWARD: "forward", Kind.BACKWARD: "backward",
                                   Kind.BACKWARD_INPUT: "backward_input", Kind.BACKWARD_WEIGHT: "backward_weight"})


def run_iteration(
    program: RankProgram,
    shards: dict[str, torch.Tensor],
    micro_batches: Sequence[dict[str, torch.Tensor]],
    loss_scale: float,
    on_step: Optional[Callable[[str, Action], None]] = None,
    timeline: Any = None,
    *,
    comm: Communicator,
    clock: Optional[DeviceClock] = None,
) -> IterationOutput:
    """Run the rank's action list (``program.actions``) for this pipeline's micro-batches, with ``comm``
    this rank's communicator: under ``schedule="overlap"`` the overlap lowering, run overlapped, whether
    or not ``on_step`` observes the compute actions (profiling times the schedule training runs).
    ``timeline`` (a ``runtime.timeline.Timeline``) records intervals, marked on ``clock`` (default: a new
    ``DeviceClock`` of the shards' device).
    """
    actions = program.actions(len(micro_batches))
    overlap = program.overlap is not None
    return Executor(program, shards, micro_batches, loss_scale, timeline, overlap, comm=comm, clock=clock).run(
        actions, on_step)


def run_evaluation(program: RankProgram, shards: dict[str, torch.Tensor],
                   micro_batches: Sequence[dict[str, torch.Tensor]], comm: Communicator) -> float:
    """This rank's summed token loss over ``micro_batches`` (0 on ranks that do not report it): the
    evaluation list (``program.actions(m, mode="eval")``: pulls, forwards, activation transfers) run
    under ``torch.no_grad``; parameters, gradients and optimizer untouched."""
    with torch.no_grad():
        executor = Executor(program, shards, micro_batches, 1.0, forward_only=True, comm=comm)
        return executor.run(program.actions(len(micro_batches), mode="eval")).loss_sum
