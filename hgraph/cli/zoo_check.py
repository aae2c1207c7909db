"""Checking a zoo family: compile its model for each strategy kind and compare ``simulate`` with the
unmodified model (``check_family``). The zoo test (``tests/models/test_zoo.py``) and
``benchmarks/model_zoo.py`` (the README's supported-models table) run it on every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hgraph.core.errors import HGraphError
from hgraph.models.zoo import zoo_model

STRATEGY_KINDS: dict[str, str] = {
    "tp + dp": "tp2 + 2x tp1",
    "tp x pp": "tp2,pp2",
    "dp x pp": "2x tp1,pp2",
    "cp": "2x cp2",
}
"""Strategy kind -> the world-4 strategy the zoo compiles for it."""


@dataclass(frozen=True)
class ZooResult:
    """One (family, strategy) outcome: ``equal`` (loss and every gradient within tolerance),
    ``wrong`` (a silent mismatch: the worst relative error) or ``error`` (the HGraphError raised)."""

    family: str
    strategy: str
    status: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.family:12s} {self.strategy:14s} {self.status}" + (f": {self.detail}" if self.detail else "")


def reference_gradients(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unmodified model's token-mean next-token loss and gradients (the oracle; no hgraph code)."""
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    model.zero_grad()
    logits = model(ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def _compare(loss, grads, ref_loss, ref_grads, rtol: float, atol: float) -> str:
    """'' when equal, else the worst mismatch."""
    if set(grads) != set(ref_grads):
        return f"gradient names differ: {sorted(set(grads) ^ set(ref_grads))[:3]}"
    worst, where = 0.0, ""
    for name, want in [("loss", ref_loss), *ref_grads.items()]:
        got = loss if name == "loss" else grads[name]
        excess = ((got - want).abs() - (atol + rtol * want.abs())).max().item()
        if excess > worst:
            scale = want.abs().max().clamp_min(1e-12).item()
            worst, where = excess, f"{name}: max relative error {(got - want).abs().max().item() / scale:.2e}"
    return where


def check_family(
    name: str,
    strategies: Sequence[str] = tuple(STRATEGY_KINDS.values()),
    batch: tuple[int, int] = (4, 24),
    example: tuple[int, int] = (2, 8),
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> list[ZooResult]:
    """Compile the family's model (eval mode) for each strategy; ``simulate`` against the model.

    The batch is longer than the example and than the zoo's sliding windows. Strategies without cp
    are compiled together (one trace), each cp strategy on its own, so one refusal names itself.
    """
    from hgraph.compiler import entry

    model = zoo_model(name).eval()
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, batch, generator=generator)
    example_ids = torch.randint(0, vocab, example, generator=generator)
    ref_loss, ref_grads = reference_gradients(model, ids)
    groups = [[s for s in strategies if "cp" not in s]] + [[s] for s in strategies if "cp" in s]
    results = []
    for group in (g for g in groups if g):
        try:
            compiled = entry.compile(model, group, example_inputs=example_ids)
        except HGraphError as exc:
            results += [ZooResult(name, s, "error", f"{type(exc).__name__}: {exc}") for s in group]
            continue
        for index, strategy in enumerate(group):
            try:
                loss, grads = compiled.simulate(index, ids)
            except HGraphError as exc:
                results.append(ZooResult(name, strategy, "error", f"{type(exc).__name__}: {exc}"))
                continue
            mismatch = _compare(loss, grads, ref_loss, ref_grads, rtol, atol)
            results.append(ZooResult(name, strategy, "wrong" if mismatch else "equal", mismatch))
    return results


__all__ = ["STRATEGY_KINDS", "ZooResult", "check_family", "reference_gradients"]
