"""Backward program: the backward of a stage program as an explicit, inspectable fx graph.

At run time the backward is torch autograd through the forward program; this pass writes the same
computation down. How: the joint function ``(primals, tangents) -> (*outputs, *grads)`` of the
stage program is traced with ``make_fx`` on fake tensors of the example (local) shapes, and cut with
functorch's ``default_partition`` into

* the forward graph: ``primals -> (*outputs, *saved)`` (the program plus the values autograd keeps),
* the backward graph: ``(*saved, *output grads) -> grads`` of every example argument that
  requires grad (parameters and received boundary activations), zeros where none flows.

Communication stays visible: the ops of ``hgraph.runtime.kernels`` (collectives, packed attention, vocab parallel) are ``torch.library`` custom ops, so
the forward collectives and their adjoints appear as ``hgraph.*`` nodes (an all_reduce whose adjoint
is the identity leaves none; a grad_all_reduce shows up as an all_reduce in the backward). Each one
gets ``meta["hgraph_comm"]`` (kind ``communicate_activation``, direction ``forward``/``backward``).

Tracing needs the group *sizes* of the rank (fake collectives compute shapes from them): the example
arguments of a bound stage program end with the rank's ``RankContext`` (``rank_joint`` passes one
whose communicator is None: nothing is sent). Values that depend on the rank's *index* (vocab-parallel
row ranges) are baked in for that rank: the graphs are per rank.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._functorch.partitioners import default_partition
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.experimental.proxy_tensor import make_fx

from hgraph.core.batch import local_micro_batches
from hgraph.errors import CommunicationError, TraceError
from hgraph.program.rank_program import CompiledPrograms
from hgraph.runtime.kernels.context import RankContext

COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather", "split", "all_to_all", "all_reduce_max",
            "expert_dispatch", "expert_scatter", "expert_combine", "token_chunk", "token_gather")


@dataclass(frozen=True)
class JointGraphs:
    """Forward and backward graphs of one stage program (see the module docstring)."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_outputs: int  # the stage program's outputs; the forward graph returns the saved values after them
    tangent_outputs: tuple[int, ...]  # outputs whose gradient the backward takes, in its input order
    grad_inputs: tuple[int, ...]  # arguments whose gradient the backward returns, in order

    def __str__(self) -> str:
        counts = ", ".join(f"{op} {n}" for op, n in comm_counts(self.backward).items()) or "none"
        return (
            f"JointGraphs({self.num_outputs} outputs, grads of arguments {list(self.grad_inputs)}; "
            f"backward communication: {counts})"
        )


def comm_op(node: fx.Node) -> str | None:
    """Name of the hgraph collective a node calls (``"all_gather"``), or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "hgraph":
        return None
    name = target.overloadpacket.__name__
    return name if name in COMM_OPS else None


def comm_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The communication nodes of a traced graph, in order."""
    return [n for n in gm.graph.nodes if comm_op(n) is not None]


def comm_counts(gm: fx.GraphModule) -> dict[str, int]:
    """How many of each collective a traced graph calls."""
    return dict(Counter(comm_op(n) for n in comm_nodes(gm)))


def trace_joint(stage_gm: fx.GraphModule, example_args: Sequence[Any]) -> JointGraphs:
    """Forward and backward graphs of ``stage_gm`` at the shapes of ``example_args``.

    Tensors in ``example_args`` may be real or fake; those with ``requires_grad`` get gradients.
    The stage's floating-point outputs that depend on them get an output-grad input.
    """
    mode = _fake_mode(example_args)
    args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) and not is_fake(a) else a for a in example_args]
    want = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad)
    if not want:
        raise TraceError("backward_graph: no example argument requires grad; mark parameters with requires_grad")
    try:
        with mode, torch.enable_grad():
            outs = _flat(stage_gm(*_leaves(args, want)))
    except CommunicationError as e:
        raise TraceError(
            f"tracing the backward needs the rank's groups (collective shapes depend on their sizes): "
            f"pass the rank's hgraph.runtime.kernels.context.RankContext as the last example argument ({e})"
        ) from e
    tangent_outputs = tuple(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad)
    with mode:
        tangents = [torch.empty_like(outs[i]) for i in tangent_outputs]

    def joint(primals: list, tangents: list) -> list:
        with torch.enable_grad():
            leaves = _leaves(primals, want)
            outputs = _flat(stage_gm(*leaves))
            grads = torch.autograd.grad(
                [outputs[i] for i in tangent_outputs], [leaves[i] for i in want], tangents, allow_unused=True
            )
        grads = [torch.zeros_like(leaves[i]) if g is None else g for i, g in zip(want, grads)]
        return [*outputs, *grads]

    with mode:
        joint_gm = make_fx(joint, tracing_mode="fake")(args, tangents)
    _tag_forward(joint_gm, len(outs))
    forward, backward = default_partition(joint_gm, (args, tangents), num_fwd_outputs=len(outs))
    _tag(forward, "forward")
    _tag(backward, "backward")
    return JointGraphs(forward, backward, len(outs), tangent_outputs, want)


def backward_graph(stage_gm: fx.GraphModule, example_args: Sequence[Any]) -> fx.GraphModule:
    """The backward graph of ``stage_gm``: ``(*saved, *output grads) -> grads`` (see ``trace_joint``)."""
    return trace_joint(stage_gm, example_args).backward


def _tag_forward(joint_gm: fx.GraphModule, num_outputs: int) -> None:
    """Mark what computes the outputs as forward (what ``default_partition`` keeps in the forward)."""
    out = next(n for n in joint_gm.graph.nodes if n.op == "output")
    stack = [a for a in out.args[0][:num_outputs] if isinstance(a, fx.Node)]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or node.op == "placeholder":
            continue
        seen.add(node)
        node.meta["partitioner_tag"] = "is_forward"
        stack.extend(node.all_input_nodes)


def rank_joint(compiled: CompiledPrograms, index: int, rank: int, seq_len: int = 16) -> JointGraphs:
    """Forward and backward graphs of the stage program ``rank`` runs in strategy ``index``.

    Example local inputs are built as ``compiled.simulate`` builds a micro-batch (batch 1,
    ``seq_len`` tokens, cut for context parallelism, buffers added); parameters are fake tensors of
    their local shapes; boundary activations come from running the earlier stages on fake tensors.
    """
    program = compiled.program(index, rank)
    pipeline = compiled.strategies[index].pipelines[program.pipeline]
    stages = compiled.stage_graphs(pipeline)
    rows = [{
        "input_ids": torch.zeros(1, seq_len, dtype=torch.long),
        "position_ids": torch.arange(seq_len).unsqueeze(0),
        "targets": torch.zeros(1, seq_len, dtype=torch.long),
    }]
    buffers = {ph: compiled.traced.buffers()[fqn] for ph, fqn in compiled.traced.buffer_names.items()}
    batch = local_micro_batches(rows, program.groups, rank, buffers)[0]
    dtype = program.compute_dtype or torch.float32
    mode = FakeTensorMode()
    received: list = []
    # Nothing is sent while tracing: the context only gives the group sizes and this rank's index.
    rank_context = RankContext(rank, None, program.groups)
    for sg in stages[: program.stage + 1]:
        placeholders = {n.name: n for n in sg.gm.graph.nodes if n.op == "placeholder"}
        with mode:
            params = [
                torch.empty(placeholders[p].meta["hgraph_local_shape"], dtype=dtype).requires_grad_(True)
                for p in sg.params
            ]
        args = [*params, *(mode.from_tensor(batch[name]) for name in sg.inputs), *received, rank_context]
        if sg.stage == program.stage:
            return trace_joint(sg.gm, args)
        with mode, torch.no_grad():
            outs = _flat(sg.gm(*args))
            outs = outs[1 if sg.returns_loss else 0 : len(outs) - sg.routing_outputs]
            received = [o.detach().requires_grad_(o.is_floating_point()) for o in outs]
    raise TraceError(f"rank {rank} runs stage {program.stage}, which pipeline {pipeline} does not have")


def _fake_mode(args: Sequence[Any]) -> FakeTensorMode:
    for a in args:
        if isinstance(a, torch.Tensor) and is_fake(a):
            return a.fake_mode
    return FakeTensorMode()


def _leaves(args: Sequence[Any], want: tuple[int, ...]) -> list:
    return [a.detach().requires_grad_(True) if i in want else a for i, a in enumerate(args)]


def _flat(out: Any) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


_PLACEMENTS = {
    "all_reduce": lambda a: ("P", "R"),
    "all_reduce_max": lambda a: ("P(max)", "R"),
    "reduce_scatter": lambda a: ("P", f"S({a[2]})"),
    "all_gather": lambda a: (f"S({a[2]})", "R"),
    "split": lambda a: ("R", f"S({a[2]})"),
    "all_to_all": lambda a: (f"S({a[3]})", f"S({a[2]})"),
}
# Expert parallelism's token movement (hgraph.runtime.kernels.expert_dispatch): (group, src, dst).
_TOKEN_MOVES = {
    "expert_dispatch": lambda a: ("ep", "rows by token", "rows by expert"),
    "expert_scatter": lambda a: ("ep", "rows by token", "rows by expert"),
    "expert_combine": lambda a: ("ep", "rows by expert", "rows by token"),
    "token_chunk": lambda a: (a[1], "R", "S(0)"),
    "token_gather": lambda a: (a[2], "S(0)", "R"),
}


def _tag(gm: fx.GraphModule, direction: str) -> None:
    for node in comm_nodes(gm):
        op = comm_op(node)
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        nbytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
        if op in _TOKEN_MOVES:
            mesh_dim, src, dst = _TOKEN_MOVES[op](node.args)
        else:
            src, dst = _PLACEMENTS[op](node.args)
            mesh_dim = node.args[1]
        node.meta["hgraph_comm"] = {
            "kind": "communicate_activation",
            "op": op,
            "mesh_dim": mesh_dim,
            "src": f"{mesh_dim}:{src}",
            "dst": f"{mesh_dim}:{dst}",
            "tensor": node.name,
            "bytes": int(nbytes),
            "direction": direction,
        }


__all__ = ["JointGraphs", "backward_graph", "comm_counts", "comm_nodes", "comm_op", "rank_joint", "trace_joint"]
