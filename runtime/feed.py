"""The data feed: rank 0 reads the global batch; every rank learns the lengths and receives only the
tokens of the sequences its pipeline runs.

Per batch: rank 0 broadcasts the lengths (a small JSON payload, which also carries "no more data"
or rank 0's data error, so no rank waits forever), every rank computes or receives the dispatch
from the lengths alone, then rank 0 sends each rank one flat tensor holding its pipeline's
sequences (point-to-point), which the rank splits by the lengths it already knows.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import torch

from hgraph.errors import HGraphError, InputError


def share_lengths(trainer: Any, read: Any) -> Optional[list[int]]:
    """Rank 0 calls ``read()`` for the next batch (``None`` or ``StopIteration``: no more data) and
    keeps it in ``trainer``; every rank returns its lengths, or ``None`` at the end of the data."""
    payload = b""
    if trainer.rank == 0:
        try:
            batch = read()
            message: dict[str, Any] = {"end": True} if batch is None else {"lengths": [len(s) for s in batch]}
        except StopIteration:
            batch, message = None, {"end": True}
        except HGraphError as exc:
            batch, message = None, {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - e.g. a file vanished: report it on every rank, never hang
            batch, message = None, {"error": f"reading the next batch failed ({type(exc).__name__}: {exc})"}
        trainer._feed_batch = batch
        payload = json.dumps(message).encode()
    decided = json.loads(trainer._broadcast_bytes(payload))
    if "error" in decided:
        raise InputError(decided["error"])
    return None if decided.get("end") else list(decided["lengths"])


def scatter_sequences(trainer: Any, dispatch: Any, lengths: Sequence[int]) -> dict[int, torch.Tensor]:
    """This rank's sequences of the batch rank 0 holds (``trainer._feed_batch``), by batch index."""
    strategy = trainer.compiled.strategies[dispatch.strategy_index]

    def indices(rank: int) -> list[int]:
        return [i for mb in dispatch.micro_batches[strategy.pipeline_of(rank)] for i in mb]

    mine = indices(trainer.rank)
    if trainer.rank == 0:
        batch = trainer._feed_batch
        sends = []
        for r in trainer.world[1:]:
            idx = indices(r)
            if idx:
                flat = torch.cat([batch[i].reshape(-1).to(torch.long) for i in idx]).to(trainer.device)
                sends.append((r, flat))
        if sends:
            trainer.comm.exchange(sends, [])
        trainer._feed_batch = None
        return {i: batch[i] for i in mine}
    if not mine:
        return {}
    buf = torch.empty(sum(lengths[i] for i in mine), dtype=torch.long, device=trainer.device)
    trainer.comm.exchange([], [(0, buf)])
    parts = torch.split(buf.cpu(), [lengths[i] for i in mine])
    return dict(zip(mine, parts))
