"""Placements: what one mesh dim of a ``Layout`` holds of a tensor (DTensor's placement types).

* ``Shard(d)``   the tensor dim ``d`` is cut into ``mesh[m]`` chunks along that mesh dim;
* ``Replicate()`` every coordinate along the mesh dim holds the same data;
* ``Partial()``  the true value is the *sum* over the coordinates of that mesh dim;
* ``InterleavedShard(d, blocks)`` dim ``d`` is consecutive blocks (a fused projection's q, k, v or
  gate, up) and *each block* is cut along the mesh dim: a rank holds its chunk of every block,
  concatenated in block order (Megatron's fused-QKV sharding; DTensor's ``_StridedShard`` for equal
  blocks).
* ``StridedShard(d, k)`` dim ``d`` is ``[k, rest]`` flattened and only ``rest`` is cut (a flatten of a
  cut inner dim, DTensor's ``_StridedShard``); a compiled program's placement, not a ``Layout``'s.

Each prints in a short form (``S(0)``, ``S(0:8+4+4)``, ``R``, ``P``) that ``parse_placement`` reads back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from hgraph.errors import LayoutError


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


@dataclass(frozen=True)
class InterleavedShard(Shard):
    """Cut each of the consecutive ``blocks`` of tensor dim ``dim`` across a mesh dim (``S(0:8+4+4)``:
    rows 0-7, 8-11 and 12-15 each cut, a rank holding its chunk of all three)."""

    blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
        if len(self.blocks) < 2 or any(b < 1 for b in self.blocks):
            raise LayoutError(f"InterleavedShard needs two or more positive block sizes, got {self.blocks}")

    def __str__(self) -> str:
        return f"S({self.dim}:{'+'.join(map(str, self.blocks))})"

    __repr__ = __str__


@dataclass(frozen=True)
class StridedShard(Shard):
    """A shard of a merged dim: the dim is ``[split_factor, rest]`` flattened and only ``rest`` is cut.

    This is what ``flatten`` of ``[b, s]`` with ``s`` token-sharded on cp gives (or of ``[b, s, h]``
    with heads cut on tp: Gated DeltaNet's per-head norm over ``[b·s·h, d]`` rows); unflattening it
    back recovers ``Shard`` of the cut dim. ``hgraph.lnk.transform`` gathers it in order on a mesh dim
    of contiguous chunks (all-gather, then the rank-major pieces moved back between the
    ``split_factor`` rows).
    """

    split_factor: int = 1

    def __str__(self) -> str:
        return f"S({self.dim}/{self.split_factor})"

    __repr__ = __str__


Placement = Union[Shard, Replicate, Partial]


def parse_placement(text: str) -> Placement:
    """Parse the short form used in ``str``: ``S(0)``, ``S(0:8+4+4)``, ``R`` or ``P``."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("S(") and text.endswith(")"):
        inner = text[2:-1]
        try:
            if ":" in inner:
                dim, blocks = inner.split(":")
                return InterleavedShard(int(dim), tuple(int(b) for b in blocks.split("+")))
            return Shard(int(inner))
        except ValueError:
            pass
    raise LayoutError(f"cannot parse placement {text!r}; expected 'S(<dim>)', 'S(<dim>:<block>+<block>...)', 'R' or 'P'")
