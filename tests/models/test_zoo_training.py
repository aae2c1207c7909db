"""Two zoo families in their default configs trained for 3 iterations by ``hgraph.Trainer`` on 4 real
gloo processes, switching strategy every iteration, equal to single-process ``torch.optim.AdamW`` on
the unmodified model: Mistral (sliding window shorter than the longest sequences, grouped-query
attention), Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``, a pad token) and Bloom (ALiBi inside each
packed document, its slopes cut with the heads over tp, documents cut into cp chunks).

The first step's gradients are compared directly (AdamW's first ``exp_avg`` is ``(1 - beta1) * grad``
on both sides), the parameters after every step with a tolerance derived from Adam itself: the
update ``lr * m / (sqrt(v) + eps)`` moves by at most ``lr / eps`` times a change of the gradient (for
an element whose gradient is far below ``eps``, as in rarely seen embedding rows), so gradients equal
to ``GRAD_ATOL`` (float32 summation order under tp) allow parameters to differ by
``ITERATIONS * lr / eps * GRAD_ATOL``. (Phi-3 at lr 2e-4: one embedding element's gradient is
-1.364e-7 against -1.422e-7, 5.8e-9 apart at a tensor scale of 0.13; its parameter ends 1.65e-6 off.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hgraph
from hgraph.core.layout import Layout, Replicate
from hgraph.lnk import solve
from hgraph.runtime.kernels.reshard import execute
from hgraph.training.trainer import Trainer
from hgraph.models.zoo import zoo_model

STRATEGIES = ["tp2 + 2x tp1", "tp2,pp2", "2x cp2"]
ITERATIONS = 3
OPT = dict(lr=2e-4, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)
GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-8
PARAM_ATOL = ITERATIONS * OPT["lr"] / OPT["eps"] * GRAD_ATOL  # 1.2e-5: Adam's amplification bound


def batches(vocab: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randint(0, vocab, (int(n),), generator=g) for n in torch.randint(3, 30, (5,), generator=g)]
        for _ in range(ITERATIONS)
    ]


def reference_run(family: str):
    model = zoo_model(family).eval()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    losses, params, first_grads = [], [], None
    for batch in batches(model.config.vocab_size):
        tokens = sum(len(s) - 1 for s in batch)
        opt.zero_grad()
        total = 0.0
        for s in batch:
            logits = model(s[None]).logits[0, :-1]
            loss = F.cross_entropy(logits, s[1:], reduction="sum") / tokens
            loss.backward()
            total += loss.item()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(total)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params, first_grads


def first_step_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full gradients of the first step, from the optimizer's first moment ``(1 - beta1) * grad``."""
    state = trainer.optimizer.shard_state()
    out = {}
    for fqn, layout in trainer.compiled.optimizer_layouts.items():
        everywhere = Layout(layout.shape, trainer.world, (len(trainer.world),), (Replicate(),))
        out[fqn] = execute(solve(layout, everywhere), state[fqn]["exp_avg"], trainer.comm) / (1 - OPT["betas"][0])
    return out


def hgraph_run(family: str):
    """Runs on every rank (module level so spawned processes can import it)."""
    model = zoo_model(family).eval()
    compiled = hgraph.compile(model, STRATEGIES, example_inputs=torch.randint(0, 256, (1, 8)))
    trainer = Trainer(compiled, micro_batch_tokens=64, **OPT)
    losses, params, grads = [], [], None
    for i, batch in enumerate(batches(model.config.vocab_size)):
        losses.append(trainer.step(batch, strategy=i % len(STRATEGIES)))
        grads = grads or first_step_gradients(trainer)
        params.append(trainer.full_parameters())
    return losses, params, grads


@pytest.mark.parametrize("family", ["mistral", pytest.param("phi3", marks=pytest.mark.slow),
                                    pytest.param("bloom", marks=pytest.mark.slow)])
def test_trained_on_gloo_processes_equals_adamw(family):
    results = hgraph.launch(hgraph_run, 4, args=(family,), timeout=400)
    ref_losses, ref_params, ref_grads = reference_run(family)
    for losses, params, grads in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, value in ref_grads.items():
            torch.testing.assert_close(grads[name], value, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       msg=lambda m: f"step 1 gradient of {name}: {m}")
        for it, (got, want) in enumerate(zip(params, ref_params)):
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=PARAM_ATOL,
                                           msg=lambda m: f"iter {it} {name}: {m}")
