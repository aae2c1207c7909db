"""Localize pass: turn the annotated global graph into the program every rank of a stage runs.

Each node is emitted with its rule's local form (shape arguments cut to local sizes, parallel ops
such as ``vocab_parallel_embedding`` / ``vocab_parallel_cross_entropy`` / ``packed_attention(cp=True)``,
row-parallel bias after the reduction). Wherever a producer's spec differs from what a consumer's
rule requires, the steps of ``hgraph.lnk.transform_steps`` are emitted (its docstring has the
algebra: one collective per mesh dim, tp first, with the local permutations of blocked shards and of
cp's load-balanced token chunks), once per (value, required spec), shared by every consumer that
needs it. Collectives are calls of ``hgraph.runtime.kernels.collectives`` ops, all emitted by
``_Builder._kernel``.

A replicated value consumed by an op that computes sharded gets a partial gradient from it; it is
summed inside the program (``grad_all_reduce``, or ``all_gather(grad_partial=True)`` when the value
was just gathered) so the producer receives the exact gradient. Parameters whose every use is
partial keep the Partial gradient recorded in ``hgraph_grad_spec`` for the Push Gradient pass.

Inserted nodes carry ``meta["hgraph_comm"]`` (kind, op, mesh dim, src/dst spec, tensor, bytes: the
local input bytes per rank at the example shapes; direction: ``"backward"`` for ``grad_all_reduce``,
which moves nothing forward, else ``"forward"`` — every op also communicates its adjoint backward).
A rule's label (``column-parallel``, ``vocab-parallel``...) is kept as ``meta["hgraph_note"]``. Local nodes keep the global node's metadata but
not its fake value (``meta["val"]`` described global shapes); ``meta["hgraph_local_shape"]`` holds the
local shape at the example sizes instead. A cp-split value is gathered in token order (all-gather,
then the load-balanced chunks put back) where a rule needs the whole sequence; rows merged from
cp-split tokens (``S(d/k)`` on cp) cannot be, and are refused with ``ShardingRuleError``.

Nodes of an expert body (``hgraph.passes.experts``) are emitted with the options of the expert mesh:
their collectives name the ``"ep"``/``"etp"`` groups and their local shapes are cut by ``(ep, etp)``.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.fx as fx

from hgraph.errors import LayoutError, ShardingRuleError
from hgraph.core.placement import Replicate, Shard
from hgraph.lnk.transform import TransformStep, transform_steps
from hgraph.rules.base import CP, example_size, local_shape, LowerContext, module_of, op_name, SizeArg, Spec, TP
from hgraph.rules.mesh import ShardingOptions
from hgraph.runtime.kernels.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    grad_all_reduce,
    reduce_scatter,
    split,
)

if TYPE_CHECKING:
    from hgraph.program.context import CompileContext

aten = torch.ops.aten
_DROPPED_META = ("val", "tensor_meta", "hgraph_decision", "hgraph_grad_reduce")


def localize(gm: fx.GraphModule, ctx: "CompileContext") -> fx.GraphModule:
    """Return the local program of the annotated ``gm`` (see the module docstring)."""
    options = ShardingOptions.from_context(ctx)
    for node in gm.graph.nodes:
        if node.op in ("call_function", "output") and "hgraph_decision" not in node.meta:
            raise ShardingRuleError(f"node '{node.name}' has no sharding decision; run the annotate pass first")
    builder = _Builder(options)
    for node in gm.graph.nodes:
        builder.emit(node)
    builder.graph.eliminate_dead_code()
    builder.graph.lint()
    local = fx.GraphModule(gm, builder.graph, class_name=type(gm).__name__)
    return local


_COLLECTIVES = {
    "all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather,
    "local_chunk": split, "all_to_all": all_to_all, "grad_all_reduce": grad_all_reduce,
}


def _global_shape(node: fx.Node) -> Optional[tuple[int, ...]]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(example_size(s) for s in val.shape)
    return None


class _Builder(LowerContext):
    """Emits the local graph node by node; implements the ``LowerContext`` rules' lowerings use.
    ``options`` are those of the mesh of the node being emitted (stage or expert mesh)."""

    def __init__(self, options: ShardingOptions) -> None:
        self.stage_options = options
        self.options = options
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.current: Optional[fx.Node] = None

    # ------------------------------------------------------------------ per node
    def emit(self, node: fx.Node) -> None:
        self.current = node
        self.options = self.stage_options.for_node(node)
        if node.op == "placeholder":
            new = self.graph.placeholder(node.name, type_expr=node.type)
        elif node.op == "get_attr":
            new = self.graph.get_attr(node.target)
        elif node.op == "output":
            self.graph.output(fx.node.map_arg(node.args[0], self.local))
            return
        else:
            decision = node.meta["hgraph_decision"]
            if decision.lower is not None:
                new = decision.lower(self, node)
                new._rename(node.name)  # the lowering's result stands for the global node
            else:
                args = decision.args if decision.args is not None else node.args
                kwargs = decision.kwargs if decision.kwargs is not None else node.kwargs
                target = decision.target if decision.target is not None else node.target
                new = self.graph.create_node(
                    "call_function", target, self._map(tuple(args)), self._map(dict(kwargs)), name=node.name
                )
        self._copy_meta(node, new)
        self.env[node] = new

    def _copy_meta(self, node: fx.Node, new: fx.Node) -> None:
        for key, value in node.meta.items():
            if key not in _DROPPED_META:
                new.meta[key] = value
        decision = node.meta.get("hgraph_decision")
        if decision is not None and decision.note:
            new.meta["hgraph_note"] = decision.note
        spec, shape = node.meta.get("hgraph_spec"), _global_shape(node)
        if shape is not None and spec is not None and not isinstance(spec[0], tuple):
            new.meta["hgraph_local_shape"] = local_shape(shape, spec, self.options.degrees)
            new.meta["hgraph_global_shape"] = shape

    def _map(self, value: Any) -> Any:
        """Local form of an argument structure: nodes mapped, ``SizeArg`` sizes rescaled."""
        if isinstance(value, fx.Node):
            return self.local(value)
        if isinstance(value, SizeArg):
            size = self.env[value.node]
            if value.want > value.have:
                return self.graph.call_function(operator.floordiv, (size, value.want // value.have))
            return self.graph.call_function(operator.mul, (size, value.have // value.want))
        if isinstance(value, (list, tuple)):
            return type(value)(self._map(v) for v in value)
        if isinstance(value, dict):
            return {k: self._map(v) for k, v in value.items()}
        return value

    # ------------------------------------------------------------------ LowerContext
    def local(self, node: fx.Node) -> fx.Node:
        """Local value of input ``node`` as the current consumer requires it."""
        decision = self.current.meta.get("hgraph_decision") if self.current is not None else None
        required = decision.inputs.get(node) if decision is not None else None
        if required is None:
            return self.env[node]
        fix = frozenset(self.current.meta.get("hgraph_grad_reduce", {}).get(node, ()))
        return self.convert(node, required, fix)

    def call(self, target: Any, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
        """A node of a lowering, named after the global node it implements (``addmm_1_mm``)."""
        label = getattr(target, "__name__", "op").split(".")[0]
        name = f"{self.current.name}_{label}" if self.current is not None else label
        return self.graph.create_node("call_function", target, args, kwargs or {}, name=name)

    def redistribute(self, value: fx.Node, src: Spec, dst: Spec, tensor: str, like: fx.Node) -> fx.Node:
        return self._transitions(value, src, dst, frozenset(), tensor, like)

    # ------------------------------------------------------------------ communication
    def convert(self, node: fx.Node, dst: Spec, fix: frozenset) -> fx.Node:
        src = node.meta.get("hgraph_spec")
        key = (node, dst, fix, self.options.mesh_names)
        if key not in self.cache:
            local = self._local_broadcast(node, src, dst)
            self.cache[key] = local if local is not None else self._transitions(self.env[node], src, dst, fix, node.name, node)
        return self.cache[key]

    def _local_broadcast(self, node: fx.Node, src: Spec, dst: Spec) -> Optional[fx.Node]:
        """``expand`` of a size-1 dim, asked for cut on that dim over tp (MLA's shared rope key expanded
        to every head): each rank expands to its own heads — no split, whose adjoint would gather every
        head's gradient; the input's gradient (a sum over local heads) is summed over tp instead."""
        if node.op != "call_function" or node.target is not aten.expand.default or src != (dst[CP], Replicate()):
            return None
        cut, source = dst[TP], node.args[0]
        if not (type(cut) is Shard and isinstance(source, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)):
            return None
        shape, in_shape = _global_shape(node), _global_shape(source)
        lead = len(shape) - len(in_shape)
        d = cut.dim % len(shape)
        if d < lead or in_shape[d - lead] != 1 or shape[d] % self.options.tp or source.meta.get("hgraph_spec") != src:
            return None
        sizes = [-1] * len(shape)
        sizes[d] = shape[d] // self.options.tp
        summed = self._comm(grad_all_reduce, (self.env[source], "tp"), src, src, source.name, source)
        local = self.graph.call_function(aten.expand.default, (summed, sizes))
        local.meta["hgraph_spec"] = dst
        local.meta["hgraph_note"] = "expanded to this rank's heads"
        return local

    def _transitions(self, value: fx.Node, src: Spec, dst: Spec, fix: frozenset, tensor: str, like: fx.Node) -> fx.Node:
        """Emit the steps of ``hgraph.lnk.transform_steps`` (its docstring has the algebra)."""
        try:
            steps = transform_steps(src, dst, self.options.mesh_dims, fix)
        except LayoutError as exc:
            raise ShardingRuleError(f"{self._where()}: '{tensor}' {exc}") from exc
        for step in steps:
            value = self._step(value, step, tensor, like)
        return value

    def _step(self, value: fx.Node, step: TransformStep, tensor: str, like: fx.Node) -> fx.Node:
        """One step: a collective (``_comm``) or a local reshuffle, whose result carries the spec."""
        name, kind, dims = step.mesh_dim, step.kind, step.dims
        if kind in _COLLECTIVES:
            fn = _COLLECTIVES[kind]
            args = (value, name, *dims) + ((step.grad_partial,) if fn is all_gather else ())
            return self._comm(fn, args, step.src, step.dst, tensor, like)
        degree = self.options.degrees[self.options.mesh_names.index(name)]
        if kind in ("balanced_order", "natural_order"):
            self._check_token_chunks(step, tensor, like, degree)
        if kind == "block_order":
            value = self._reorder(value, dims[0], dims[1], degree)
        elif kind == "unstride":
            value = self._unstride(value, dims[0], dims[1], degree, like)
        elif kind == "own_strided":
            value = self._own_strided(value, dims[0], dims[1], name, like)
        elif kind == "own_blocks":
            value = self._own_chunks(value, dims[0], dims[1], name)
        else:
            value = self._permute_chunks(value, dims[0], degree, to_balanced=kind == "balanced_order")
        value.meta["hgraph_spec"] = step.dst
        return value

    def _check_token_chunks(self, step: TransformStep, tensor: str, like: fx.Node, degree: int) -> None:
        """Refuse, naming the op, cp's token order on a dim that does not split into ``2·cp`` equal chunks
        (a rule asking a cp shard of a size-1 or odd-sized dim)."""
        shape, dim = _global_shape(like), step.dims[0]
        if shape is None or not isinstance(like.meta["val"].shape[dim], int):
            return  # a dynamic (sequence) dim: packing pads every micro-batch to the chunks
        size = local_shape(shape, step.src, self.options.degrees)[dim]
        if size % (2 * degree):
            raise ShardingRuleError(
                f"{self._where()}: '{tensor}' dim {dim} of size {size} cannot be cut into the {2 * degree} "
                f"load-balanced token chunks of cp={degree}; use a strategy without cp for this model"
            )

    def _reorder(self, gathered: fx.Node, dim: int, blocks: tuple[int, ...], degree: int) -> fx.Node:
        """Rank-major pieces ``[rank][block]`` of a gathered interleaved dim -> block order."""
        local = [b // degree for b in blocks]
        parts = self.graph.call_function(aten.split_with_sizes.default, (gathered, local * degree, dim))
        items = [self.graph.call_function(operator.getitem, (parts, i)) for i in range(len(local) * degree)]
        order = [items[r * len(local) + b] for b in range(len(local)) for r in range(degree)]
        return self.graph.call_function(aten.cat.default, (order, dim))

    def _unstride(self, gathered: fx.Node, dim: int, split_factor: int, degree: int, like: fx.Node) -> fx.Node:
        """Rank-major pieces ``[rank][split_factor][rest/degree]`` of a gathered strided dim ->
        ``[split_factor][rest]`` (``rest`` is static: the example's size over the split factor)."""
        rest = _global_shape(like)[dim] // split_factor
        grouped = self.graph.call_function(aten.unflatten.int, (gathered, dim, [degree, -1, rest // degree]))
        moved = self.graph.call_function(aten.transpose.int, (grouped, dim, dim + 1))
        return self.graph.call_function(aten.flatten.using_ints, (moved, dim, dim + 2))

    def _own_strided(self, whole: fx.Node, dim: int, split_factor: int, name: str, like: fx.Node) -> fx.Node:
        """This rank's cut of the ``rest`` part of every ``split_factor`` row (no communication)."""
        rest = _global_shape(like)[dim] // split_factor
        rows = self.graph.call_function(aten.unflatten.int, (whole, dim, [-1, rest]))
        mine = self._kernel(split, (rows, name, dim + 1))
        return self.graph.call_function(aten.flatten.using_ints, (mine, dim, dim + 1))

    def _own_chunks(self, whole: fx.Node, dim: int, blocks: tuple[int, ...], name: str) -> fx.Node:
        """This rank's chunk of every block of a replicated value, concatenated (no communication)."""
        parts = self.graph.call_function(aten.split_with_sizes.default, (whole, list(blocks), dim))
        mine = [
            self._kernel(split, (self.graph.call_function(operator.getitem, (parts, i)), name, dim))
            for i in range(len(blocks))
        ]
        return self.graph.call_function(aten.cat.default, (mine, dim))

    def _permute_chunks(self, value: fx.Node, dim: int, degree: int, to_balanced: bool) -> fx.Node:
        """The ``2·degree`` chunks of ``dim`` from token order to the balanced rank-major order
        ``c0, c(2n-1), c1, c(2n-2), ...`` (``to_balanced``) or back (no communication)."""
        parts = self.graph.call_function(aten.chunk.default, (value, 2 * degree, dim))
        items = [self.graph.call_function(operator.getitem, (parts, i)) for i in range(2 * degree)]
        balanced = [c for r in range(degree) for c in (r, 2 * degree - 1 - r)]  # position -> token chunk
        if to_balanced:
            order = [items[c] for c in balanced]
        else:
            order = [items[balanced.index(c)] for c in range(2 * degree)]
        return self.graph.call_function(aten.cat.default, (order, dim))

    def _kernel(self, fn: Any, args: tuple, name: Optional[str] = None) -> fx.Node:
        """The one place a call of a ``hgraph.runtime.kernels.collectives`` op is emitted."""
        return self.graph.create_node("call_function", fn, args, {}, name=name)

    def _comm(self, fn: Any, args: tuple, src: Spec, dst: Spec, tensor: str, like: fx.Node) -> fx.Node:
        """A collective with its ``hgraph_comm`` record (see the module docstring)."""
        node = self._kernel(fn, args, name=f"{fn.__name__}_{tensor}")
        shape = _global_shape(like)
        val = like.meta.get("val")
        itemsize = val.dtype.itemsize if isinstance(val, torch.Tensor) else 4
        nbytes = 0
        if shape is not None:
            nbytes = itemsize
            for size in local_shape(shape, src, self.options.degrees):
                nbytes *= size
            node.meta["hgraph_local_shape"] = local_shape(shape, dst, self.options.degrees)
            node.meta["hgraph_global_shape"] = shape
        node.meta["hgraph_spec"] = dst
        node.meta["hgraph_comm"] = {
            "kind": "communicate_activation",
            "op": fn.__name__,
            "mesh_dim": args[1],
            "src": src,
            "dst": dst,
            "tensor": tensor,
            "bytes": nbytes,
            "direction": "backward" if fn is grad_all_reduce else "forward",
        }
        return node

    def _where(self) -> str:
        node = self.current
        if node is None or node.op != "call_function":
            return "output"
        return f"{op_name(node.target)} at node '{node.name}'{module_of(node)}"


__all__ = ["localize"]
