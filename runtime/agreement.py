"""Every rank starts from the same model: checked once, before the Trainer takes its first shard.

Each rank takes its ZeRO shards from its own copy of the model. Copies that differ (an unseeded
construction in each process, or rank threads racing on torch's process-wide RNG) would make the
Trainer train a patchwork of parameters that no rank built, silently. Every rank therefore
contributes a fingerprint per parameter and buffer (float64 sum, norm, and a position-weighted sum of
a fixed sample, which catches permuted values) to one all-gather; any difference raises
``TrainingError`` on every rank, naming the first differing tensor and rank.
"""

from __future__ import annotations

from typing import Mapping

import torch

from hgraph.core.errors import TrainingError
from hgraph.runtime.kernels.comm import Communicator, Group

_SAMPLES = 64
# Equal models give equal fingerprints up to float64 summation order (another device kind).
_RTOL = 1e-9


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[len(tensors), 3]`` float64: sum, 2-norm and a position-weighted sample sum of each tensor."""
    rows = []
    for value in tensors.values():
        t = value.detach()
        flat = t.reshape(-1)
        step = max(1, flat.numel() // _SAMPLES)
        sample = flat[::step][:_SAMPLES].to(torch.float64)
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
        rows.append(torch.stack([
            torch.sum(t, dtype=torch.float64),
            torch.linalg.vector_norm(t, dtype=torch.float64),
            (sample * weights).sum(),
        ]).cpu())
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)


def check_same_parameters(
    tensors: Mapping[str, torch.Tensor], comm: Communicator, group: Group, device: torch.device
) -> None:
    """Raise ``TrainingError`` on every rank of ``group`` unless all hold equal ``tensors``."""
    if len(group) == 1 or not tensors:
        return
    mine = fingerprints(tensors)
    every = comm.all_gather(mine.to(device), group).cpu()  # [ranks, tensors, 3]
    ref = every[0]
    scale = ref.abs() + ref[:, 1:2].abs()  # a sum may cancel to ~0: measure against the norm too
    for i, rank in enumerate(group[1:], start=1):
        other = every[i]
        same = (other == ref) | ((other - ref).abs() <= _RTOL * scale) | (other.isnan() & ref.isnan())
        bad = [name for name, ok in zip(tensors, same.all(dim=1).tolist()) if not ok]
        if bad:
            k = list(tensors).index(bad[0])
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise TrainingError(
                f"rank {rank} holds a different model than rank {group[0]}: '{bad[0]}'{more} differs "
                f"(sum {float(other[k, 0]):.6g} vs {float(ref[k, 0]):.6g}); the Trainer shards every rank's "
                "own copy, so all ranks must start from the same parameters. Build the model with a fixed "
                "seed in every process (torch.manual_seed(seed) before construction, or "
                "hgraph.models.Llama(seed=...)); on simulated ranks (threads share torch's global RNG) build "
                "it once outside run_threads or through hgraph.core.seeding.seeded_model(key, seed, build)"
            )
