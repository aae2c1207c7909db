"""Every rank starts from the same model: checked once, before the Trainer takes its first shard.

Each rank takes its ZeRO shards from its own copy of the model. Copies that differ (an unseeded
construction in each process, or rank threads racing on torch's process-wide RNG) would make the
Trainer train a patchwork of parameters that no rank built, silently. Every rank therefore
contributes a fingerprint per parameter and buffer to one all-gather: for floating tensors a float64
sum, norm and position-weighted sum of a fixed sample (which catches permuted values), compared up to
summation order; for integer and bool tensors (GPT-BigCode's causal-mask buffer, position tables) a
hash of their bytes, compared exactly. Any difference raises ``TrainingError`` on every rank, naming
the first differing tensor and rank.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch

from hgraph.core.errors import TrainingError
from hgraph.runtime.kernels.comm import Communicator, Group

_SAMPLES = 64
# Equal models give equal fingerprints up to float64 summation order (another device kind).
_RTOL = 1e-9


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[len(tensors), 3]`` float64: per floating tensor its sum, 2-norm and a position-weighted sample
    sum; per other tensor (integer, bool, complex) three 32-bit words of a hash of its bytes (``exact_rows``)."""
    rows = []
    for value in tensors.values():
        t = value.detach()
        if not t.is_floating_point():
            data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            digest = hashlib.blake2b(data + str(t.dtype).encode(), digest_size=12).digest()
            rows.append(torch.tensor([int.from_bytes(digest[i : i + 4], "little") for i in (0, 4, 8)],
                                     dtype=torch.float64))
            continue
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


def exact_rows(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Which rows of ``fingerprints`` are hashes (compared exactly)."""
    return torch.tensor([not t.is_floating_point() for t in tensors.values()], dtype=torch.bool)


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
    close = ~exact_rows(tensors)[:, None]  # hashes must be equal; statistics up to summation order
    for i, rank in enumerate(group[1:], start=1):
        other = every[i]
        same = (other == ref) | (close & ((other - ref).abs() <= _RTOL * scale)) | (other.isnan() & ref.isnan())
        bad = [name for name, ok in zip(tensors, same.all(dim=1).tolist()) if not ok]
        if bad:
            k = list(tensors).index(bad[0])
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise TrainingError(
                f"rank {rank} holds a different model than rank {group[0]}: '{bad[0]}'{more} differs "
                f"({_described(other[k], ref[k], bool(close[k]))}); the Trainer shards every rank's "
                "own copy, so all ranks must start from the same parameters. Build the model with a fixed "
                "seed in every process (torch.manual_seed(seed) before construction, or "
                "hgraph.models.Llama(seed=...)); on simulated ranks (threads share torch's global RNG) build "
                "it once outside run_threads or through hgraph.core.seeding.seeded_model(key, seed, build)"
            )


def _described(other: torch.Tensor, ref: torch.Tensor, statistics: bool) -> str:
    if statistics:
        return f"sum {float(other[0]):.6g} vs {float(ref[0]):.6g}"
    return "its bytes differ"
