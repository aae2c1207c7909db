"""Packed micro-batches of documents and the oracle they must equal: the unmodified model run on each
document alone (shared by the zoo's attention-variant and linear-attention tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hgraph.core.batch import pack_micro_batch

ROWS = [(5, 17, 9, 40), (70, 1)]
"""Documents per row (two rows: one micro-batch each): one longer than every window, chunk and the
delta rule's 64-token chunks, one of a single token."""


def documents(vocab: int, rows=ROWS) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randint(0, vocab, (n,), generator=g) for n in row] for row in rows]


def packed(rows: list[list[torch.Tensor]], align: int = 1) -> dict[str, torch.Tensor]:
    """Each row packed as training packs it (positions restart at 0, each document's last token
    predicts nothing), padded to one length (a multiple of ``align``) with an ignored segment."""
    batches = [pack_micro_batch(row) for row in rows]
    length = max(b["input_ids"].shape[1] for b in batches)
    length += (-length) % align
    out: dict[str, list[torch.Tensor]] = {"input_ids": [], "position_ids": [], "targets": []}
    for b in batches:
        pad = length - b["input_ids"].shape[1]
        out["input_ids"].append(F.pad(b["input_ids"], (0, pad)))
        out["position_ids"].append(torch.cat([b["position_ids"], torch.arange(pad)[None]], 1))
        out["targets"].append(F.pad(b["targets"], (0, pad), value=-100))
    return {k: torch.cat(v) for k, v in out.items()}


def alone(model, rows):
    """The oracle: the unmodified model run on each document by itself (token-mean loss, gradients)."""
    docs = [d for row in rows for d in row if len(d) > 1]
    tokens = sum(len(d) - 1 for d in docs)
    model.zero_grad()
    total = 0.0
    for d in docs:
        loss = F.cross_entropy(model(d[None]).logits[0, :-1], d[1:], reduction="sum") / tokens
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return torch.tensor(total), grads


def mismatch(compiled, strategy, batch, ref) -> str:
    """'' when ``simulate`` of the packed ``batch`` equals ``ref`` (loss, every gradient), else the worst."""
    loss, grads = compiled.simulate(strategy, batch["input_ids"], batch["targets"], batch["position_ids"])
    ref_loss, ref_grads = ref
    if set(grads) != set(ref_grads):
        return f"gradient names differ: {sorted(set(grads) ^ set(ref_grads))[:3]}"
    worst = ""
    for name, want in [("loss", ref_loss), *ref_grads.items()]:
        got = loss if name == "loss" else grads[name]
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            worst = f"{name}: max abs error {(got - want).abs().max().item():.2e}"
    return worst
