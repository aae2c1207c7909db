"""Every rank starts from the same model: checked once, when the Trainer has taken its shards.

Each rank takes its ZeRO shards from its own source: its copy of the model, the checkpoint files it
reads, or its own run of the model's initialisation. Sources that differ (an unseeded construction in
each process, rank threads racing on torch's process-wide RNG, another file on another node) would
make the Trainer train a patchwork of parameters that no rank built, silently.

No rank holds the model whole, so the check compares shards: every rank also takes from its source
the shard of the *next* rank (its witness shard) and fingerprints it (float64 sum, norm, and a
position-weighted sum of a fixed sample, which catches permuted values). One all-gather of these
fingerprints (three numbers per parameter and rank) then compares, for every parameter and rank, the
shard its owner holds with what the rank before it read for it: every part of every parameter is seen
by two ranks, round the ring, so any two sources that differ on any shard are caught. Buffers, held
whole by every rank, are compared whole. A difference raises ``TrainingError`` on every rank, naming
the first differing tensor and ranks.
"""

from __future__ import annotations

from typing import Mapping

import torch

from hgraph.core.errors import TrainingError
from hgraph.runtime.kernels.comm import Communicator, Group

_SAMPLES = 64
_CHUNK = 1 << 12
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
        total = torch.zeros((), dtype=torch.float64, device=t.device)
        squares = torch.zeros((), dtype=torch.float64, device=t.device)
        for chunk in flat.split(_CHUNK):  # float64 a chunk at a time: no float64 copy of the whole shard
            wide = chunk.to(torch.float64)
            total += wide.sum()
            squares += wide.square().sum()
        rows.append(torch.stack([total, squares.sqrt(), (sample * weights).sum()]).cpu())
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)


_ADVICE = (
    "all ranks must start from the same parameters. Build the model with a fixed seed in every process "
    "(torch.manual_seed(seed) before construction, or hgraph.models.Llama(seed=...)), give every rank the same "
    "weights= checkpoint and init_seed; on simulated ranks (threads share torch's global RNG) build it once "
    "outside run_threads or through hgraph.core.seeding.seeded_model(key, seed, build)"
)


def _equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: fingerprints equal up to float64 summation order (a sum may cancel: measured against the norm)."""
    scale = b.abs() + b[:, 1:2].abs()
    return ((a == b) | ((a - b).abs() <= _RTOL * scale) | (a.isnan() & b.isnan())).all(dim=1)


def check_same_shards(
    own: torch.Tensor, witness: torch.Tensor, names: list[str], buffers: Mapping[str, torch.Tensor],
    comm: Communicator, group: Group, device: torch.device,
) -> None:
    """Raise ``TrainingError`` on every rank of ``group`` unless each rank's ``own`` shard fingerprints
    (``[len(names), 3]``, from ``fingerprints``) equal the ``witness`` fingerprints the rank before it
    took of the same shards, and all ranks hold equal ``buffers``."""
    if len(group) == 1:
        return
    mine = torch.cat([own, witness, fingerprints(buffers)])
    every = comm.all_gather(mine.to(device), group).cpu()  # [ranks, 2 * params + buffers, 3]
    n = len(names)
    for i, rank in enumerate(group):
        owner = (i + 1) % len(group)
        same = _equal(every[i, n:2 * n], every[owner, :n])
        if not bool(same.all()):
            k = int((~same).nonzero()[0])
            more = f" (and {int((~same).sum()) - 1} more)" if int((~same).sum()) > 1 else ""
            raise TrainingError(
                f"rank {group[owner]} holds a different model than rank {rank}: its shard of '{names[k]}'{more} has "
                f"sum {float(every[owner, k, 0]):.6g}, rank {rank}'s source gives {float(every[i, n + k, 0]):.6g} for "
                "the same part; " + _ADVICE
            )
    ref = every[0, 2 * n:]
    for i, rank in enumerate(group[1:], start=1):
        same = _equal(every[i, 2 * n:], ref)
        if not bool(same.all()):
            k = int((~same).nonzero()[0])
            raise TrainingError(f"rank {rank} holds a different buffer '{list(buffers)[k]}' than rank {group[0]}; " + _ADVICE)
