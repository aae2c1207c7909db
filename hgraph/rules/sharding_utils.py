"""Cut full tensors into one rank's local piece of a spec, and reassemble gradients from ranks.

Ranks of a ``(cp, tp)`` stage mesh are numbered row-major: rank ``c·tp + t`` sits at ``(c, t)``. Token
tensors split on cp use the load-balanced order of ``hgraph.core.batch.load_balance_indices``
(chunks ``c`` and ``2·cp−1−c`` of ``2·cp``) when ``token_order=True``; parameters use plain
``torch.chunk`` pieces. Used by the localize tests and by ``compiled.simulate``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hgraph.errors import ShardingRuleError
from hgraph.core.placement import InterleavedShard, Partial, Replicate, Shard
from hgraph.rules.base import CP, Spec, spec_str, TP
from hgraph.rules.mesh import MESH_DIMS
from hgraph.core.batch import load_balance_indices

Coord = tuple[int, int]


def mesh_coord(rank: int, mesh: Sequence[int]) -> Coord:
    """``(cp index, tp index)`` of stage-local ``rank``."""
    return (rank // mesh[TP], rank % mesh[TP])


def mesh_groups(rank: int, mesh: Sequence[int], base: int = 0) -> dict[str, tuple[int, ...]]:
    """The ``"cp"`` and ``"tp"`` groups (global ranks, offset by ``base``) of stage-local ``rank``."""
    c, t = mesh_coord(rank, mesh)
    return {
        "cp": tuple(base + i * mesh[TP] + t for i in range(mesh[CP])),
        "tp": tuple(base + c * mesh[TP] + j for j in range(mesh[TP])),
    }


def shard_for_rank(
    full: torch.Tensor, spec: Spec, mesh: Sequence[int], coord: Coord, *, token_order: bool = False
) -> torch.Tensor:
    """The piece of ``full`` that the rank at ``coord`` holds under ``spec``.

    Mesh dims cut in order (cp, then tp inside each cp piece). ``Partial`` cannot be cut from a full
    value (no rank's term is defined), so it raises.
    """
    out = full
    for m, placement in enumerate(spec):
        if isinstance(placement, Partial):
            raise ShardingRuleError(f"cannot cut a full tensor into the Partial spec {spec_str(spec)}")
        if not isinstance(placement, Shard) or mesh[m] == 1:
            continue
        dim = placement.dim % out.dim()
        size = out.shape[dim]
        if m == CP and token_order:
            out = out.index_select(dim, load_balance_indices(size, mesh[m], coord[m]).to(out.device))
            continue
        if isinstance(placement, InterleavedShard):
            out = torch.cat([block.chunk(mesh[m], dim)[coord[m]] for block in out.split(list(placement.blocks), dim)], dim)
            continue
        if size % mesh[m]:
            raise ShardingRuleError(
                f"dim {dim} of size {size} cannot be cut evenly over {MESH_DIMS[m]}={mesh[m]}"
            )
        out = out.chunk(mesh[m], dim)[coord[m]]
    return out.contiguous()


def assemble_grad(
    pieces: Mapping[Coord, torch.Tensor], spec: Spec, mesh: Sequence[int], *, token_order: bool = False
) -> torch.Tensor:
    """The full tensor from every rank's local piece: Partial dims summed, Shard dims concatenated,
    Replicate dims taken from index 0 (the inverse of ``shard_for_rank``, plus partial sums)."""
    missing = [(c, t) for c in range(mesh[CP]) for t in range(mesh[TP]) if (c, t) not in pieces]
    if missing:
        raise ShardingRuleError(f"assemble_grad: no piece for mesh coordinates {missing}")
    by_cp = {c: _combine([pieces[(c, t)] for t in range(mesh[TP])], spec[TP], TP, mesh, token_order) for c in range(mesh[CP])}
    return _combine([by_cp[c] for c in range(mesh[CP])], spec[CP], CP, mesh, token_order)


def _combine(
    parts: list[torch.Tensor], placement: object, m: int, mesh: Sequence[int], token_order: bool
) -> torch.Tensor:
    if isinstance(placement, Partial):
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total
    if isinstance(placement, Replicate) or len(parts) == 1:
        return parts[0]
    assert isinstance(placement, Shard)
    dim = placement.dim % parts[0].dim()
    if isinstance(placement, InterleavedShard):
        local = [b // len(parts) for b in placement.blocks]
        by_rank = [part.split(local, dim) for part in parts]
        return torch.cat([by_rank[r][b] for b in range(len(local)) for r in range(len(parts))], dim)
    whole = torch.cat(parts, dim)
    if m == CP and token_order:
        order = torch.cat([load_balance_indices(whole.shape[dim], mesh[m], c) for c in range(mesh[m])])
        restored = torch.empty_like(whole)
        restored.index_copy_(dim, order.to(whole.device), whole)
        return restored
    return whole
