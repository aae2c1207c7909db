"""Localize pass: turn the annotated global graph into the program every rank of a stage runs.

Each node is emitted with its rule's local form (shape arguments cut to local sizes, parallel ops
such as ``vocab_parallel_embedding`` / ``vocab_parallel_cross_entropy`` / ``packed_attention(cp=True)``,
row-parallel bias after the reduction). Wherever a producer's spec differs from what a consumer's
rule requires, a call to an ``hgraph.runtime.kernels.collectives`` op is inserted, one per (value, required
spec), shared by every consumer that needs it; per mesh dim (tp first, then cp)::

    P -> R  all_reduce        P -> S(d) reduce_scatter     S(d) -> R all_gather
    R -> S(d) split           S(a) -> S(b) all_to_all

A replicated value consumed by an op that computes sharded gets a partial gradient from it; it is
summed inside the program (``grad_all_reduce``, or ``all_gather(grad_partial=True)`` when the value
was just gathered) so the producer receives the exact gradient. Parameters whose every use is
partial keep the Partial gradient recorded in ``hgraph_grad_spec`` for the Push Gradient pass.

Inserted nodes carry ``meta["hgraph_comm"]`` (kind, op, mesh dim, src/dst spec, tensor, bytes: the
local input bytes per rank at the example shapes; direction: ``"backward"`` for ``grad_all_reduce``,
which moves nothing forward, else ``"forward"`` — every op also communicates its adjoint backward).
A rule's label (``column-parallel``, ``vocab-parallel``...) is kept as ``meta["hgraph_note"]``. Local nodes keep the global node's metadata but
not its fake value (``meta["val"]`` described global shapes); ``meta["hgraph_local_shape"]`` holds the
local shape at the example sizes instead. The cp token order is load-balanced, so only P -> R is
allowed on cp: any gather or split of cp-sharded tokens raises ``ShardingRuleError``.

Nodes of an expert body (``hgraph.passes.experts``) are emitted with the options of the expert mesh:
their collectives name the ``"ep"``/``"etp"`` groups and their local shapes are cut by ``(ep, etp)``.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.fx as fx

from hgraph.errors import ShardingRuleError
from hgraph.core.layout import InterleavedShard, Partial, Replicate, Shard
from hgraph.rules.base import (
    CP,
    TP,
    LowerContext,
    ShardingOptions,
    SizeArg,
    Spec,
    StridedShard,
    example_size,
    local_shape,
    module_of,
    op_name,
    spec_str,
    with_placement,
)
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
        spec = src
        for m in (TP, CP):
            name = self.options.mesh_names[m]
            s, t = spec[m], dst[m]
            gathered_partial = False
            if s != t and isinstance(s, InterleavedShard):  # gather in block order, then as from R
                gathered_partial = m in fix and isinstance(t, Replicate)
                gathered = with_placement(spec, m, Replicate())
                value = self._comm(all_gather, (value, name, s.dim, gathered_partial), spec, gathered, tensor, like)
                value = self._reorder(value, s, self.options.degrees[m], to_blocks=True)
                spec = with_placement(spec, m, Replicate())
                s = spec[m]
                value.meta["hgraph_spec"] = spec
            if m == TP and s != t and isinstance(s, StridedShard):  # gather, then put the pieces in order
                gathered_partial = m in fix and isinstance(t, Replicate)
                gathered = with_placement(spec, m, Replicate())
                value = self._comm(all_gather, (value, name, s.dim, gathered_partial), spec, gathered, tensor, like)
                value = self._unstride(value, s, self.options.degrees[m], like)
                spec = gathered
                s = spec[m]
                value.meta["hgraph_spec"] = spec
            if m == TP and s != t and isinstance(t, StridedShard):  # whole first, then own strided pieces
                if not isinstance(s, Replicate):
                    value = self._transitions(value, spec, with_placement(spec, m, Replicate()), frozenset(), tensor, like)
                    spec = with_placement(spec, m, Replicate())
                value = self._own_strided(value, t, name, like)
                spec = with_placement(spec, m, t)
                value.meta["hgraph_spec"] = spec
                s = t
            if s != t and isinstance(t, InterleavedShard):  # whole on every rank first, then own chunks
                if not isinstance(s, Replicate):
                    value = self._transitions(value, spec, with_placement(spec, m, Replicate()), frozenset(), tensor, like)
                    spec = with_placement(spec, m, Replicate())
                value = self._own_chunks(value, t, name)
                spec = with_placement(spec, m, t)
                value.meta["hgraph_spec"] = spec
                s = t
            if s != t:
                if m == CP and self.options.expert_parallel:
                    raise ShardingRuleError(
                        f"{self._where()}: '{tensor}' would need {spec_str(src)} -> {spec_str(dst)} on ep; "
                        "rows and weights split by expert can only be used where their experts are"
                    )
                if m == CP and not (isinstance(s, Partial) and isinstance(t, Replicate)):
                    raise ShardingRuleError(
                        f"{self._where()}: '{tensor}' would need {spec_str(src)} -> {spec_str(dst)} on cp; "
                        "cp-split tokens are in load-balanced order and can only be summed (P -> R), not "
                        "gathered, split or moved; this op needs the whole sequence on one rank"
                    )
                target = with_placement(spec, m, t)
                if isinstance(s, Partial) and isinstance(t, Replicate):
                    value = self._comm(all_reduce, (value, name), spec, target, tensor, like)
                elif isinstance(s, Partial) and isinstance(t, Shard):
                    value = self._comm(reduce_scatter, (value, name, t.dim), spec, target, tensor, like)
                elif isinstance(s, Shard) and isinstance(t, Replicate):
                    gathered_partial = m in fix
                    value = self._comm(all_gather, (value, name, s.dim, gathered_partial), spec, target, tensor, like)
                elif isinstance(s, Replicate) and isinstance(t, Shard):
                    value = self._comm(split, (value, name, t.dim), spec, target, tensor, like)
                elif isinstance(s, Shard) and isinstance(t, Shard):
                    value = self._comm(all_to_all, (value, name, t.dim, s.dim), spec, target, tensor, like)
                else:
                    raise ShardingRuleError(
                        f"{self._where()}: no communication turns '{tensor}' from {spec_str(spec)} into "
                        f"{spec_str(target)} (a rule asked for a Partial input)"
                    )
                spec = target
            if isinstance(t, Replicate) and m in fix and not gathered_partial:
                value = self._comm(grad_all_reduce, (value, name), spec, spec, tensor, like)
        return value

    def _reorder(self, gathered: fx.Node, p: InterleavedShard, degree: int, to_blocks: bool) -> fx.Node:
        """Rank-major pieces ``[rank][block]`` of a gathered interleaved dim -> block order."""
        local = [b // degree for b in p.blocks]
        parts = self.graph.call_function(torch.ops.aten.split_with_sizes.default, (gathered, local * degree, p.dim))
        items = [self.graph.call_function(operator.getitem, (parts, i)) for i in range(len(local) * degree)]
        order = [items[r * len(local) + b] for b in range(len(local)) for r in range(degree)]
        return self.graph.call_function(torch.ops.aten.cat.default, (order, p.dim))

    def _unstride(self, gathered: fx.Node, p: StridedShard, degree: int, like: fx.Node) -> fx.Node:
        """Rank-major pieces ``[rank][split_factor][rest/degree]`` of a gathered strided dim ->
        ``[split_factor][rest]`` (``rest`` is static: the example's size over the split factor)."""
        rest = _global_shape(like)[p.dim] // p.split_factor
        grouped = self.graph.call_function(torch.ops.aten.unflatten.int, (gathered, p.dim, [degree, -1, rest // degree]))
        moved = self.graph.call_function(torch.ops.aten.transpose.int, (grouped, p.dim, p.dim + 1))
        return self.graph.call_function(torch.ops.aten.flatten.using_ints, (moved, p.dim, p.dim + 2))

    def _own_strided(self, whole: fx.Node, p: StridedShard, name: str, like: fx.Node) -> fx.Node:
        """This rank's cut of the ``rest`` part of every ``split_factor`` row (no communication)."""
        rest = _global_shape(like)[p.dim] // p.split_factor
        rows = self.graph.call_function(torch.ops.aten.unflatten.int, (whole, p.dim, [-1, rest]))
        mine = self.graph.call_function(split, (rows, name, p.dim + 1))
        return self.graph.call_function(torch.ops.aten.flatten.using_ints, (mine, p.dim, p.dim + 1))

    def _own_chunks(self, whole: fx.Node, p: InterleavedShard, name: str) -> fx.Node:
        """This rank's chunk of every block of a replicated value, concatenated (no communication)."""
        blocks = self.graph.call_function(torch.ops.aten.split_with_sizes.default, (whole, list(p.blocks), p.dim))
        mine = [
            self.graph.call_function(split, (self.graph.call_function(operator.getitem, (blocks, i)), name, p.dim))
            for i in range(len(p.blocks))
        ]
        return self.graph.call_function(torch.ops.aten.cat.default, (mine, p.dim))

    def _comm(self, fn: Any, args: tuple, src: Spec, dst: Spec, tensor: str, like: fx.Node) -> fx.Node:
        node = self.graph.create_node("call_function", fn, args, {}, name=f"{fn.__name__}_{tensor}")
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
