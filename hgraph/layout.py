"""Placements, layouts and layout unions: where each piece of a tensor lives.

A ``Layout`` places one global tensor on an ordered tuple of ranks arranged as a mesh (row-major:
``ranks[i]`` sits at mesh coordinate ``unravel(i, mesh)``). Each mesh dim carries one placement:

* ``Shard(d)``   the tensor dim ``d`` is cut into ``mesh[m]`` chunks along that mesh dim;
* ``Replicate()`` every coordinate along the mesh dim holds the same data;
* ``Partial()``  the true value is the *sum* over the coordinates of that mesh dim.

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
from dataclasses import dataclass, field
from typing import Literal, Union

from hgraph.errors import LayoutError

Box = tuple[tuple[int, int], ...]
"""A hyper-rectangle of a global tensor: one ``(start, stop)`` per tensor dim."""


@dataclass(frozen=True)
class Shard:
    """Cut tensor dim ``dim`` across a mesh dim."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__


@dataclass(frozen=True)
class Replicate:
    """Every coordinate of the mesh dim holds the same data."""

    def __str__(self) -> str:
        return "R"

    __repr__ = __str__


@dataclass(frozen=True)
class Partial:
    """The true value is the reduction (only ``"sum"``) over the coordinates of the mesh dim."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op != "sum":
            raise LayoutError(f"Partial({self.reduce_op!r}) is not supported; only Partial('sum') is")

    def __str__(self) -> str:
        return "P"

    __repr__ = __str__


Placement = Union[Shard, Replicate, Partial]


def parse_placement(text: str) -> Placement:
    """Parse the short form used in ``str``: ``S(0)``, ``R`` or ``P``."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    raise LayoutError(f"cannot parse placement {text!r}; expected 'S(<dim>)', 'R' or 'P'")


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
                p = Shard(p.dim % ndim)
            normalized.append(p)
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

    def region(self, rank: int) -> Box:
        """The global box that ``rank`` holds (its ``[start, stop)`` per tensor dim)."""
        coords = self.coords(rank)
        box = [(0, s) for s in self.shape]
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                start, stop = box[placement.dim]
                lo, hi = chunk_bounds(stop - start, self.mesh[mesh_dim], coords[mesh_dim])
                box[placement.dim] = (start + lo, start + hi)
        return tuple(box)

    def term(self, rank: int) -> tuple[int, ...]:
        """Which partial term ``rank`` holds: its coordinates along the Partial mesh dims."""
        coords = self.coords(rank)
        return tuple(c for c, p in zip(coords, self.placements) if isinstance(p, Partial))

    def local_slices(self, rank: int) -> tuple[slice, ...]:
        """Slices that cut ``rank``'s local tensor out of the global tensor."""
        return tuple(slice(a, b) for a, b in self.region(rank))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor."""
        return tuple(b - a for a, b in self.region(rank))

    def with_shape(self, shape: tuple[int, ...]) -> "Layout":
        """The same placement on a tensor of another shape."""
        return Layout(tuple(shape), self.ranks, self.mesh, self.placements)

    def with_ranks(self, ranks: tuple[int, ...]) -> "Layout":
        """The same placement on other ranks (same mesh)."""
        return Layout(self.shape, tuple(ranks), self.mesh, self.placements)

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

    def region(self, rank: int) -> Box:
        """The global box ``rank`` holds (dim 0 shifted by its pipeline's offset for ``"split"``)."""
        i = self.pipeline_of(rank)
        box = self.layouts[i].region(rank)
        if self.hetero == "split":
            off = self.offsets[i]
            box = ((box[0][0] + off, box[0][1] + off),) + box[1:]
        return box

    def local_slices(self, rank: int) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.region(rank))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region(rank))

    def __str__(self) -> str:
        return f"Union.{self.hetero}(" + " + ".join(str(lay) for lay in self.layouts) + ")"


AnyLayout = Union[Layout, LayoutUnion]


def replicated(shape: tuple[int, ...], ranks: tuple[int, ...]) -> Layout:
    """The whole tensor on every rank."""
    return Layout(tuple(shape), tuple(ranks), (len(ranks),), (Replicate(),))


def sharded(shape: tuple[int, ...], ranks: tuple[int, ...], dim: int = 0) -> Layout:
    """Dim ``dim`` cut evenly (torch.chunk rule) over ``ranks``."""
    return Layout(tuple(shape), tuple(ranks), (len(ranks),), (Shard(dim),))
