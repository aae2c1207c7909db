"""In-stage redistribution: the steps that turn a value from one placement per mesh dim into another.

DTensor's redistribution planner (``_gen_transform_infos``) in hgraph's terms. Where ``solve`` plans
a change of layout between any ranks as point-to-point data, ``transform_steps`` plans one inside a
stage mesh for a program that every rank of the stage runs: its steps name a mesh dim, never a rank,
and ``hgraph.passes.localize`` emits each as a call of ``hgraph.runtime.kernels.collectives`` (each
with its exact adjoint) or as local reshuffles. Plans are cached by (source, destination, mesh).

Mesh dims are visited innermost first (tp before cp). On a ``contiguous`` mesh dim ``Shard(d)`` holds
``torch.chunk`` pieces in rank order, and per mesh dim::

    P    -> R      all_reduce
    P    -> S(d)   reduce_scatter(d)
    S(d) -> R      all_gather(d)
    R    -> S(d)   local_chunk(d)                 no communication
    S(a) -> S(b)   all_to_all(b, a)               cut b, concatenate a

Shards of blocks are made whole first, or cut from the whole::

    S(d:blocks) -> .   all_gather(d), block_order(d, blocks), then as from R
    . -> S(d:blocks)   (to R,) own_blocks(d, blocks)
    S(d/k) -> .        all_gather(d), unstride(d, k), then as from R
    . -> S(d/k)        (to R,) own_strided(d, k)

On a ``balanced`` mesh dim (cp) of degree ``n`` a ``Shard(d)`` holds chunks ``r`` and ``2n-1-r`` of
``2n`` (``hgraph.core.batch.load_balance_indices``: equal causal-attention work per rank). The same
collectives run on the rank-major order ``c0, c(2n-1), c1, c(2n-2), ...``, with local permutations of
the ``2n`` chunks around them::

    P    -> S(d)   balanced_order(d), reduce_scatter(d)
    S(d) -> R      all_gather(d), natural_order(d)
    R    -> S(d)   balanced_order(d), local_chunk(d)
    S(a) -> S(b)   balanced_order(b), all_to_all(b, a), natural_order(a)

(``S(d/k)`` cannot be put back in order there: its ``rest`` is a dynamic token count.) A change of
an outer mesh dim on tensor dim ``d`` that an inner mesh dim also cuts runs with ``d`` whole on the
inner one: gathered there first, cut again after. A ``fixed`` mesh dim (ep: a rank's rows are its
experts') never changes.

Gradients: ``partial_grad`` names the mesh dims on which the consumer's gradient is partial (it
computes sharded there from a value it reads replicated). Where the value is made R on such a mesh
dim its gradient is summed: the all_gather's adjoint reduce-scatters (``grad_partial``) or, when
nothing is gathered, a ``grad_all_reduce`` (identity forward, all-reduce backward) is added.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

from hgraph.errors import LayoutError
from hgraph.core.placement import InterleavedShard, Partial, Placement, Replicate, Shard, StridedShard

Placements = tuple[Placement, ...]
Order = Literal["contiguous", "balanced", "fixed"]
R = Replicate()


@dataclass(frozen=True)
class MeshDim:
    """One mesh dim of a stage."""

    name: str
    """The group name the kernels look up (``"tp"``, ``"cp"``, ``"ep"``, ``"etp"``)."""
    size: int
    """Its degree."""
    order: Order = "contiguous"
    """What a ``Shard`` on it holds: ``torch.chunk`` pieces in rank order, the load-balanced chunks
    ``r`` and ``2n-1-r`` of ``2n``, or ``fixed`` rows that cannot move (a rank's experts)."""


@dataclass(frozen=True)
class TransformStep:
    """One step of an in-stage redistribution, run by every rank of the stage."""

    mesh_dim: str
    """The group it runs on (the name of a ``MeshDim``)."""
    kind: str
    """A collective (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``), a cut of a
    replicated value (``local_chunk``, ``own_blocks``, ``own_strided``), the gradient sum
    ``grad_all_reduce``, or a local permutation (``block_order``, ``unstride``, ``balanced_order``,
    ``natural_order``)."""
    dims: tuple = ()
    """Its tensor dims: ``(dim,)``; ``(split_dim, cat_dim)`` for ``all_to_all``; ``(dim, blocks)`` for
    ``block_order``/``own_blocks``; ``(dim, split_factor)`` for ``unstride``/``own_strided``."""
    src: Placements = ()
    """The placements before the step."""
    dst: Placements = ()
    """The placements after the step."""
    grad_partial: bool = False
    """``all_gather`` only: its adjoint reduce-scatters (the gathered value's gradient is partial)."""

    def __str__(self) -> str:
        args = ", ".join(str(d) if not isinstance(d, tuple) else "+".join(map(str, d)) for d in self.dims)
        flag = ", grad partial" if self.grad_partial else ""
        return f"{self.mesh_dim}: {self.kind}({args}{flag}) {_spec(self.src)} -> {_spec(self.dst)}"


def transform_steps(
    src: Placements, dst: Placements, mesh: tuple[MeshDim, ...], partial_grad: frozenset[int] = frozenset()
) -> tuple[TransformStep, ...]:
    """The steps that turn a value placed ``src`` on ``mesh`` into ``dst`` (the module docstring's
    algebra); ``partial_grad``: indices of the mesh dims on which the consumer's gradient is partial.
    Raises ``LayoutError`` ("would need ... on <mesh dim>; why") where no steps exist."""
    return _plan(tuple(src), tuple(dst), tuple(mesh), frozenset(partial_grad))


@cache
def _plan(src: Placements, dst: Placements, mesh: tuple[MeshDim, ...], partial_grad: frozenset[int]) -> tuple[TransformStep, ...]:
    if not len(src) == len(dst) == len(mesh):
        raise LayoutError(f"{_spec(src)} -> {_spec(dst)}: give one placement per mesh dim of {[d.name for d in mesh]}")
    planner = _Planner(mesh, src, dst)
    for m in reversed(range(len(mesh))):
        planner.mesh_dim(m, dst[m], m in partial_grad)
    return tuple(planner.steps)


def _spec(placements: Placements) -> str:
    return "(" + ",".join(map(str, placements)) + ")"


_WHOLE_DIM_STEPS = frozenset({"block_order", "unstride", "own_strided", "own_blocks"})


class _Planner:
    """Appends the steps of one redistribution, tracking the current placements."""

    def __init__(self, mesh: tuple[MeshDim, ...], src: Placements, dst: Placements) -> None:
        self.mesh, self.src, self.dst = mesh, src, dst
        self.spec: Placements = src
        self.steps: list[TransformStep] = []

    def add(self, m: int, kind: str, dims: tuple, to: Placement, grad_partial: bool = False) -> None:
        if kind in _WHOLE_DIM_STEPS:  # blocks and strides are counted on the whole dim, not on a piece of it
            cutting = [self.mesh[k].name for k, p in enumerate(self.spec)
                       if k != m and isinstance(p, Shard) and p.dim == dims[0]]
            if cutting:
                raise self.refused(m, f"{kind} on dim {dims[0]} needs it whole, but {', '.join(cutting)} cuts it; "
                                      "this op needs that dim whole on one of the two mesh dims")
        after = self.spec[:m] + (to,) + self.spec[m + 1 :]
        self.steps.append(TransformStep(self.mesh[m].name, kind, dims, self.spec, after, grad_partial))
        self.spec = after

    def mesh_dim(self, m: int, t: Placement, partial_grad: bool) -> None:
        """Steps of mesh dim ``m`` to ``t`` (every other mesh dim kept)."""
        s = self.spec[m]
        contiguous = self.mesh[m].order == "contiguous"
        gathered_partial = False
        if s != t and isinstance(s, InterleavedShard):  # gather in block order, then as from R
            gathered_partial = partial_grad and isinstance(t, Replicate)
            self.add(m, "all_gather", (s.dim,), R, gathered_partial)
            self.add(m, "block_order", (s.dim, s.blocks), R)
            s = R
        if contiguous and s != t and isinstance(s, StridedShard):  # gather, then put the pieces in order
            gathered_partial = partial_grad and isinstance(t, Replicate)
            self.add(m, "all_gather", (s.dim,), R, gathered_partial)
            self.add(m, "unstride", (s.dim, s.split_factor), R)
            s = R
        if contiguous and s != t and isinstance(t, StridedShard):  # whole first, then own strided pieces
            if not isinstance(s, Replicate):
                self.mesh_dim(m, R, False)
            self.add(m, "own_strided", (t.dim, t.split_factor), t)
            s = t
        if s != t and isinstance(t, InterleavedShard):  # whole on every rank first, then own chunks
            if not isinstance(s, Replicate):
                self.mesh_dim(m, R, False)
            self.add(m, "own_blocks", (t.dim, t.blocks), t)
            s = t
        if s != t:
            gathered_partial = self.change(m, s, t, partial_grad)
        if isinstance(t, Replicate) and partial_grad and not gathered_partial:
            self.add(m, "grad_all_reduce", (), t)

    def change(self, m: int, s: Placement, t: Placement, partial_grad: bool) -> bool:
        """One collective (with the permutations of a balanced mesh dim, and the inner mesh dims made
        whole on its tensor dims); returns whether it was an all_gather with a partial gradient."""
        dim = self.mesh[m]
        if dim.order == "fixed":
            raise self.refused(m, "rows and weights split by expert can only be used where their experts are")
        if dim.order == "balanced" and (isinstance(s, StridedShard) or isinstance(t, StridedShard)):
            raise self.refused(m, "rows merged from cp-split tokens (S(d/k)) cannot be put back in token order; "
                                  "this op needs the whole sequence on one rank")
        cut = {p.dim for p in (s, t) if isinstance(p, Shard)}
        inner = [k for k in range(m + 1, len(self.mesh)) if isinstance(self.spec[k], Shard) and self.spec[k].dim in cut]
        kept = {k: self.spec[k] for k in inner}
        for k in inner:
            self.mesh_dim(k, R, False)
        balanced = dim.order == "balanced" and dim.size > 1
        gathered_partial = False
        if isinstance(s, Partial) and isinstance(t, Replicate):
            self.add(m, "all_reduce", (), t)
        elif isinstance(s, Partial) and isinstance(t, Shard):
            if balanced:
                self.add(m, "balanced_order", (t.dim,), s)
            self.add(m, "reduce_scatter", (t.dim,), t)
        elif isinstance(s, Shard) and isinstance(t, Replicate):
            gathered_partial = partial_grad
            self.add(m, "all_gather", (s.dim,), t, gathered_partial)
            if balanced:
                self.add(m, "natural_order", (s.dim,), t)
        elif isinstance(s, Replicate) and isinstance(t, Shard):
            if balanced:
                self.add(m, "balanced_order", (t.dim,), s)
            self.add(m, "local_chunk", (t.dim,), t)
        elif isinstance(s, Shard) and isinstance(t, Shard):
            if balanced:
                self.add(m, "balanced_order", (t.dim,), s)
            self.add(m, "all_to_all", (t.dim, s.dim), t)
            if balanced:
                self.add(m, "natural_order", (s.dim,), t)
        else:
            raise LayoutError(
                f"cannot be turned from {_spec(self.spec)} into {_spec(self.spec[:m] + (t,) + self.spec[m + 1:])} "
                "by any communication (a rule asked for a Partial input)"
            )
        for k in reversed(inner):
            self.mesh_dim(k, kept[k], False)
        return gathered_partial

    def refused(self, m: int, why: str) -> LayoutError:
        return LayoutError(f"would need {_spec(self.src)} -> {_spec(self.dst)} on {self.mesh[m].name}; {why}")


__all__ = ["MeshDim", "TransformStep", "transform_steps"]
