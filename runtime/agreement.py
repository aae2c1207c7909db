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
whole by every rank, are compared whole (``check_same_parameters``): floating ones by the same
statistics, integer and bool ones (GPT-BigCode's causal-mask buffer, position tables) by a hash of
their bytes, exactly. A difference raises ``TrainingError`` on every rank, naming the first differing
tensor and ranks.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional

import torch

from hgraph.errors import TrainingError
from hgraph.runtime.kernels.comm import Communicator, Group

_SAMPLES = 64
_CHUNK = 1 << 12
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


def exact_rows(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Which rows of ``fingerprints`` are hashes (compared exactly)."""
    return torch.tensor([not t.is_floating_point() for t in tensors.values()], dtype=torch.bool)


def _equal(a: torch.Tensor, b: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Per row: fingerprints equal; statistics up to float64 summation order (a sum may cancel: measured
    against the norm), hashes (``exact`` rows) exactly."""
    scale = b.abs() + b[:, 1:2].abs()
    close = ~exact[:, None] & ((a - b).abs() <= _RTOL * scale)
    return ((a == b) | close | (a.isnan() & b.isnan())).all(dim=1)


def check_same_shards(
    own: torch.Tensor, witness: torch.Tensor, names: list[str], buffers: Mapping[str, torch.Tensor],
    comm: Communicator, group: Group, device: torch.device,
) -> None:
    """Raise ``TrainingError`` on every rank of ``group`` unless each rank's ``own`` shard fingerprints
    (``[len(names), 3]``, from ``fingerprints``) equal the ``witness`` fingerprints the rank before it
    took of the same shards, and all ranks hold equal ``buffers``."""
    if len(group) == 1:
        return
    every = comm.all_gather(torch.cat([own, witness]).to(device), group).cpu()  # [ranks, 2 * params, 3]
    n, floating = len(names), torch.zeros(len(names), dtype=torch.bool)
    for i, rank in enumerate(group):
        owner = (i + 1) % len(group)
        same = _equal(every[i, n:], every[owner, :n], floating)
        if not bool(same.all()):
            k = int((~same).nonzero()[0])
            more = f" (and {int((~same).sum()) - 1} more)" if int((~same).sum()) > 1 else ""
            raise TrainingError(
                f"rank {group[owner]} holds a different model than rank {rank}: its shard of '{names[k]}'{more} has "
                f"sum {float(every[owner, k, 0]):.6g}, rank {rank}'s source gives {float(every[i, n + k, 0]):.6g} for "
                "the same part; " + _ADVICE
            )
    check_same_parameters(buffers, comm, group, device)


def check_same_parameters(
    tensors: Mapping[str, torch.Tensor], comm: Communicator, group: Group, device: torch.device
) -> None:
    """Raise ``TrainingError`` on every rank of ``group`` unless all hold equal ``tensors`` (whole)."""
    if len(group) == 1 or not tensors:
        return
    every = comm.all_gather(fingerprints(tensors).to(device), group).cpu()  # [ranks, tensors, 3]
    exact = exact_rows(tensors)
    for i, rank in enumerate(group[1:], start=1):
        same = _equal(every[i], every[0], exact)
        if not bool(same.all()):
            bad = [name for name, ok in zip(tensors, same.tolist()) if not ok]
            k = list(tensors).index(bad[0])
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise TrainingError(
                f"rank {rank} holds a different model than rank {group[0]}: '{bad[0]}'{more} differs "
                f"({_described(every[i, k], every[0, k], not bool(exact[k]))}); " + _ADVICE
            )


def _described(other: torch.Tensor, ref: torch.Tensor, statistics: bool) -> str:
    if statistics:
        return f"sum {float(other[0]):.6g} vs {float(ref[0]):.6g}"
    return "its bytes differ"


def first_failure(message: Optional[str], comm: Communicator, world: Group,
                  device: torch.device) -> Optional[tuple[int, str]]:
    """Every rank's view of a step each rank tried on its own: ``(rank, message)`` of the first rank in
    ``world`` whose ``message`` is not ``None``, or ``None`` when every rank succeeded. Collective."""
    if len(world) == 1:
        return None if message is None else (world[0], message)
    flags = comm.all_gather(torch.tensor([0 if message is None else 1], device=device), world).reshape(-1).cpu()
    failed = [world[i] for i, flag in enumerate(flags.tolist()) if flag]
    if not failed:
        return None
    first = failed[0]
    text = (message or "?").encode() if comm.rank == first else b""
    size = comm.broadcast(torch.tensor([len(text)], device=device), first, world)
    buf = torch.zeros(int(size[0]), dtype=torch.uint8, device=device)
    if comm.rank == first:
        buf = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device)
    return first, bytes(comm.broadcast(buf, first, world).cpu().tolist()).decode()
