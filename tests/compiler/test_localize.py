"""Localized programs on simulated ranks reproduce the unmodified model's loss and every gradient.

For each (model, stage mesh): trace once, annotate + localize a copy, cut every parameter to each
rank's shard (its ``hgraph_param_spec``), split the inputs on cp in the load-balanced token order,
run loss + backward on threads, reassemble each gradient from its ``hgraph_grad_spec`` and compare
with eager autograd on the full model (fp32).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from hgraph import models
from hgraph.errors import ShardingRuleError
from hgraph.frontend import trace
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.passes.annotate import annotate
from hgraph.passes.bind_rank import bind_rank
from hgraph.passes.localize import localize
from hgraph.rules.mesh import ShardingOptions
from hgraph.rules.sharding_utils import assemble_grad, mesh_coord, mesh_groups, shard_for_rank
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.runtime.kernels.context import RankContext

BATCH, SEQ, VOCAB = 2, 16, 256
MESHES = [(1, 1, False), (1, 2, False), (1, 4, False), (2, 1, False), (2, 2, False), (1, 2, True), (2, 2, True)]


def _build(name: str) -> torch.nn.Module:
    if name == "llama":
        return models.Llama(models.LlamaConfig(heads=8, kv_heads=4))
    if name == "llama_tied":
        return models.Llama(models.LlamaConfig(tie_embeddings=True))
    if name == "hf_llama":
        return models.tiny_hf_llama(num_attention_heads=8, num_key_value_heads=4)
    return models.tiny_hf_gpt2()


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets[0, 3] = -100  # an ignored token
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(), "targets": targets}


_TRACED: dict[str, object] = {}


def _traced(name: str):
    if name not in _TRACED:
        model = _build(name)
        _TRACED[name] = trace(model, (torch.zeros(BATCH, SEQ, dtype=torch.long),))
    return _TRACED[name]


def local_program(traced, cp: int, tp: int, sp: bool = False):
    options = ShardingOptions(
        cp=cp, tp=tp, sequence_parallel=sp, params=frozenset(traced.param_names), buffers=frozenset(traced.buffer_names)
    )
    gm = copy.deepcopy(traced.graph_module)
    return localize(annotate(gm, options), options)


def run_program(program, mesh: tuple[int, int], values: dict[str, torch.Tensor], params: set[str]):
    """Run ``program`` on every rank of ``mesh`` from full placeholder ``values``; returns every rank's
    loss and, per parameter placeholder, the full gradient reassembled from its grad spec."""
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    bound = bind_rank(copy.deepcopy(program))

    def body(comm):
        coord = mesh_coord(comm.rank, mesh)
        args, leaves = [], {}
        for ph in placeholders:
            if ph.name in params:
                local = shard_for_rank(values[ph.name].detach(), ph.meta["hgraph_param_spec"], mesh, coord)
                assert tuple(local.shape) == tuple(ph.meta["hgraph_local_shape"])
                leaves[ph.name] = local.requires_grad_()
                args.append(local)
            else:
                args.append(shard_for_rank(values[ph.name], ph.meta["hgraph_spec"], mesh, coord, token_order=True))
        loss = bound(*args, RankContext(comm.rank, comm, groups=mesh_groups(comm.rank, mesh)))
        if isinstance(loss, tuple):  # torch.export graphs return a tuple
            (loss,) = loss
        loss.backward()
        return loss.detach(), {name: leaf.grad for name, leaf in leaves.items()}

    results = run_threads(body, mesh[0] * mesh[1])
    grads = {}
    for ph in placeholders:
        if ph.name in params:
            pieces = {mesh_coord(r, mesh): results[r][1][ph.name] for r in range(len(results))}
            grads[ph.name] = assemble_grad(pieces, ph.meta["hgraph_grad_spec"], mesh)
    return [r[0] for r in results], grads


def run_ranks(traced, program, mesh: tuple[int, int], inputs: dict[str, torch.Tensor]):
    """``run_program`` on a traced model; gradients keyed by parameter FQN."""
    params, buffers = traced.params(), traced.buffers()
    values = dict(inputs)
    values.update({name: params[fqn] for name, fqn in traced.param_names.items()})
    values.update({name: buffers[fqn] for name, fqn in traced.buffer_names.items()})
    losses, grads = run_program(program, mesh, values, set(traced.param_names))
    return losses, {traced.param_names[name]: grad for name, grad in grads.items()}


def eager_reference(traced, inputs):
    """The unmodified model run eagerly (not the traced graph)."""
    model = traced.model
    model.zero_grad()
    out = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
    loss = traced.loss_fn(out, inputs["targets"])
    loss.backward()
    grads = {fqn: p.grad.clone() for fqn, p in traced.params().items()}
    model.zero_grad()
    return loss.detach(), grads


def assert_matches(losses, grads, ref_loss, ref_grads):
    for loss in losses:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    assert set(grads) == set(ref_grads)
    for fqn, grad in grads.items():
        scale = max(1.0, ref_grads[fqn].abs().max().item())  # fp32 sums in another order
        torch.testing.assert_close(grad, ref_grads[fqn], rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{fqn}: {m}")


@pytest.mark.parametrize("model_name", ["llama", "hf_llama", "gpt2"])
@pytest.mark.parametrize("cp,tp,sp", MESHES, ids=[f"cp{c}tp{t}{'sp' if s else ''}" for c, t, s in MESHES])
def test_local_program_matches_eager(model_name, cp, tp, sp):
    traced = _traced(model_name)
    inputs = _inputs()
    program = local_program(traced, cp, tp, sp)
    losses, grads = run_ranks(traced, program, (cp, tp), inputs)
    assert_matches(losses, grads, *eager_reference(traced, inputs))


@pytest.mark.parametrize("cp,tp,sp", [(1, 2, False), (2, 2, True)])
def test_tied_embedding_and_lm_head(cp, tp, sp):
    traced = _traced("llama_tied")
    assert traced.tied == {"lm_head.weight": "embed.weight"}
    inputs = _inputs()
    losses, grads = run_ranks(traced, local_program(traced, cp, tp, sp), (cp, tp), inputs)
    assert_matches(losses, grads, *eager_reference(traced, inputs))


def test_packed_sequences_with_cp_and_tp_match_sequences_run_alone():
    """Two sequences per row (positions restart at 0): the sharded program equals running each
    sequence on its own through the unmodified model, losses and gradients summed."""
    traced = _traced("llama")
    lengths = [(6, 10), (11, 5)]
    inputs = _inputs(seed=1)
    inputs["position_ids"] = torch.stack([torch.cat([torch.arange(a), torch.arange(b)]) for a, b in lengths])
    program = local_program(traced, 2, 2, sp=True)
    losses, grads = run_ranks(traced, program, (2, 2), inputs)

    model = traced.model
    model.zero_grad()
    total = torch.zeros(())
    for row, (a, b) in enumerate(lengths):
        for start, stop in ((0, a), (a, a + b)):
            ids = inputs["input_ids"][row : row + 1, start:stop]
            logits = model(ids)
            total = total + traced.loss_fn(logits, inputs["targets"][row : row + 1, start:stop])
    total.backward()
    ref_grads = {fqn: p.grad.clone() for fqn, p in traced.params().items()}
    model.zero_grad()
    assert_matches(losses, grads, total.detach(), ref_grads)


def _comm_ops(program) -> Counter:
    return Counter(n.meta["hgraph_comm"]["op"] for n in program.graph.nodes if "hgraph_comm" in n.meta)


def test_megatron_communication_pattern_on_llama():
    """tp2: all-reduce after the embedding and every row-parallel linear, the "f" op before every
    column-parallel group; with sequence parallelism reduce-scatter / gather(grad_partial) instead."""
    traced = _traced("llama")
    layers = traced.model.config.layers
    plain = local_program(traced, 1, 2)
    assert _comm_ops(plain) == Counter({"all_reduce": 1 + 2 * layers, "grad_all_reduce": 2 * layers + 1})
    sp = local_program(traced, 1, 2, sp=True)
    assert _comm_ops(sp) == Counter({"reduce_scatter": 1 + 2 * layers, "all_gather": 2 * layers + 1})
    assert all(n.args[3] is True for n in sp.graph.nodes if n.meta.get("hgraph_comm", {}).get("op") == "all_gather")
    cp = local_program(traced, 2, 1)
    assert _comm_ops(cp) == Counter({"all_reduce": 1})  # the summed loss over cp-split tokens
    attention = [n for n in cp.graph.nodes if n.name.startswith("packed_attention")]
    assert len(attention) == layers and all(n.kwargs.get("cp") is True for n in attention)


def test_comm_metadata_and_placeholders():
    traced = _traced("llama")
    program = local_program(traced, 1, 2)
    before = [n.name for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in program.graph.nodes if n.op == "placeholder"] == before
    hidden = traced.model.config.hidden
    comms = [n for n in program.graph.nodes if "hgraph_comm" in n.meta]
    first = comms[0].meta["hgraph_comm"]
    assert first["kind"] == "communicate_activation" and first["mesh_dim"] == "tp"
    assert first["op"] == "all_reduce" and first["tensor"] == "embedding"
    assert first["src"] == (Replicate(), Partial()) and first["dst"] == (Replicate(), Replicate())
    assert first["bytes"] == BATCH * SEQ * hidden * 4 and first["direction"] == "forward"
    assert comms[1].meta["hgraph_comm"]["op"] == "grad_all_reduce"
    assert comms[1].meta["hgraph_comm"]["direction"] == "backward"
    assert comms[0].name == "all_reduce_embedding"
    assert next(n for n in program.graph.nodes if n.name == "embedding").meta["hgraph_note"] == "vocab-parallel"
    q = next(n for n in program.graph.nodes if n.name == "p_layers_0_attn_q_proj_weight")
    assert q.meta["hgraph_param_spec"] == (Replicate(), Shard(0))
    assert q.meta["hgraph_local_shape"] == (hidden // 2, hidden)
    view = next(n for n in program.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.view.default)
    assert view.args[1][2:] == [8 // 2, hidden // 8]  # heads cut to the local count, head_dim kept


def test_tp_a_multiple_of_kv_heads_replicates_them():
    """tp=8 over 4 key/value heads (Megatron: each kv head on tp/kv ranks, which compile's checks
    allow): the k/v projections are gathered whole, each rank reads its heads' pair; equal to eager."""
    traced = _traced("llama")  # 8 heads, 4 key/value heads
    inputs = _inputs()
    losses, grads = run_ranks(traced, local_program(traced, 1, 8), (1, 8), inputs)
    assert_matches(losses, grads, *eager_reference(traced, inputs))


def test_tp_not_dividing_heads_names_them():
    traced = _traced("llama")  # 8 heads, 4 key/value heads
    with pytest.raises(ShardingRuleError, match=r"8 attention heads cannot be split over tp=16"):
        local_program(traced, 1, 16)


def test_shard_and_assemble_roundtrip():
    full = torch.arange(2 * 8 * 4, dtype=torch.float32).reshape(2, 8, 4)
    mesh = (2, 2)
    spec = (Shard(1), Shard(2))
    pieces = {(c, t): shard_for_rank(full, spec, mesh, (c, t), token_order=True) for c in range(2) for t in range(2)}
    assert pieces[(0, 0)].shape == (2, 4, 2)
    assert pieces[(0, 0)][0, :, 0].tolist() == [0.0, 4.0, 24.0, 28.0]  # chunks 0 and 3 of 4 on cp
    torch.testing.assert_close(assemble_grad(pieces, spec, mesh, token_order=True), full)
    partial = {(c, t): torch.ones(3) for c in range(2) for t in range(2)}
    torch.testing.assert_close(assemble_grad(partial, (Partial(), Partial()), mesh), torch.full((3,), 4.0))
    with pytest.raises(ShardingRuleError, match="Partial"):
        shard_for_rank(full, (Partial(), Replicate()), mesh, (0, 0))


class _MixedUses(nn.Module):
    """``v`` feeds a replicated product and a column-parallel linear: one full, one partial gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.linspace(-1.0, 1.0, 8))
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up(x * self.v) + nn.functional.linear(self.v, self.up.weight)
        return self.down(nn.functional.silu(hidden)).sum()


def test_parameter_with_full_and_partial_uses_gets_an_exact_gradient():
    module, x = _MixedUses(), torch.randn(2, 4, 8)
    gm = torch.export.export(module, (x,)).graph_module
    options = ShardingOptions(tp=2)
    program = localize(annotate(gm, options), options)
    v = next(n for n in program.graph.nodes if n.name == "p_v")
    assert v.meta["hgraph_grad_spec"] == (Replicate(), Replicate())
    assert _comm_ops(program)["grad_all_reduce"] >= 1
    values = {"p_v": module.v, "p_up_weight": module.up.weight, "p_down_weight": module.down.weight, "x": x}
    losses, grads = run_program(program, (1, 2), values, {"p_v", "p_up_weight", "p_down_weight"})
    module.zero_grad()
    ref = module(x)
    ref.backward()
    ref_grads = {"p_v": module.v.grad, "p_up_weight": module.up.weight.grad, "p_down_weight": module.down.weight.grad}
    assert_matches(losses, grads, ref.detach(), ref_grads)


class _SlicesTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)[:, :6].sum()


class _RollsTokens(nn.Module):
    """Every token times its successor (the last wraps round): a roll written as a cat of slices."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return (h * torch.cat([h[:, 1:], h[:, :1]], dim=1)).sum()


def _check_against_module(module: nn.Module, cp: int, ids: torch.Tensor):
    """Localize ``module`` for ``cp`` ranks and compare loss and embedding gradient with the module."""
    gm = torch.export.export(module, (torch.zeros_like(ids),)).graph_module
    options = ShardingOptions(cp=cp)
    program = localize(annotate(gm, options), options)
    values = {"p_embed_weight": module.embed.weight, "input_ids": ids}
    losses, grads = run_program(program, (cp, 1), values, {"p_embed_weight"})
    module.zero_grad()
    ref = module(ids)
    ref.backward()
    assert_matches(losses, grads, ref.detach(), {"p_embed_weight": module.embed.weight.grad})
    return program


@pytest.mark.parametrize("cp", [2, 4])
def test_slicing_cp_split_tokens_gathers_them_in_token_order(cp):
    """The case refused on 4af1a81 ("cp-split tokens ... can only be summed"): ``h[:, :6]`` of a
    cp-split sequence needs the whole sequence; the planner gathers it on cp and puts the load-balanced
    chunks back in token order; loss and gradient equal the unmodified module."""
    ids = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    program = _check_against_module(_SlicesTokens(), cp, ids)
    assert _comm_ops(program) == Counter({"all_gather": 1})
    gather = next(n for n in program.graph.nodes if n.meta.get("hgraph_comm", {}).get("op") == "all_gather")
    assert gather.args[1:] == ("cp", 1, False)
    reordered = next(iter(gather.users))
    assert reordered.target is torch.ops.aten.chunk.default and reordered.args[1:] == (2 * cp, 1)


def test_cutting_a_replicated_sequence_on_cp_takes_the_load_balanced_chunks():
    """R -> S(1) on cp (refused on 4af1a81): the rolled sequence, computed whole, is cut into each
    rank's chunks r and 2·cp-1-r to meet the cp-split one; equal to the unmodified module."""
    ids = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(1))
    program = _check_against_module(_RollsTokens(), 2, ids)
    assert _comm_ops(program) == Counter({"all_gather": 1, "split": 1, "all_reduce": 1})
