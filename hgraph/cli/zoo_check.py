"""Checking a model the way the zoo does: compile it for each strategy kind and compare ``simulate`` of
packed documents — dispatched and packed as ``Trainer.step`` packs them — with the unmodified model run
on each document alone, loss and every gradient (``check_model``; ``check_family`` for a zoo family).
The zoo test (``tests/models/test_zoo.py``) and ``benchmarks/model_zoo.py`` (the README's
supported-models table) run it on every family; a new family is checked with ``check_model`` before
it joins ``hgraph.models.zoo.FAMILIES``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hgraph.compiler import entry
from hgraph.compiler.packing_proof import PackingWarning
from hgraph.errors import HGraphError, InputError, PackingError
from hgraph.frontend.loss_module import output_logits
from hgraph.models.zoo import zoo_model
from hgraph.program.options import CompileOptions

STRATEGY_KINDS: dict[str, str] = {
    "tp + dp": "tp2 + 2x tp1",
    "tp x pp": "tp2,pp2",
    "dp x pp": "2x tp1,pp2",
    "cp": "2x cp2",
}
"""Strategy kind -> the world-4 strategy the zoo compiles for it."""

DOCUMENT_LENGTHS: tuple[int, ...] = (5, 17, 9, 24, 3, 30, 11)
"""The zoo's batch: documents of these lengths, packed as training packs them. Longer than the example
(8 tokens) and than the zoo's sliding windows; several share a micro-batch on every strategy kind,
and under ``2x cp2`` they cross the cp chunk boundaries."""


@dataclass(frozen=True)
class ZooResult:
    """One (family, strategy) outcome: ``equal`` (loss and every gradient within tolerance),
    ``wrong`` (a silent mismatch: the worst relative error) or ``error`` (the HGraphError raised);
    ``packing``: what training does with the family's documents (``packing_label``)."""

    family: str
    strategy: str
    status: str
    detail: str = ""
    packing: str = ""

    def __str__(self) -> str:
        packing = f" [{self.packing}]" if self.packing else ""
        return f"{self.family:12s} {self.strategy:14s} {self.status}{packing}" + (f": {self.detail}" if self.detail else "")


def packing_label(proof: Any) -> str:
    """``packed (graph)`` / ``packed (probe)``: proved exact that way; ``one document per micro-batch``."""
    return f"packed ({proof.method})" if proof.packs else proof.packing


def zoo_documents(vocab: int, lengths: Sequence[int] = DOCUMENT_LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    """Random documents (1-D token ids) of ``lengths``, seeded."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def reference_gradients(
    model: nn.Module, batch: torch.Tensor | Sequence[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unmodified model's token-mean next-token loss and gradients (the oracle; no hgraph code).

    ``batch``: a list of documents, each run through the model *alone* (what packed training must
    equal), or a ``[batch, seq]`` tensor run as it is."""
    documents = [batch] if isinstance(batch, torch.Tensor) else [d[None] for d in batch]
    tokens = sum(d.shape[0] * (d.shape[1] - 1) for d in documents)
    model.zero_grad()
    total = torch.zeros(())
    for ids in documents:
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        logits = output_logits(model(ids))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        (loss / tokens).backward()
        total = total + loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return total / tokens, grads


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


def model_vocab(model: nn.Module) -> int:
    """``model.config.vocab_size``, else the ``num_embeddings`` of the first ``nn.Embedding`` in ``model``."""
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise InputError(f"{type(model).__name__}: no config.vocab_size and no nn.Embedding to read the vocabulary from; "
                      "pass documents= with token ids the model accepts")


def check_model(
    model: nn.Module,
    strategies: Sequence[str] = tuple(STRATEGY_KINDS.values()),
    documents: Sequence[torch.Tensor] | None = None,
    example: tuple[int, int] = (2, 8),
    rtol: float = 1e-5,
    atol: float = 1e-6,
    name: str = "",
    options: CompileOptions = CompileOptions(),
) -> list[ZooResult]:
    """Compile ``model`` (in the mode it is in) for each strategy; ``simulate`` the packed ``documents``
    (default: ``zoo_documents`` of ``DOCUMENT_LENGTHS``) exactly as training packs them, against the
    unmodified model run on each document alone — loss and every gradient.

    Strategies without cp are compiled together (one trace), each cp strategy on its own, so one
    refusal names itself. Any model works, so a new family is checked before it joins ``FAMILIES``:
    ``check_model(AutoModelForCausalLM.from_config(config).eval())``. The vocabulary is
    ``config.vocab_size``, else the size of the model's first ``nn.Embedding``. ``options``: passed to
    ``compile`` (``CompileOptions(max_seq_len=...)`` where the model's length check asks for it).
    """
    vocab = model_vocab(model)
    if documents is None:
        documents = zoo_documents(vocab)
    example_ids = torch.randint(0, vocab, example, generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = reference_gradients(model, documents)
    name = name or type(model).__name__
    groups = [[s for s in strategies if "cp" not in s]] + [[s] for s in strategies if "cp" in s]
    results = []
    for group in (g for g in groups if g):
        try:
            with warnings.catch_warnings():  # an unproved model's PackingWarning: kept in the result
                warnings.simplefilter("ignore", PackingWarning)
                compiled = entry.compile(model, group, example_inputs=example_ids, options=options)
        except HGraphError as exc:
            packing = "refused" if isinstance(exc, PackingError) else ""
            results += [ZooResult(name, s, "error", f"{type(exc).__name__}: {exc}", packing) for s in group]
            continue
        packing = packing_label(compiled.packing)
        for index, strategy in enumerate(group):
            try:
                loss, grads = compiled.simulate(index, list(documents))
            except HGraphError as exc:
                results.append(ZooResult(name, strategy, "error", f"{type(exc).__name__}: {exc}", packing))
                continue
            mismatch = _compare(loss, grads, ref_loss, ref_grads, rtol, atol)
            results.append(ZooResult(name, strategy, "wrong" if mismatch else "equal", mismatch, packing))
    order = {s: i for i, s in enumerate(strategies)}
    return sorted(results, key=lambda r: order[r.strategy])


def check_family(
    name: str,
    strategies: Sequence[str] = tuple(STRATEGY_KINDS.values()),
    lengths: Sequence[int] = DOCUMENT_LENGTHS,
    **tolerances: float,
) -> list[ZooResult]:
    """``check_model`` of the zoo family ``name`` (eval mode) on documents of ``lengths``."""
    model = zoo_model(name).eval()
    return check_model(model, strategies, zoo_documents(model.config.vocab_size, lengths), name=name, **tolerances)


__all__ = ["DOCUMENT_LENGTHS", "STRATEGY_KINDS", "ZooResult", "check_family", "check_model", "packing_label",
           "reference_gradients", "zoo_documents"]
