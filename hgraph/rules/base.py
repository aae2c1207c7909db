"""Shared vocabulary of the sharding rules: specs on a stage mesh, rule inputs and rule decisions.

A pipeline stage runs on a ``cp x tp`` mesh of ranks. Every tensor value of the global graph gets a
*spec*: one placement per mesh dim, ``(cp_placement, tp_placement)``, with the placements of
``hgraph.core.layout`` (``Shard(d)``, ``Replicate()``, ``Partial()``). A rule looks at one node and the
specs of its inputs and returns a ``Decision``: the spec of its output, the spec each tensor input
must have (``localize`` inserts communication where a producer's spec differs), and how to emit the
node into the local program (rewritten shape arguments, a parallel op, or a custom lowering).

On the ``cp`` mesh dim a ``Shard`` of the token dims means "this rank's subset of the tokens" (the
load-balanced 2·cp chunk order, or the interleaving a flatten of sharded tokens gives), not a
contiguous slice: it is consistent across tensors derived the same way, which is all token-wise ops
and summed losses need; ``hgraph.lnk.transform`` gathers and cuts the load-balanced chunks in token
order where a rule asks for another spec (not the flattened interleaving).

Under expert parallelism the nodes of an expert body (marked ``meta[MESH_KEY] == EXPERT_MESH`` by
``hgraph.passes.experts``) see the stage's ranks as the expert mesh ``(ep, etp)``
(``ShardingOptions.experts``): the same two mesh-dim slots, named ``"ep"`` and ``"etp"``. There a
``Shard(0)`` on ep means "the rows or weights of this rank's experts".
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from hgraph.errors import ShardingRuleError
from hgraph.core.placement import InterleavedShard, Partial, Placement, Replicate, Shard, StridedShard
from hgraph.rules.mesh import ShardingOptions

CP, TP = 0, 1
R = Replicate()
P = Partial()


Spec = tuple[Placement, Placement]
"""Placements of one tensor on the stage mesh: ``(cp placement, tp placement)``."""

REPLICATED: Spec = (R, R)


def spec_str(spec: Optional[Union[Spec, tuple]]) -> str:
    """``(S(1),R)``; tuples of specs (multi-output nodes) print as a list."""
    if spec is None:
        return "-"
    if spec and isinstance(spec[0], tuple):
        return "[" + ", ".join(spec_str(s) for s in spec) + "]"
    return "(" + ",".join(map(str, spec)) + ")"


def with_placement(spec: Spec, mesh_dim: int, placement: Placement) -> Spec:
    """``spec`` with the placement of ``mesh_dim`` replaced."""
    out = list(spec)
    out[mesh_dim] = placement
    return (out[0], out[1])


@dataclass(frozen=True)
class SizeArg:
    """A symbolic size argument whose local value must be rescaled: ``node`` holds a size cut
    ``have`` ways in the local program, the consumer needs it cut ``want`` ways."""

    node: fx.Node
    have: int
    want: int


def _blocked(mesh_dim: int, placement: Placement) -> bool:
    """A shard only ``interleave_aware`` rules see: a fused projection's blocks, or tp rows merged
    from a cut inner dim (``StridedShard`` on tp)."""
    return isinstance(placement, InterleavedShard) or (mesh_dim == TP and isinstance(placement, StridedShard))


def interleave_aware(rule: Callable) -> Callable:
    """Mark a rule that handles ``InterleavedShard`` inputs (a fused projection's blocks) and tp
    ``StridedShard`` ones (it keeps a shard with ``dataclasses.replace``, never rebuilds it); any other
    rule sees such an input as replicated, so ``localize`` gathers it in order first."""
    rule.interleave_aware = True  # type: ignore[attr-defined]
    return rule


Lowering = Callable[["LowerContext", fx.Node], fx.Node]
"""Custom emission of one node: ``(lower context, global node) -> local node``."""


@dataclass
class Decision:
    """What a rule decided for one node.

    ``output``: spec of the result (a tuple of specs for list-returning ops, ``None`` for non-tensors);
    ``inputs``: the spec each tensor input must be in; ``args``/``kwargs``/``target``: replacements for
    the emitted local node (global ``fx.Node`` references are mapped by ``localize``); ``lower``: a
    custom emitter used instead; ``note``: a short label shown when explaining (``column-parallel``);
    ``exact_grad``: ``{input: mesh dims}`` on which a replicated input's gradient is complete on every
    rank although the op computes sharded there (a row-parallel bias added after the tp reduction);
    any other replicated input of an op sharded on a mesh dim gets a partial gradient on it.
    """

    output: Any
    inputs: dict[fx.Node, Spec] = field(default_factory=dict)
    args: Optional[tuple] = None
    kwargs: Optional[dict] = None
    target: Any = None
    lower: Optional[Lowering] = None
    note: str = ""
    exact_grad: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)


class LowerContext:
    """What a custom lowering may use (implemented by ``hgraph.passes.localize``)."""

    graph: fx.Graph
    options: ShardingOptions

    def local(self, node: fx.Node) -> fx.Node:
        """The local value of a global input node, already converted to the spec the rule required."""
        raise NotImplementedError

    def call(self, target: Any, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
        raise NotImplementedError

    def redistribute(self, value: fx.Node, src: Spec, dst: Spec, tensor: str, like: fx.Node) -> fx.Node:
        """Insert the communication that turns ``value`` from ``src`` into ``dst``."""
        raise NotImplementedError


def example_size(size: Any) -> int:
    """A size as an int: dynamic (symbolic) sizes at the example value they were traced with; a
    data-dependent size (``nonzero``'s count, no example value) at torch's optimisation hint."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is not None:
            return int(hint)
        return int(optimization_hint(size))  # data-dependent (nonzero's count): torch's own estimate
    return int(size)


class RuleInput:
    """A rule's view of the graph: input specs, (example) shapes, mesh degrees and options."""

    def __init__(self, options: ShardingOptions, specs: dict[fx.Node, Any], free: set[fx.Node]) -> None:
        self.options = options
        self._specs = specs
        self._free = free
        self.node: Optional[fx.Node] = None
        self.interleave_aware = False  # see ``interleave_aware``

    # ------------------------------------------------------------------ specs
    def degree(self, mesh_dim: int) -> int:
        return self.options.degrees[mesh_dim]

    def is_free(self, node: fx.Node) -> bool:
        """A parameter whose placement no consumer has chosen yet."""
        return node in self._free

    def spec(self, node: fx.Node) -> Spec:
        """The producer's spec (free parameters read as replicated)."""
        if node in self._free:
            return REPLICATED
        spec = self._specs.get(node)
        if spec is None or (spec and isinstance(spec[0], tuple)):
            raise self.error(f"input {node.name} has no single tensor spec ({spec_str(spec)})")
        if not self.interleave_aware and any(_blocked(m, p) for m, p in enumerate(spec)):
            # a rule that does not know interleaved (or tp-strided) shards sees the value whole; localize
            # gathers it in order
            return tuple(R if _blocked(m, p) else p for m, p in enumerate(spec))  # type: ignore[return-value]
        return spec

    def specs_of(self, node: fx.Node) -> Any:
        """The raw spec of ``node``: a tuple of specs for list outputs, ``None`` for non-tensors."""
        return self._specs.get(node)

    def placement(self, node: fx.Node, mesh_dim: int) -> Placement:
        return self.spec(node)[mesh_dim]

    # ------------------------------------------------------------------ shapes
    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)

    def shape(self, node: fx.Node) -> tuple[int, ...]:
        """Global shape with dynamic sizes at their example values."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise self.error(f"{node.name} has no tensor value in meta['val']")
        return tuple(example_size(s) for s in val.shape)

    def ndim(self, node: fx.Node) -> int:
        return len(self.shape(node))

    def tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        """Tensor-valued input nodes in argument order, each once."""
        seen: dict[fx.Node, None] = {}
        for n in node.all_input_nodes:
            if self.is_tensor(n):
                seen.setdefault(n, None)
        return list(seen)

    def size_cut(self, value: Any) -> Optional[int]:
        """How many ways the local value of a symbolic size is cut (``None``: cannot tell).

        ``sym_size(t, d)`` in the local program reads ``t``'s local dim ``d``; products multiply.
        """
        if isinstance(value, int):
            return 1
        if not isinstance(value, fx.Node) or value.op != "call_function":
            return None
        if value.target in (torch.ops.aten.sym_size.int,):
            tensor, dim = value.args
            spec = self._specs.get(tensor) if tensor not in self._free else REPLICATED
            if spec is None or isinstance(spec[0], tuple):
                return None
            return shard_degrees(spec, self.options.degrees, self.ndim(tensor))[dim]
        if value.target is operator.mul:
            cuts = [self.size_cut(a) for a in value.args]
            return None if None in cuts else math.prod(cuts)  # type: ignore[arg-type]
        if value.target is operator.floordiv and isinstance(value.args[1], int):
            return self.size_cut(value.args[0])
        return None

    def local_size_arg(self, value: Any, want: int) -> Any:
        """A size argument rewritten for a dim cut ``want`` ways: constants divided, symbolic sizes
        kept when their local value already has that cut, else wrapped in a ``SizeArg``."""
        if isinstance(value, int):
            if want > 1 and value != -1:
                return local_size(value, want, "size argument", self)
            return value
        have = self.size_cut(value)
        if have is None:
            raise self.error(f"cannot tell the local value of size argument {value} (a {type(value).__name__})")
        if have == want:
            return value
        if max(have, want) % min(have, want):
            raise self.error(f"size {value} is cut {have} ways locally but {want} ways are needed")
        return SizeArg(value, have, want)

    # ------------------------------------------------------------------ helpers
    def partial_target(self, mesh_dim: int, ndim: int, shape: Sequence[int] = ()) -> Placement:
        """Where a Partial value is reduced to: a sequence-parallel ``Shard(seq)`` for 3-d tp
        activations when sequence parallelism is on, else ``Replicate``."""
        seq = self.options.seq_dim
        if (
            mesh_dim == TP
            and self.options.sequence_parallel
            and ndim == 3
            and (not shape or shape[seq] % self.degree(TP) == 0)
        ):
            return Shard(seq)
        return R

    def error(self, message: str) -> ShardingRuleError:
        node = self.node
        where = f"{op_name(node.target)} at node '{node.name}'" if node is not None else "rule"
        return ShardingRuleError(f"{where}{module_of(node)}: {message}")


def module_of(node: Optional[fx.Node]) -> str:
    """`` in LlamaForCausalLM module 'model.layers.0.mlp' (LlamaMLP)`` from the node's module stack."""
    stack = list((node.meta.get("nn_module_stack") or {}).values()) if node is not None else []
    if stack and stack[0][1].endswith("loss_module.LossModule"):  # the frontend's wrapper: its 'model' is the user's
        stack = [(path.removeprefix("model").lstrip("."), kind) for path, kind in stack[1:]]
    if not stack:
        return ""
    model = stack[0][1].rsplit(".", 1)[-1]
    path, kind = stack[-1]
    inside = f" module '{path}' ({kind.rsplit('.', 1)[-1]})" if path else ""
    return f" in {model}{inside}"


def op_name(target: Any) -> str:
    """Readable name of a call target (``aten.linear.default``, ``hgraph.runtime.kernels.collectives.all_gather``)."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', repr(target))}".lstrip(".")


def wrap_dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative index, the way PyTorch wraps a dim argument: a 0-d tensor accepts
    ``0`` and ``-1`` as if it were 1-d (``maybe_wrap_dim`` with ``wrap_scalar``)."""
    return dim % max(ndim, 1)


def _has_dim_argument(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return any(a.name in ("dim", "dims", "dim0", "dim1") for a in target._schema.arguments)


def scalar_decision(node: fx.Node, rin: RuleInput) -> Optional[Decision]:
    """The decision for an op with a dim argument applied to a 0-d tensor (``sum(x, 0)``,
    ``sort(x, -1)``, ``index_add(x, 0, i, s)`` of a scalar, which PyTorch allows): nothing can be
    cut, so every input is made Replicate (a Partial one is reduced, since the op need not be
    linear) and the op runs whole on every rank. ``None`` for any other node (its rule decides)."""
    if not _has_dim_argument(node.target):
        return None
    tensors = rin.tensor_inputs(node)
    if not node.args or node.args[0] not in tensors or rin.ndim(node.args[0]):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        output: Any = REPLICATED
    elif isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
        output = tuple(REPLICATED for _ in val)
    else:
        return None
    return Decision(output=output, inputs=dict.fromkeys(tensors, REPLICATED), note="0-d")


def local_size(size: int, degree: int, what: str, rin: RuleInput) -> int:
    """``size // degree``, raising when it does not divide."""
    if size % degree:
        raise rin.error(f"{what} of size {size} cannot be split {degree} ways; use a degree dividing {size}")
    return size // degree


def shard_degrees(spec: Spec, degrees: Sequence[int], ndim: int) -> list[int]:
    """How many ways each tensor dim is cut by ``spec``."""
    out = [1] * ndim
    for m, p in enumerate(spec):
        if isinstance(p, Shard):
            out[p.dim % ndim] *= degrees[m]
    return out


def local_shape(shape: Sequence[int], spec: Spec, degrees: Sequence[int]) -> tuple[int, ...]:
    """Local shape on every rank of a ``spec`` (even split assumed: ceil as ``torch.chunk``)."""
    cuts = shard_degrees(spec, degrees, len(shape))
    return tuple(math.ceil(s / k) for s, k in zip(shape, cuts))
