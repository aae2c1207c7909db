"""MoE routers in their 2026 forms — sigmoid scores with a bias correction (``e_score_correction_bias``),
grouped top-k (``n_group`` / ``topk_group``: DeepSeek-V3 keeps the best 4 of 8 expert groups), shared
experts, dense first layers (``first_k_dense_replace``), gather/scatter routing tables — equal to the
unmodified model on tp+dp, tp x pp and dp x pp with a bias correction that changes which experts win.

HF initialises ``e_score_correction_bias`` to zeros (training moves it), so a rule that dropped it would
go unnoticed on a fresh model; here it is set as a trained model has it, and a planted rule that drops
it fails the comparison."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hgraph
from hgraph.rules import lookup, register
from hgraph.rules.base import Decision
from hgraph.core.batch import next_token_targets
from hgraph.models.zoo import zoo_model

STRATEGIES = ["tp2 + 2x tp1", "tp2,pp2", "2x tp1,pp2"]
SLOW = {"tp2 + 2x tp1", "2x tp1,pp2"}  # make test checks tp x pp; the other two are slow


def trained_router(family: str) -> torch.nn.Module:
    """The zoo model with its score corrections set as training leaves them (not zero)."""
    model = zoo_model(family).eval()
    g = torch.Generator().manual_seed(7)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=g))
    return model


def reference(model, ids):
    model.zero_grad()
    loss = F.cross_entropy(model(ids).logits.flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def equal(compiled, strategy, ids, ref) -> bool:
    loss, grads = compiled.simulate(strategy, ids)
    return torch.allclose(loss, ref[0], rtol=1e-5, atol=1e-6) and all(
        torch.allclose(grads[n], g, rtol=1e-5, atol=1e-6) for n, g in ref[1].items())


@pytest.fixture(scope="module", params=["deepseek_v3", pytest.param("glm4_moe", marks=pytest.mark.slow)])
def router(request):
    model = trained_router(request.param)
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    ref = reference(model, ids)
    unbiased = zoo_model(request.param).eval()
    assert not torch.allclose(reference(unbiased, ids)[0], ref[0]), "the correction must change the routing"
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=ids[:2, :8])
    return request.param, model, ids, ref, compiled


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in STRATEGIES])
def test_biased_grouped_router_equals_the_model(router, strategy):
    _, _, ids, ref, compiled = router
    assert equal(compiled, strategy, ids, ref)


def test_a_rule_that_drops_the_bias_correction_is_caught(router):
    """Planted bug: the rule of the router's ``scores + e_score_correction_bias`` emits the scores alone."""
    _, model, ids, ref, _ = router
    add = lookup(torch.ops.aten.add.Tensor)

    def drops_bias(node, rin):
        decision = add(node, rin)
        bias = [a for a in node.args if getattr(a, "name", "").endswith("e_score_correction_bias")]
        if not bias:
            return decision
        scores = next(a for a in node.args if a is not bias[0])
        return Decision(output=decision.output, inputs=decision.inputs, lower=lambda lc, n: lc.local(scores))

    register(torch.ops.aten.add, drops_bias, replace=True)
    try:
        compiled = hgraph.compile(model, ["tp2,pp2"], example_inputs=ids[:2, :8])
        assert not equal(compiled, 0, ids, ref)
    finally:
        register(torch.ops.aten.add, add, replace=True)
