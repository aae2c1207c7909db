"""Layouts and layout unions: where each piece of a tensor lives (placements: ``hgraph.core.placement``).

A ``Layout`` places one global tensor on an ordered tuple of ranks arranged as a mesh (row-major:
``ranks[i]`` sits at mesh coordinate ``unravel(i, mesh)``). Each mesh dim carries one placement:

* ``Shard(d)``   the tensor dim ``d`` is cut into ``mesh[m]`` chunks along that mesh dim;
* ``Replicate()`` every coordinate along the mesh dim holds the same data;
* ``Partial()``  the true value is the *sum* over the coordinates of that mesh dim;
* ``InterleavedShard(d, blocks)`` dim ``d`` is consecutive blocks (a fused projection's q, k, v or
  gate, up) and *each block* is cut along the mesh dim: a rank holds its chunk of every block,
  concatenated in block order (Megatron's fused-QKV sharding; DTensor's ``_StridedShard`` for equal
  blocks). Its rank holds several boxes (``regions``); no other mesh dim may cut dim ``d``.

Split rule (as ``torch.chunk`` and DTensor): a dim of size ``n`` cut into ``k`` chunks gets chunks of
``ceil(n / k)`` elements, the last non-empty chunk takes the remainder and trailing chunks may be empty.
Several mesh dims may shard the same tensor dim; they cut it in mesh-dim order (the first mesh dim cuts
the whole dim, the next one cuts each of those chunks, and so on), so every rank holds one box.

A ``LayoutUnion`` joins the layouts of the pipelines of one heterogeneous strategy (disjoint ranks):
``"split"`` (pipeline ``i`` holds rows ``offset_i : offset_i + size_i`` of dim 0, its layout's shape
is that part), ``"duplicate"`` (every pipeline holds the whole tensor) or ``"partial"`` (the true value
is the sum over pipelines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Union

from hgraph.errors import LayoutError
from hgraph.core.placement import InterleavedShard, Partial, Placement, Replicate, Shard, parse_placement

Box = tuple[tuple[int, int], ...]
"""A hyper-rectangle of a global tensor: one ``(start, stop)`` per tensor dim."""


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` elements are cut into ``parts`` (torch.chunk)."""
    step = math.ceil(size / parts) if size else 0
    start = min(index * step, size)
    stop = min(start + step, size)
    return start, stop


def unravel(index: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major mesh coordinate of flat position ``index``."""
    coords = []
    for extent in reversed(mesh):
        coords.append(index % extent)
        index //= extent
    return tuple(reversed(coords))


def box_numel(box: Box) -> int:
    """Number of elements in a box."""
    return math.prod(stop - start for start, stop in box)


@dataclass(frozen=True)
class Layout:
    """One global tensor placed on a mesh of ranks (see the module docstring for the rules)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    mesh: tuple[int, ...]
    placements: tuple[Placement, ...]
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "shape", tuple(int(s) for s in self.shape))
        set_(self, "ranks", tuple(int(r) for r in self.ranks))
        set_(self, "mesh", tuple(int(m) for m in self.mesh))
        placements = tuple(parse_placement(p) if isinstance(p, str) else p for p in self.placements)
        ndim = len(self.shape)
        if any(s < 0 for s in self.shape):
            raise LayoutError(f"shape {self.shape} has a negative size")
        if not self.mesh or any(m < 1 for m in self.mesh):
            raise LayoutError(f"mesh {self.mesh} must have at least one dim and every extent >= 1")
        if math.prod(self.mesh) != len(self.ranks):
            raise LayoutError(
                f"mesh {self.mesh} has {math.prod(self.mesh)} positions but {len(self.ranks)} ranks "
                f"{self.ranks} were given; the mesh product must equal the number of ranks"
            )
        if len(set(self.ranks)) != len(self.ranks):
            raise LayoutError(f"ranks {self.ranks} contain duplicates; each rank may appear once")
        if any(r < 0 for r in self.ranks):
            raise LayoutError(f"ranks {self.ranks} contain a negative rank")
        if len(placements) != len(self.mesh):
            raise LayoutError(
                f"{len(placements)} placements {placements} for a mesh of {len(self.mesh)} dims "
                f"{self.mesh}; give exactly one placement per mesh dim"
            )
        normalized = []
        for p in placements:
            if not isinstance(p, (Shard, Replicate, Partial)):
                raise LayoutError(f"placement {p!r} is not Shard, Replicate or Partial")
            if isinstance(p, Shard):
                if not -ndim <= p.dim < ndim:
                    raise LayoutError(
                        f"placement {p} shards dim {p.dim} but the tensor of shape {self.shape} has "
                        f"{ndim} dims (valid: 0..{ndim - 1})"
                    )
                p = replace(p, dim=p.dim % ndim)
            normalized.append(p)
        for p in normalized:
            if isinstance(p, InterleavedShard):
                if sum(p.blocks) != self.shape[p.dim]:
                    raise LayoutError(
                        f"placement {p} has blocks summing to {sum(p.blocks)} but dim {p.dim} of {self.shape} "
                        f"has {self.shape[p.dim]} elements"
                    )
                if sum(isinstance(q, Shard) and q.dim == p.dim for q in normalized) > 1:
                    raise LayoutError(f"placements {tuple(normalized)}: an interleaved dim is cut by one mesh dim only")
        set_(self, "placements", tuple(normalized))
        set_(self, "_index", {r: i for i, r in enumerate(self.ranks)})

    # ------------------------------------------------------------------ queries
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    @property
    def num_terms(self) -> int:
        """How many partial terms sum up to the value (1 when nothing is Partial)."""
        return math.prod(m for m, p in zip(self.mesh, self.placements) if isinstance(p, Partial))

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of ``rank``."""
        try:
            return unravel(self._index[rank], self.mesh)
        except KeyError:
            raise LayoutError(f"rank {rank} is not in layout ranks {self.ranks}") from None

    @property
    def interleaved_dim(self) -> int | None:
        """The tensor dim of an ``InterleavedShard`` placement (``None`` without one)."""
        dims = [p.dim for p in self.placements if isinstance(p, InterleavedShard)]
        return dims[0] if dims else None

    def regions(self, rank: int) -> tuple[Box, ...]:
        """The global boxes ``rank`` holds, in the order its local tensor concatenates them (along
        the interleaved dim); one box unless a placement is an ``InterleavedShard``."""
        coords = self.coords(rank)
        boxes = [[(0, s) for s in self.shape]]
        for mesh_dim, placement in enumerate(self.placements):
            if not isinstance(placement, Shard):
                continue
            d, parts, index = placement.dim, self.mesh[mesh_dim], coords[mesh_dim]
            blocks = placement.blocks if isinstance(placement, InterleavedShard) else None
            cut = []
            for box in boxes:
                start, stop = box[d]
                offsets = [0]
                for size in blocks or (stop - start,):
                    offsets.append(offsets[-1] + size)
                for b0, b1 in zip(offsets, offsets[1:]):
                    lo, hi = chunk_bounds(b1 - b0, parts, index)
                    cut.append(box[:d] + [(start + b0 + lo, start + b0 + hi)] + box[d + 1 :])
            boxes = cut
        merged: list[list[tuple[int, int]]] = []
        d = self.interleaved_dim
        for box in boxes:  # blocks that touch (a mesh extent of 1) form one box
            if merged and d is not None and merged[-1][d][1] == box[d][0]:
                merged[-1][d] = (merged[-1][d][0], box[d][1])
            else:
                merged.append(box)
        return tuple(tuple(box) for box in merged)

    def region(self, rank: int) -> Box:
        """The global box that ``rank`` holds (its ``[start, stop)`` per tensor dim)."""
        boxes = self.regions(rank)
        if len(boxes) != 1:
            raise LayoutError(f"rank {rank} holds {len(boxes)} boxes of {self}; use regions()")
        return boxes[0]

    def local_index(self, rank: int, box: Box) -> tuple[slice, ...]:
        """Slices of ``rank``'s local tensor that hold global ``box`` (inside one of its regions)."""
        d = self.interleaved_dim
        offset = 0
        for region in self.regions(rank):
            if all(r0 <= lo and hi <= r1 for (lo, hi), (r0, r1) in zip(box, region)):
                return tuple(
                    slice(lo - r0 + (offset if e == d else 0), hi - r0 + (offset if e == d else 0))
                    for e, ((lo, hi), (r0, _)) in enumerate(zip(box, region))
                )
            if d is not None:
                offset += region[d][1] - region[d][0]
        raise LayoutError(f"box {box} is not inside one region of rank {rank} in {self}")

    def term(self, rank: int) -> tuple[int, ...]:
        """Which partial term ``rank`` holds: its coordinates along the Partial mesh dims."""
        coords = self.coords(rank)
        return tuple(c for c, p in zip(coords, self.placements) if isinstance(p, Partial))

    def local_slices(self, rank: int) -> tuple[slice, ...]:
        """Slices that cut ``rank``'s local tensor out of the global tensor (single-box layouts)."""
        return tuple(slice(a, b) for a, b in self.region(rank))

    def local_of(self, full: Any, rank: int) -> Any:
        """``rank``'s local tensor cut out of the global tensor ``full`` (a new tensor)."""
        out = full.new_empty(self.local_shape(rank))
        for box in self.regions(rank):
            out[self.local_index(rank, box)] = full[tuple(slice(a, b) for a, b in box)]
        return out

    def put_local(self, full: Any, rank: int, local: Any) -> None:
        """Write ``rank``'s local tensor into its boxes of the global tensor ``full``."""
        for box in self.regions(rank):
            full[tuple(slice(a, b) for a, b in box)] = local[self.local_index(rank, box)]

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor (its regions concatenated along the interleaved dim)."""
        boxes = self.regions(rank)
        shape = [b - a for a, b in boxes[0]]
        d = self.interleaved_dim
        if d is not None:
            shape[d] = sum(box[d][1] - box[d][0] for box in boxes)
        return tuple(shape)

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        mesh = "x".join(map(str, self.mesh))
        placements = ",".join(map(str, self.placements))
        return f"[{shape} {placements} mesh {mesh} ranks {','.join(map(str, self.ranks))}]"


Hetero = Literal["split", "duplicate", "partial"]


@dataclass(frozen=True)
class LayoutUnion:
    """The layouts of one tensor across the pipelines of a heterogeneous strategy."""

    layouts: tuple[Layout, ...]
    hetero: Hetero

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", tuple(self.layouts))
        if not self.layouts:
            raise LayoutError("a LayoutUnion needs at least one layout")
        if self.hetero not in ("split", "duplicate", "partial"):
            raise LayoutError(f"hetero={self.hetero!r}; expected 'split', 'duplicate' or 'partial'")
        seen: set[int] = set()
        for layout in self.layouts:
            if not isinstance(layout, Layout):
                raise LayoutError(f"LayoutUnion takes Layouts, got {layout!r}")
            overlap = seen.intersection(layout.ranks)
            if overlap:
                raise LayoutError(f"pipelines of a LayoutUnion must use disjoint ranks; {sorted(overlap)} repeat")
            seen.update(layout.ranks)
        first = self.layouts[0].shape
        if self.hetero == "split":
            if not first:
                raise LayoutError("a 'split' LayoutUnion needs tensors with at least one dim")
            for layout in self.layouts:
                if layout.shape[1:] != first[1:]:
                    raise LayoutError(
                        f"'split' pipelines must agree on every dim but 0; got {layout.shape} and {first}"
                    )
        else:
            for layout in self.layouts:
                if layout.shape != first:
                    raise LayoutError(
                        f"'{self.hetero}' pipelines must hold the same shape; got {layout.shape} and {first}"
                    )

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.layouts[0].shape
        if self.hetero == "split":
            return (sum(lay.shape[0] for lay in self.layouts),) + first[1:]
        return first

    @property
    def sizes(self) -> tuple[int, ...]:
        """For ``"split"``: the dim-0 size of each pipeline's part."""
        return tuple(lay.shape[0] for lay in self.layouts)

    @property
    def offsets(self) -> tuple[int, ...]:
        """For ``"split"``: where each pipeline's part starts along dim 0 (zeros otherwise)."""
        if self.hetero != "split":
            return tuple(0 for _ in self.layouts)
        out, acc = [], 0
        for lay in self.layouts:
            out.append(acc)
            acc += lay.shape[0]
        return tuple(out)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for lay in self.layouts for r in lay.ranks)

    def pipeline_of(self, rank: int) -> int:
        """Index of the pipeline that holds ``rank``."""
        for i, lay in enumerate(self.layouts):
            if rank in lay._index:
                return i
        raise LayoutError(f"rank {rank} is not in union ranks {self.ranks}")

    def regions(self, rank: int) -> tuple[Box, ...]:
        """The global boxes ``rank`` holds (dim 0 shifted by its pipeline's offset for ``"split"``)."""
        i = self.pipeline_of(rank)
        boxes = self.layouts[i].regions(rank)
        if self.hetero == "split":
            off = self.offsets[i]
            boxes = tuple(((box[0][0] + off, box[0][1] + off),) + box[1:] for box in boxes)
        return boxes

    def region(self, rank: int) -> Box:
        boxes = self.regions(rank)
        if len(boxes) != 1:
            raise LayoutError(f"rank {rank} holds {len(boxes)} boxes of {self}; use regions()")
        return boxes[0]

    def local_index(self, rank: int, box: Box) -> tuple[slice, ...]:
        i = self.pipeline_of(rank)
        if self.hetero == "split":
            off = self.offsets[i]
            box = ((box[0][0] - off, box[0][1] - off),) + box[1:]
        return self.layouts[i].local_index(rank, box)

    def local_slices(self, rank: int) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.region(rank))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self.layouts[self.pipeline_of(rank)].local_shape(rank)

    def __str__(self) -> str:
        return f"Union.{self.hetero}(" + " + ".join(str(lay) for lay in self.layouts) + ")"


AnyLayout = Union[Layout, LayoutUnion]


def replicated(shape: tuple[int, ...], ranks: tuple[int, ...]) -> Layout:
    """The whole tensor on every rank."""
    return Layout(tuple(shape), tuple(ranks), (len(ranks),), (Replicate(),))


def sharded(shape: tuple[int, ...], ranks: tuple[int, ...], dim: int = 0) -> Layout:
    """Dim ``dim`` cut evenly (torch.chunk rule) over ``ranks``."""
    return Layout(tuple(shape), tuple(ranks), (len(ranks),), (Shard(dim),))
