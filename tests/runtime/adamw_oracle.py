"""The training oracle of the runtime tests: the unmodified model, one process, ``torch.optim.AdamW``.

Each sequence is its own forward pass and the loss is the token mean over the whole global batch,
which is what every compiled strategy, dispatch and packing must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReferenceRun:
    losses: list[float]  # per iteration
    norms: list[float]  # gradient norm before clipping, per iteration (empty without clipping)
    params: list[dict[str, torch.Tensor]]  # after each iteration


def single_process_adamw(
    model: torch.nn.Module, batches: list[list[torch.Tensor]], grad_clip: float | None = None, **adamw
) -> ReferenceRun:
    """Train ``model`` on ``batches`` (lists of token sequences) with AdamW(``**adamw``)."""
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    losses, norms, params = [], [], []
    for batch in batches:
        tokens = sum(len(s) - 1 for s in batch)
        opt.zero_grad()
        total = 0.0
        for s in batch:
            out = model(s[None])
            logits = out.logits if hasattr(out, "logits") else out
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], s[1:], reduction="sum") / tokens
            loss.backward()
            total += float(loss.detach())
        if grad_clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        opt.step()
        losses.append(total)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return ReferenceRun(losses, norms, params)


def assert_matches_reference(result, reference, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``(losses, params per iteration)`` of a run equal the reference's, every iteration."""
    losses, params = result
    ref_losses, ref_params = reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    for it, (got, want) in enumerate(zip(params, ref_params)):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=lambda m: f"iter {it} {name}: {m}")
