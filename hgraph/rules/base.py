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
and summed losses need, but it cannot be gathered back in order.

Under expert parallelism the nodes of an expert body (marked ``meta[MESH_KEY] == EXPERT_MESH`` by
``hgraph.passes.experts``) see the stage's ranks as the expert mesh ``(ep, etp)``
(``ShardingOptions.experts``): the same two mesh-dim slots, named ``"ep"`` and ``"etp"``. There a
``Shard(0)`` on ep means "the rows or weights of this rank's experts".
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx

from hgraph.errors import ShardingRuleError
from hgraph.core.layout import InterleavedShard, Partial, Placement, Replicate, Shard

MESH_DIMS = ("cp", "tp")
CP, TP = 0, 1
MESH_KEY = "hgraph_mesh"  # node.meta key: which mesh a node's specs are on (absent: the stage mesh)
EXPERT_MESH = "expert"
R = Replicate()
P = Partial()


@dataclass(frozen=True)
class StridedShard(Shard):
    """A shard of a merged dim: the dim is ``[split_factor, rest]`` flattened and only ``rest`` is cut.

    This is what ``flatten`` of ``[b, s]`` with ``s`` token-sharded on cp gives (or of ``[b, s, h]``
    with heads cut on tp: Gated DeltaNet's per-head norm over ``[b·s·h, d]`` rows); unflattening it
    back recovers ``Shard`` of the cut dim. ``localize`` gathers it on tp in order (all-gather, then
    the rank-major pieces moved back between the ``split_factor`` rows); on cp it is never gathered.
    """

    split_factor: int = 1

    def __str__(self) -> str:
        return f"S({self.dim}/{self.split_factor})"

    __repr__ = __str__


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
class ShardingOptions:
    """The stage mesh and the knobs of the annotate/localize passes.

    ``params``: names of the parameter placeholders (their spec is chosen by their consumers);
    ``None`` means placeholders named ``p_*`` (the frontend's and torch.export's convention).
    ``buffers``: names of buffer placeholders (replicated; ``None``: those named ``b_*``). Every other
    placeholder is a data input, token-split on cp along ``seq_dim``.
    ``position_ids``: the placeholder that packed attention reads sequence starts from.
    ``seq_dim``: the token dim of ``[batch, seq, ...]`` inputs and activations (cp splits it; sequence
    parallelism reduce-scatters 3-d activations along it).
    ``ep``: expert-parallel degree (``experts()`` gives the options of the expert mesh);
    ``mesh_names``: the group names of the two mesh dims (``("ep", "etp")`` on the expert mesh).
    """

    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    vocab_parallel: bool = True
    params: Optional[frozenset[str]] = None
    buffers: Optional[frozenset[str]] = None
    position_ids: str = "position_ids"
    seq_dim: int = 1
    ep: int = 1
    mesh_names: tuple[str, str] = MESH_DIMS

    def __post_init__(self) -> None:
        for name in ("cp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ShardingRuleError(f"mesh degree {name}={value!r} is invalid; use an integer >= 1")
        if not self.expert_parallel and (self.cp * self.tp) % self.ep:
            raise ShardingRuleError(f"ep={self.ep} does not divide the stage mesh cp{self.cp} x tp{self.tp}")

    @property
    def degrees(self) -> tuple[int, int]:
        return (self.cp, self.tp)

    @property
    def expert_parallel(self) -> bool:
        """Whether these are the options of an expert mesh ``(ep, etp)``."""
        return self.mesh_names == ("ep", "etp")

    def experts(self) -> "ShardingOptions":
        """The options of this stage's expert mesh: ``(ep, etp = cp·tp / ep)`` in the mesh-dim slots."""
        if self.expert_parallel:
            return self
        return replace(self, cp=self.ep, tp=self.cp * self.tp // self.ep, sequence_parallel=False,
                       mesh_names=("ep", "etp"))

    def for_node(self, node: fx.Node) -> "ShardingOptions":
        """The options of the mesh ``node``'s specs are on."""
        return self.experts() if node.meta.get(MESH_KEY) == EXPERT_MESH else self

    def __str__(self) -> str:
        flags = [name for name, on in (("sequence-parallel", self.sequence_parallel), ("vocab-parallel", self.vocab_parallel)) if on]
        mesh = f"{self.mesh_names[0]}{self.cp} x {self.mesh_names[1]}{self.tp}"
        kind = "expert mesh" if self.expert_parallel else "stage mesh"
        ep = f", ep{self.ep}" if self.ep > 1 and not self.expert_parallel else ""
        return f"{kind} {mesh}{ep}" + (f" ({', '.join(flags)})" if flags else "")

    @classmethod
    def from_context(cls, ctx: Any) -> "ShardingOptions":
        """Read the options from ``ctx``: a ``ShardingOptions``, a ``CompileContext`` or any object
        with ``cp``/``tp`` (and optionally ``sequence_parallel``, ``vocab_parallel``, ``traced``)."""
        if isinstance(ctx, cls):
            return ctx
        params = getattr(ctx, "params", None)
        buffers = getattr(ctx, "buffers", None)
        traced = getattr(ctx, "traced", None)
        if params is None and traced is not None:
            params = frozenset(getattr(traced, "param_names", {}) or ()) or None
        if buffers is None and traced is not None:
            buffers = frozenset(getattr(traced, "buffer_names", {}) or ())
        return cls(
            cp=getattr(ctx, "cp", 1),
            tp=getattr(ctx, "tp", 1),
            ep=getattr(ctx, "ep", 1),
            sequence_parallel=bool(getattr(ctx, "sequence_parallel", False)),
            vocab_parallel=bool(getattr(ctx, "vocab_parallel", True)),
            params=frozenset(params) if params is not None else None,
            buffers=frozenset(buffers) if buffers is not None else None,
        )

    def is_param(self, node: fx.Node) -> bool:
        if node.op != "placeholder":
            return False
        if self.params is not None:
            return node.name in self.params
        return node.name.startswith("p_")

    def is_buffer(self, node: fx.Node) -> bool:
        if node.op != "placeholder":
            return False
        if self.buffers is not None:
            return node.name in self.buffers
        return node.name.startswith("b_")


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
    """A size as an int: dynamic (symbolic) sizes at the example value they were traced with."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is not None:
            return int(hint)
        return int(size.node.shape_env.size_hint(size.node.expr))
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

    def is_floating(self, node: fx.Node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and val.dtype.is_floating_point

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
    if stack and stack[0][1].endswith("_LossModule"):  # the frontend's wrapper: its 'model' is the user's
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
