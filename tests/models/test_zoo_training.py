"""Zoo families in their default configs trained by ``hgraph.Trainer`` on real gloo processes.

Every family: one packed step on tp2 (two processes) equal to ``torch.optim.AdamW`` on the unmodified
model (the two below by default, all with the slow tests). In depth: 3 iterations on 4
gloo processes, switching strategy every iteration, equal to single-process ``torch.optim.AdamW`` on
the unmodified model: Mistral (sliding window shorter than the longest sequences, grouped-query
attention), Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``, a pad token), Bloom (ALiBi inside each
packed document, its slopes cut with the heads over tp, documents cut into cp chunks), and two
mixtures of experts on the strategies their routing allows: Qwen3-MoE and DeepSeek-V3 (MLA, grouped
sigmoid router with score correction, shared experts, dense first layers).

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
from hgraph.core.layout import Layout
from hgraph.core.placement import Replicate
from hgraph.lnk import solve
from hgraph.runtime.kernels.reshard import execute
from hgraph.training.trainer import Trainer
from hgraph.models.zoo import FAMILIES, zoo_model
from hgraph.training.configs import AdamWConfig, RunConfig

STRATEGIES = ["tp2 + 2x tp1", "tp2,pp2", "2x cp2"]
MOE_STRATEGIES = ["tp2 + 2x tp1", "tp2,pp2", "2x tp1,pp2"]  # routing needs every token: no cp
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


def train_iterations(family: str, strategies: list[str]) -> tuple[list, list, dict, Trainer]:
    """The Trainer's losses, parameters after every step and first-step gradients, switching strategy
    every iteration; and the Trainer (for its history)."""
    model = zoo_model(family).eval()
    compiled = hgraph.compile(model, strategies, example_inputs=torch.randint(0, 256, (1, 8)))
    trainer = Trainer(compiled, optimizer=AdamWConfig(**OPT), run=RunConfig(micro_batch_tokens=64))
    losses, params, grads = [], [], None
    for i, batch in enumerate(batches(model.config.vocab_size)):
        losses.append(trainer.step(batch, strategy=i % len(strategies)))
        grads = grads or first_step_gradients(trainer)
        params.append(trainer.full_parameters())
    return losses, params, grads, trainer


def hgraph_run(family: str, strategies: list[str]):
    """Runs on every rank (module level so spawned processes can import it)."""
    return train_iterations(family, strategies)[:3]


@pytest.mark.parametrize("family, strategies", [
    ("mistral", STRATEGIES),
    pytest.param("phi3", STRATEGIES, marks=pytest.mark.slow),
    pytest.param("bloom", STRATEGIES, marks=pytest.mark.slow),  # ALiBi per document, slopes cut over tp
    pytest.param("qwen3_moe", MOE_STRATEGIES, marks=pytest.mark.slow),  # 16 experts, top-8, softmax router
    pytest.param("deepseek_v3", MOE_STRATEGIES, marks=pytest.mark.slow),  # MLA, grouped sigmoid router, shared experts
])
def test_trained_on_gloo_processes_equals_adamw(family, strategies):
    results = hgraph.launch(hgraph_run, 4, args=(family, strategies), timeout=600)
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


# ----------------------------------------------------------------------------- every family, one step
# One Trainer step of every zoo family on two gloo processes, tp2 (so every tensor-parallel rule and
# the start-up agreement check run on real ranks), packed: documents of these lengths, micro-batches
# of at most 32 tokens, so each holds several documents. The oracle is the unmodified model with
# torch.optim.AdamW, each document run on its own.
DOCUMENTS = (13, 5, 21, 9, 17, 3, 11, 7)
PACKED_TOKENS = 32
# Layers without a packed kernel (Mamba's selective scan, MiniMax's lightning attention): compile refuses them.
UNSUPPORTED_LAYERS = {"falcon_h1", "nemotron_h", "minimax"}
STEP_ATOL = OPT["lr"] / OPT["eps"] * GRAD_ATOL  # one step of Adam's amplification bound (see above)


def documents(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=g) for n in DOCUMENTS]


def train_families(families: list[str]) -> dict[str, object]:
    """On every rank: one packed tp2 step per family; its loss, parameters and micro-batch sizes, or
    the error it raised (module level so spawned processes can import it)."""
    out: dict[str, object] = {}
    for family in families:
        model = zoo_model(family).eval()
        try:
            compiled = hgraph.compile(model, ["tp2"], example_inputs=torch.randint(0, 256, (1, 8)))
            trainer = Trainer(compiled, optimizer=AdamWConfig(**OPT),
                              run=RunConfig(micro_batch_tokens=PACKED_TOKENS))
            batch = documents(model.config.vocab_size)
            packing = [len(mb) for mb in trainer.dispatch([len(d) for d in batch]).micro_batches[0]]
            loss = trainer.step(batch)
            out[family] = (loss, trainer.full_parameters(), packing)
        except (hgraph.HGraphError, RuntimeError) as exc:
            out[family] = f"{type(exc).__name__}: {exc}"
    return out


def adamw_step(family: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = zoo_model(family).eval()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    batch = documents(model.config.vocab_size)
    tokens = sum(len(d) - 1 for d in batch)
    total = 0.0
    for d in batch:
        loss = F.cross_entropy(model(d[None]).logits[0, :-1], d[1:], reduction="sum") / tokens
        loss.backward()
        total += loss.item()
    opt.step()
    return total, {n: p.detach().clone() for n, p in model.named_parameters()}


def mismatches(families: list[str]) -> dict[str, str]:
    """Train ``families`` in one launch; per family '' when every rank equals AdamW, else what differs."""
    results = hgraph.launch(train_families, 2, args=(families,), timeout=1200)
    out = {}
    for family in families:
        want_loss, want_params = adamw_step(family)
        out[family] = ""
        for rank, result in enumerate(results):
            got = result[family]
            if isinstance(got, str):
                out[family] = f"rank {rank}: {got}"
                break
            loss, params, packing = got
            assert max(packing) > 1, f"{family}: micro-batches {packing} hold one document each"
            try:
                torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"loss: {m}")
                for name, value in want_params.items():
                    torch.testing.assert_close(params[name], value, rtol=1e-5, atol=STEP_ATOL,
                                               msg=lambda m: f"{name}: {m}")
            except AssertionError as exc:
                out[family] = f"rank {rank}: {str(exc).splitlines()[0]}"
                break
    return out


def test_gpt_bigcode_and_gemma2_train_one_packed_tp2_step_on_gloo_ranks():
    """GPT-BigCode has a bool causal-mask buffer (the start-up agreement check took its norm and
    stopped every Trainer); Gemma 2 soft-caps and windows its attention."""
    assert mismatches(["gpt_bigcode", "gemma2"]) == {"gpt_bigcode": "", "gemma2": ""}


@pytest.mark.slow  # every family in one launch: several minutes on two cores
@pytest.mark.timeout(1500)  # the launch's own 1200 s first; pytest-timeout's 600 s cut it under load
def test_every_zoo_family_trains_one_packed_tp2_step_on_gloo_ranks():
    got = mismatches(list(FAMILIES))
    wrong = {f: why for f, why in got.items() if why and f not in UNSUPPORTED_LAYERS}
    assert not wrong, wrong
    for family in UNSUPPORTED_LAYERS:  # refused at compile, naming the layer (tests/models/test_zoo.py)
        assert "TraceError: " in got[family] and "carries a state" in got[family], (family, got[family])
