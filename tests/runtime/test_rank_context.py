"""The calling rank is an argument: a stage program takes its ``RankContext`` last and hands it to
every communication node; routing counts come back in the iteration's output."""

import pytest
import torch

import hgraph
from hgraph.errors import CommunicationError
from hgraph.models import Llama, LlamaConfig
from hgraph.passes.bind_rank import RANK_KERNELS
from hgraph.core.batch import rank_micro_batches
from hgraph.models.zoo import zoo_model
from hgraph.planner.dispatch import default_dispatch
from hgraph.runtime.executor import run_iteration
from hgraph.runtime.kernels.collectives import all_reduce
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.kernels.context import INPUT
from hgraph.runtime.thread_oracle import shard_parameters


def test_stage_programs_take_the_rank_context_last_and_pass_it_to_every_kernel():
    compiled = hgraph.compile(Llama(LlamaConfig(layers=2, kv_heads=4)), ["tp2,pp2"],
                              example_inputs=torch.randint(0, 256, (1, 16)))
    for rank in range(4):
        sg = compiled.program(0, rank).stage_graph
        placeholders = [n for n in sg.gm.graph.nodes if n.op == "placeholder"]
        assert placeholders[-1].name == INPUT
        assert len(placeholders) == len(sg.params) + len(sg.inputs) + len(sg.recv) + 1
        kernels = [n for n in sg.gm.graph.nodes if n.op == "call_function" and n.target in RANK_KERNELS]
        assert kernels and all(n.kwargs["rank_context"] is placeholders[-1] for n in kernels)


def test_a_kernel_called_without_a_rank_context_names_it():
    with pytest.raises(CommunicationError, match="RankContext"):
        all_reduce(torch.ones(2), "tp")


def test_routing_counts_come_back_in_the_iteration_output():
    """Every expert_dispatch of an ep program reports the rows each rank routed to each expert: over
    the ep pipeline's ranks, k per token of the micro-batch; a pipeline without ep reports none."""
    model = zoo_model("mixtral")
    vocab = model.config.vocab_size
    compiled = hgraph.compile(model, ["tp2,ep2 + 2x tp1"], example_inputs=torch.randint(0, vocab, (1, 16)))
    documents = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6, 12, 7)]
    dispatch = default_dispatch(compiled.strategies[0].pipelines, [len(d) for d in documents], 64)
    params = compiled.master_parameters()
    buffers = {ph: compiled.traced.buffers()[fqn] for ph, fqn in compiled.traced.buffer_names.items()}
    k, layers = model.config.num_experts_per_tok, model.config.num_hidden_layers

    def body(comm):
        program = compiled.program(0, comm.rank)
        mbs = rank_micro_batches(documents, dispatch[program.pipeline], program.groups, comm.rank, buffers,
                                 compiled.options.sequence_parallel)
        out = run_iteration(program, shard_parameters(compiled, comm.rank, params), mbs, 1.0, comm=comm)
        return "ep" in program.groups, [int(mb["input_ids"].numel()) for mb in mbs], out.routing

    results = run_threads(body, 4, timeout=120)
    assert [ep for ep, _, _ in results] == [True, True, False, False]
    assert results[2][2] == results[3][2] == []
    (_, tokens, routing), (_, tokens_1, routing_1) = results[:2]
    assert tokens == tokens_1 and len(routing) == len(routing_1) == layers * len(tokens)
    for i, (mine, theirs) in enumerate(zip(routing, routing_1)):
        assert mine.dtype == torch.int64 and mine.shape == (model.config.num_local_experts,)
        assert int(mine.sum() + theirs.sum()) == k * tokens[i // layers]
