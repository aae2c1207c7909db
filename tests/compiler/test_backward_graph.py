"""The traced backward program: its communication is the adjoint of the forward's, and running it on
real tensors (simulated ranks) gives exactly the gradients torch autograd gives through the forward."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.fx as fx

import hgraph
from hgraph.errors import TraceError
from hgraph.models import Llama, LlamaConfig
from hgraph.passes.backward import backward_graph, comm_counts, comm_nodes
from hgraph.runtime.kernels.collectives import all_gather, all_to_all, grad_all_reduce, reduce_scatter, split
from hgraph.runtime.kernels.packed_attention import packed_attention
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.kernels.context import RankContext
from hgraph.runtime.executor import pull_parameters
from hgraph.core.batch import next_token_targets
from hgraph.runtime.thread_oracle import micro_batches_for, shard_parameters
from hgraph.compiler.compiled_model import CompiledModel

SEQ = 16
_COMPILED: dict[tuple[str, bool], CompiledModel] = {}


def compiled(strategy: str, sequence_parallel: bool = False) -> CompiledModel:
    key = (strategy, sequence_parallel)
    if key not in _COMPILED:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(layers=2, kv_heads=2))
        _COMPILED[key] = hgraph.compile(
            model, [strategy], example_inputs=torch.zeros(2, SEQ, dtype=torch.long),
            options=hgraph.CompileOptions(sequence_parallel=sequence_parallel),
        )
    return _COMPILED[key]


def expected_adjoints(gm: fx.GraphModule) -> Counter:
    """The collectives the backward of a forward stage program must run (see runtime/kernels/collectives.py)."""
    out: Counter = Counter()
    for n in gm.graph.nodes:
        if n.target is reduce_scatter or n.target is split:
            out["all_gather"] += 1
        elif n.target is all_gather:
            out["reduce_scatter" if n.args[3] else "split"] += 1
        elif n.target is all_to_all:
            out["all_to_all"] += 1
        elif n.target is grad_all_reduce:
            out["all_reduce"] += 1
        elif n.target is packed_attention and n.kwargs.get("cp"):
            out["reduce_scatter"] += 2  # dK and dV of the cp-gathered keys and values
    return out


@pytest.mark.parametrize("strategy,sp", [("tp2", False), ("tp2,pp2", False), ("cp2,tp2", False), ("tp2", True)])
def test_backward_communication_is_the_adjoint_of_the_forward(strategy, sp):
    c = compiled(strategy, sp)
    for rank in range(c.world_size):
        forward = c.program(0, rank).stage_graph.gm
        backward = c.backward_program(0, rank, SEQ)
        assert Counter(comm_counts(backward)) == expected_adjoints(forward), (rank, backward.code)
        for node in comm_nodes(backward):
            info = node.meta["hgraph_comm"]
            assert info["kind"] == "communicate_activation" and info["direction"] == "backward"
            assert info["bytes"] > 0


def test_tp2_backward_all_reduces_exactly_the_grad_all_reduces():
    c = compiled("tp2")
    forward = c.program(0, 0).stage_graph.gm
    targets = Counter(getattr(n.target, "__name__", "") for n in forward.graph.nodes)
    assert targets["all_reduce"] > 0 and targets["grad_all_reduce"] > 0
    backward = c.backward_program(0, 0, SEQ)
    # a forward all_reduce (after o_proj / down_proj) has the identity adjoint: none appears
    assert comm_counts(backward) == {"all_reduce": targets["grad_all_reduce"]}
    params = c.program(0, 0).stage_graph.params
    outputs = next(n for n in backward.graph.nodes if n.op == "output").args[0]
    assert len(outputs) == len(params)  # one gradient per parameter (no boundary inputs on one stage)


def test_cp_backward_shows_attention_backward_and_explain_lists_backward_comm():
    c = compiled("cp2,tp2")
    backward = c.backward_program(0, 0, SEQ)
    targets = [n.target for n in backward.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.hgraph.packed_attention_backward.default) == 2
    text = c.explain(0, 0)
    assert f"backward (1 x {2 * SEQ} tokens): {len(comm_nodes(backward))} communication nodes" in text
    assert "reduce_scatter_" in text and "(backward)" in text


def test_backward_graph_needs_an_argument_that_requires_grad_and_the_rank_groups():
    c = compiled("tp2")
    program = c.program(0, 0)
    with pytest.raises(TraceError, match="requires grad"):
        backward_graph(program.stage_graph.gm, [torch.zeros(1)])
    placeholders = {n.name: n for n in program.stage_graph.gm.graph.nodes if n.op == "placeholder"}
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    batch = {"input_ids": ids, "position_ids": torch.arange(SEQ).unsqueeze(0), "targets": ids}
    batch.update({ph: c.traced.buffers()[fqn] for ph, fqn in c.traced.buffer_names.items()})
    args = [torch.zeros(placeholders[p].meta["hgraph_local_shape"], requires_grad=True) for p in program.stage_graph.params]
    args += [batch[n] for n in program.stage_graph.inputs]
    with pytest.raises(TraceError, match="RankContext"):
        backward_graph(program.stage_graph.gm, [*args, None])  # no rank context: group sizes unknown
    traced = backward_graph(program.stage_graph.gm, [*args, RankContext(0, None, program.groups)])
    assert comm_counts(traced) == comm_counts(c.backward_program(0, 0, SEQ))


def _rank_gradients(c: CompiledModel, comm, ids: torch.Tensor) -> tuple:
    """Gradients of one rank's stage by autograd through its forward program and by running the
    traced forward + backward graphs on the same inputs and output gradients."""
    rank = comm.rank
    program = c.program(0, rank)
    sg = program.stage_graph
    joint = c.joint_program(0, rank, SEQ)
    rows = [{"input_ids": ids, "position_ids": torch.arange(SEQ).unsqueeze(0), "targets": next_token_targets(ids)}]
    batch = micro_batches_for(c, rank, 0, rows)[0]
    params = pull_parameters(program, shard_parameters(c, rank, c.traced.params()), comm)
    forward_inputs = [n for n in joint.forward.graph.nodes if n.op == "placeholder"]
    n_fixed = len(sg.params) + len(sg.inputs)
    generator = torch.Generator().manual_seed(7)  # the same boundary values on every rank of a stage
    received = [  # the forward graph's last input is the rank context, as the stage program's
        torch.randn(ph.meta["val"].shape, generator=generator) for ph in forward_inputs[n_fixed:-1]
    ]
    args = [params[program.param_of_placeholder[p]] for p in sg.params] + [batch[n] for n in sg.inputs]
    args += [r.requires_grad_(True) for r in received]

    rank_context = RankContext(rank, comm, program.groups)
    outs = sg.gm(*args, rank_context)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    tangents = [torch.randn(outs[i].shape, generator=generator) for i in joint.tangent_outputs]
    torch.autograd.backward([outs[i] for i in joint.tangent_outputs], tangents)
    reference = [args[i].grad for i in joint.grad_inputs]

    with torch.no_grad():
        values = joint.forward(*[a.detach() for a in args], rank_context)
        grads = joint.backward(*values[joint.num_outputs :], *tangents)
    return [o.detach() for o in outs], list(values[: joint.num_outputs]), reference, list(grads)


@pytest.mark.parametrize("strategy", ["tp2", "tp2,pp2", "cp2,tp2"])
def test_running_the_backward_graph_gives_the_autograd_gradients(strategy):
    c = compiled(strategy)
    for rank in range(c.world_size):
        c.joint_program(0, rank, SEQ)  # trace on the main thread
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(3))

    def body(comm):
        return _rank_gradients(c, comm, ids)

    for rank, (outs, traced_outs, reference, grads) in enumerate(run_threads(body, c.world_size, timeout=60)):
        assert len(grads) == len(reference) > 0
        for a, b in zip(outs, traced_outs):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for i, (g, ref) in enumerate(zip(grads, reference)):
            assert ref is not None, (rank, i)
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} grad {i}: {m}")
