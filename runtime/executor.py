"""Run one rank's program for one iteration: Pull Parameters, 1F1B over micro-batches, Push Gradients.

The same code runs on real processes (``ProcessGroupComm``) and on simulated ranks
(``ThreadComm`` in ``compiled.simulate``): all communication goes through the rank context.

Loss scaling: a stage program returns the *summed* token loss of its micro-batch; every backward
starts from ``loss * loss_scale`` with ``loss_scale = 1 / tokens of the whole iteration``, so the
pushed gradients are those of the global token-mean loss whatever the dispatch and packing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from hgraph.errors import CommunicationError, InputError
from hgraph.products import RankProgram as RankProgram
from hgraph.runtime.context import current
from hgraph.runtime.failures import comm_step
from hgraph.runtime.reshard import execute
from hgraph.runtime.schedule import Step

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER = 10  # dtype code, ndim, up to 8 sizes


@dataclass
class IterationOutput:
    """What a rank contributes: its share of the summed loss and its optimizer-layout gradient shards."""

    loss_sum: float
    grad_shards: dict[str, Optional[torch.Tensor]]
    micro_batches: int


def layer_buckets(comms: Sequence[Any], coalesce: bool) -> list[list[Any]]:
    """``comms`` (ParameterComm) cut into runs of one layer each when ``coalesce``, else singletons."""
    if not coalesce:
        return [[pc] for pc in comms]
    from hgraph.passes.schedule import layer_of

    buckets: list[list[Any]] = []
    previous = None
    for pc, layer in zip(comms, layer_of([pc.name for pc in comms])):
        if buckets and layer == previous:
            buckets[-1].append(pc)
        else:
            buckets.append([pc])
        previous = layer
    return buckets


def _run_bucket(plans: list[Any], sources: list[Optional[torch.Tensor]], comm: Any, **kw: Any) -> list:
    if len(plans) == 1:
        return [execute(plans[0], sources[0], comm, **kw)]
    from hgraph.runtime.coalesce import execute_coalesced

    return execute_coalesced(plans, sources, comm, **kw)


def _label(kind: str, bucket: list[Any], plans: list[Any]) -> str:
    ranks = sorted({r for p in plans for r in p.ranks})
    names = bucket[0].name if len(bucket) == 1 else f"{bucket[0].name} .. {bucket[-1].name} ({len(bucket)} coalesced)"
    return f"{kind} {names} (ranks {ranks})"


def pull_parameters(
    program: RankProgram, shards: dict[str, torch.Tensor], timeline: Any = None
) -> dict[str, torch.Tensor]:
    """Run every Pull Parameter plan (one layer's together under ``coalesce``); returns the
    compute-layout parameters this rank holds (leaves)."""
    comm = current().comm
    local: dict[str, torch.Tensor] = {}
    for bucket in layer_buckets(program.pulls, program.coalesce):
        sources = [shards[pc.name] if program.compute_dtype is None else shards[pc.name].to(program.compute_dtype)
                   for pc in bucket]
        plans = [pc.pull.plan for pc in bucket]
        t0 = time.time()
        with comm_step(program.rank, _label("pull_parameter", bucket, plans)):
            outs = _run_bucket(plans, sources, comm)
        if timeline is not None:
            timeline.add("pull_parameter", bucket[0].name, t0, time.time())
        for pc, out in zip(bucket, outs):
            if out is not None and any(h == (program.pipeline, program.stage) for h in pc.holders):
                local[pc.name] = out.detach().requires_grad_(True)
    return local


def push_gradients(
    program: RankProgram, params: dict[str, torch.Tensor], shards: dict[str, torch.Tensor], timeline: Any = None
) -> dict[str, Optional[torch.Tensor]]:
    """Run every Push Gradient plan (one layer's together under ``coalesce``); returns this rank's
    optimizer-layout gradient shards."""
    comm = current().comm
    out: dict[str, Optional[torch.Tensor]] = {}
    device = shards_device(shards)
    for bucket in layer_buckets(program.pushes, program.coalesce):
        grads = [program.push_source(params.get(pc.name)) for pc in bucket]
        plans = [pc.push.plan for pc in bucket]
        t0 = time.time()
        with comm_step(program.rank, _label("push_gradient", bucket, plans)):
            results = _run_bucket(plans, grads, comm, dtype=program.push_dtype, device=device)
        if timeline is not None:
            timeline.add("push_gradient", bucket[0].name, t0, time.time())
        for pc, shard in zip(bucket, results):
            out[pc.name] = None if shard is None else shard.to(shards[pc.name].dtype)
    return out


def _send_header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER - 2:
        raise CommunicationError(f"cannot send a {t.dim()}-d activation; at most {_HEADER - 2} dims")
    h = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(h + [0] * (_HEADER - len(h)), dtype=torch.int64, device=t.device)


def _from_header(h: torch.Tensor) -> torch.Tensor:
    """An empty activation buffer, on the header's device, of the dtype and shape it describes."""
    code, ndim, *sizes = h.tolist()
    return torch.empty(tuple(sizes[:ndim]), dtype=_DTYPES[code], device=h.device)


def shards_device(shards: dict[str, torch.Tensor]) -> torch.device:
    """The device this rank computes on: that of its optimizer shards (CPU if it holds none)."""
    return next(iter(shards.values())).device if shards else torch.device("cpu")


@dataclass
class StageState:
    """One stage's per-micro-batch values between forward, backward and the sends that use them."""

    stage_graph: Any
    loss_scale: float
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    grads_in: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    loss_total: float = 0.0

    def data_args(self, batch: dict[str, torch.Tensor], mb: int) -> list[torch.Tensor]:
        """The stage's non-parameter arguments: graph inputs from the batch, then received values."""
        args = []
        for name in self.stage_graph.inputs:
            if name not in batch:
                raise InputError(f"micro-batch {mb} lacks input {name!r}; it has {sorted(batch)}")
            args.append(batch[name])
        return args + self.received.get(mb, [])

    def record(self, mb: int, outs: Any) -> None:
        """Keep a forward's outputs (the loss apart) until its backward and sends."""
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        if self.stage_graph.returns_loss:
            self.losses[mb] = outs[0]
            outs = outs[1:]
        self.outputs[mb] = outs

    def backward(self, mb: int) -> None:
        """Backward of micro-batch ``mb``: from the scaled loss, or from the received output grads."""
        if self.stage_graph.returns_loss:
            loss = self.losses.pop(mb)
            self.loss_total += float(loss.detach())
            (loss * self.loss_scale).backward()
        else:
            outs = self.outputs.pop(mb)
            pairs = [(o, g) for o, g in zip(outs, self.grads_in.pop(mb)) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.outputs.pop(mb, None)


def run_iteration(
    program: RankProgram,
    shards: dict[str, torch.Tensor],
    micro_batches: Sequence[dict[str, torch.Tensor]],
    loss_scale: float,
    on_step: Optional[Callable[[str, Step], None]] = None,
    timeline: Any = None,
) -> IterationOutput:
    """Pull, run the 1F1B schedule over this pipeline's micro-batches, push.

    Under ``schedule="overlap"`` (``program.overlap`` set) the overlap runtime runs instead
    (``runtime/overlap.py``), unless ``on_step`` asks for per-step hooks (profiling): those need the
    blocking order. ``timeline`` (a ``runtime.timeline.Timeline``) records intervals.
    """
    if program.overlap is not None and on_step is None:
        from hgraph.runtime.overlap import run_iteration_overlap

        return run_iteration_overlap(program, program.overlap, shards, micro_batches, loss_scale, timeline)
    comm = current().comm
    sg = program.stage_graph
    device = shards_device(shards)
    params = pull_parameters(program, shards, timeline)
    pipeline_ranks = program.groups["pipeline"]
    n = len(pipeline_ranks) // program.pp
    pos = pipeline_ranks.index(program.rank) % n
    prev_rank = pipeline_ranks[(program.stage - 1) * n + pos] if program.stage > 0 else None
    next_rank = pipeline_ranks[(program.stage + 1) * n + pos] if program.stage < program.pp - 1 else None
    stage_ranks = list(program.groups["stage"])
    peers = ", ".join(f"{side} stage rank {r}" for side, r in (("previous", prev_rank), ("next", next_rank))
                      if r is not None)

    recv_names = [b.name for b in sg.recv]
    state = StageState(sg, loss_scale)
    received, outputs, grads_in = state.received, state.outputs, state.grads_in

    def forward(mb: int) -> None:
        param_args = [params[program.param_of_placeholder[name]] for name in sg.params]
        state.record(mb, sg.gm(*param_args, *state.data_args(micro_batches[mb], mb)))

    backward = state.backward

    def communicate(step: Step) -> None:
        headers_out, headers_in = [], []
        for a in step.actions:
            if a.kind == "SEND_F":
                headers_out += [(next_rank, _send_header(t)) for t in outputs[a.mb]]
            elif a.kind == "RECV_F":
                headers_in += [
                    (prev_rank, torch.zeros(_HEADER, dtype=torch.int64, device=device)) for _ in recv_names
                ]
        if headers_out or headers_in:
            comm.exchange(headers_out, headers_in)
        sends, recvs = [], []
        header_iter = iter(headers_in)
        for a in step.actions:
            if a.kind == "SEND_F":
                sends += [(next_rank, t.detach()) for t in outputs[a.mb]]
            elif a.kind == "SEND_B":
                sends += [(prev_rank, r.grad if r.grad is not None else torch.zeros_like(r)) for r in received[a.mb]]
            elif a.kind == "RECV_F":
                bufs = [_from_header(next(header_iter)[1]) for _ in recv_names]
                received[a.mb] = bufs
                recvs += [(prev_rank, b) for b in bufs]
            elif a.kind == "RECV_B":
                bufs = [torch.empty_like(t) for t in outputs[a.mb]]
                grads_in[a.mb] = bufs
                recvs += [(next_rank, b) for b in bufs]
        comm.exchange(sends, recvs)
        for a in step.actions:
            if a.kind == "SEND_B":
                received.pop(a.mb)  # its gradients are gone to the previous stage
            elif a.kind == "RECV_F":
                received[a.mb] = [
                    b.requires_grad_(True) if b.is_floating_point() else b for b in received[a.mb]
                ]

    for step in program.schedule(len(micro_batches)):
        if on_step is not None:
            on_step("begin", step)
        action = step.actions[0]
        t0 = time.time()
        if action.kind == "F":
            with comm_step(program.rank, f"forward of micro-batch {action.mb} (stage ranks {stage_ranks})"):
                forward(action.mb)
        elif action.kind == "B":
            with comm_step(program.rank, f"backward of micro-batch {action.mb} (stage ranks {stage_ranks})"):
                backward(action.mb)
        else:
            with comm_step(program.rank, f"communicate_activation {step} ({peers})"):
                communicate(step)
        if timeline is not None:
            kind = {"F": "forward", "B": "backward"}.get(action.kind, "communicate_activation")
            label = f"{kind} mb{action.mb}" if action.kind in "FB" else str(step)
            timeline.add(kind, label, t0, time.time())
        if on_step is not None:
            on_step("end", step)
    grad_shards = push_gradients(program, params, shards, timeline)
    reported = state.loss_total if program.reports_loss else 0.0
    return IterationOutput(reported, grad_shards, len(micro_batches))
