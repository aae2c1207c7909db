"""The optimization side's fixed layout: every parameter sharded over all ranks (ZeRO style).

The fp32 master weights and the AdamW states live in this layout for the whole run; strategies
change only the compute layouts that Pull Parameter fills and Push Gradient drains. Each parameter
is cut along one dim over all ``world_size`` ranks with the ``torch.chunk`` rule: the first dim at
least as long as the world (so no rank is left empty), else the longest dim. Cutting along a tensor
dim, instead of flattening, keeps every shard a box, so the layout solver plans moves to and from
any compute layout exactly (a flattened range of a column-sharded weight is no box). A fused
projection that some strategy cuts block by block (``InterleavedShard``) is cut the same way here,
when every block divides over the world: a tp rank's Pull then reads what it would for separate
projections. An expert weight ``[E, ...]`` (one slice per routed expert) is cut along its expert
dim, so a rank's shard is whole experts and an expert-parallel Pull reads whole experts from few
ranks: over all ranks when they divide the experts, else as a ``(E, world/E)`` mesh (each expert
cut along its longest other dim) when the experts divide the world.
"""

from __future__ import annotations

from typing import Optional, Sequence

from hgraph.core.placement import InterleavedShard, Replicate, Shard
from hgraph.core.layout import Layout


def shard_dim(shape: Sequence[int], world_size: int) -> int:
    """The tensor dim the optimizer layout cuts (see module docstring); 0 for scalars' sake."""
    if not shape:
        return -1
    for dim, size in enumerate(shape):
        if size >= world_size:
            return dim
    return max(range(len(shape)), key=lambda d: shape[d])


def optimizer_layout(
    shape: Sequence[int], world_size: int, interleaved: Optional[InterleavedShard] = None, expert: bool = False
) -> Layout:
    """The fixed ZeRO layout of a parameter of ``shape`` over ranks ``0..world_size-1``;
    ``interleaved``: the block placement its compute layouts use, if any; ``expert``: a weight with
    one slice per routed expert along dim 0."""
    ranks = tuple(range(world_size))
    if expert and len(shape) > 1:
        experts = shape[0]
        if experts % world_size == 0:
            return Layout(tuple(shape), ranks, (world_size,), (Shard(0),))
        if world_size % experts == 0:
            inner = 1 + max(range(len(shape) - 1), key=lambda d: shape[d + 1])
            return Layout(tuple(shape), ranks, (experts, world_size // experts), (Shard(0), Shard(inner)))
    if interleaved is not None and all(b % world_size == 0 for b in interleaved.blocks):
        return Layout(tuple(shape), ranks, (world_size,), (interleaved,))
    dim = shard_dim(shape, world_size)
    if dim < 0:
        return Layout(tuple(shape), ranks, (world_size,), (Replicate(),))
    return Layout(tuple(shape), ranks, (world_size,), (Shard(dim),))
