"""Frontend: capture ``loss_fn(model(input_ids, position_ids), targets)`` as one torch.fx graph.

Choice of capture: ``torch.export.export`` in its default *training IR* (ATen ops before
functionalisation and decomposition). Parameters and buffers are lifted to explicit placeholder
inputs, so the traced function is::

    graph(*params, *buffers, input_ids, position_ids, targets) -> summed loss (a 0-d tensor)

Only the forward (with the loss) is captured; the backward comes from ordinary torch autograd when
a (sharded, rewritten) copy of the graph runs. Why: training-IR ops are few and high level (``linear``,
``embedding``, ``scaled_dot_product_attention``, ``cross_entropy_loss``), so sharding rules stay small,
and every communication op in a compiled program is a ``torch.autograd.Function`` whose backward is its
exact adjoint — gradients of sharded programs are then correct by construction and no backward-op rules
are needed. Parameter gradients are still explicit values: they are the ``.grad`` of the placeholders.

The loss is a *sum* over tokens (``reduction="sum"``, ``ignore_index=-100``); hgraph divides by the
global token count of the iteration, so any batching, dispatch or packing gives the same gradients. A
user ``loss_fn(outputs, targets)`` must likewise return a summed loss. ``targets`` are the already
shifted next tokens (prepared outside the graph).

Batch and sequence dims are dynamic (``torch.export.Dim``), so one graph serves every micro-batch
length; the sequence is bounded where the model bounds it (``hgraph.frontend.seq_bounds``). A model that specialises on its input shape is traced again per shape instead (static
fallback, cached per shape in ``TracedModel.graph_for``; rank threads share it, ``CAPTURE_LOCK``).

After capture the graph is canonicalised (``canonicalize``): no-op conversions, eval-mode dropout
and metadata assertions are removed, tied parameters share one placeholder, and attention is expressed
as ``hgraph.runtime.kernels.packed_attention.packed_attention``. Anything export cannot capture raises ``TraceError``.

A model built on the meta device traces too: its construction-time buffers are recomputed by its own
scheme and its parameters are traced as fake CPU tensors (``hgraph.frontend.capture.meta``), so built eagerly
or on meta it gives the same graph.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import threading
import traceback
from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import fx, nn

from hgraph.errors import InputError, TraceError
from hgraph.core.layer_names import layer_index
from hgraph.frontend.canonicalize import canonicalize
from hgraph.frontend.lift import lift_exported
from hgraph.frontend.loss_module import LossModule, default_loss
from hgraph.frontend.linear_attention import hf_kernels, refuse_unsupported_mixers
from hgraph.frontend.meta import fake_parameters, materialize_buffers
from hgraph.frontend.seq_bounds import SizeGuards, refined_spec, sequence_spec, watching

INPUT_NAMES = ("input_ids", "position_ids", "targets")
_TORCH_DIR = os.path.dirname(torch.__file__)
# torch.export and make_fx keep process-wide tracing state: one capture at a time per process, also when
# simulated-rank threads ask ``graph_for`` for a new shape while another thread compiles.
CAPTURE_LOCK = threading.RLock()
log = logging.getLogger(__name__)


class TracedModel:
    """A model's forward + loss as one fx graph with parameters and buffers as explicit inputs.

    * ``graph_module``: ``(*params, *buffers, input_ids, position_ids, targets) -> loss``;
    * ``param_names`` / ``buffer_names``: placeholder name -> FQN as in ``model.named_parameters()``
      (in placeholder order); ``tied``: alias FQN -> canonical FQN for shared parameters;
    * ``input_names``: the data inputs, in order; ``dynamic``: one graph for all shapes, or per shape
      (``static_reason``: then why, as the failed dynamic capture said).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        graph_module: fx.GraphModule,
        param_names: dict[str, str],
        buffer_names: dict[str, str],
        tied: dict[str, str],
        dynamic: bool,
        example_shape: tuple[int, int],
        static_reason: str = "",
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.param_names = param_names
        self.buffer_names = buffer_names
        self.tied = tied
        self.dynamic = dynamic
        self.input_names = INPUT_NAMES
        self.static_reason = static_reason
        self._graphs: dict[tuple[int, int] | None, fx.GraphModule] = {
            None if dynamic else example_shape: graph_module
        }
        self._example_shape = example_shape

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.graph_for(*self._example_shape)

    @property
    def example_shape(self) -> tuple[int, int]:
        """``[batch, seq]`` of the example inputs the model was traced with."""
        return self._example_shape

    def graph_for(self, batch: int, seq: int) -> fx.GraphModule:
        """The graph for inputs of shape ``[batch, seq]`` (traced on first use when shapes are static)."""
        key = None if self.dynamic else (batch, seq)
        graph = self._graphs.get(key)
        if graph is None:
            with CAPTURE_LOCK:  # two rank threads may meet a new shape at once: trace it once
                graph = self._graphs.get(key)
                if graph is None:
                    log.info("%s: tracing again for shape [%d, %d] (static shapes: one graph per shape)",
                             type(self.model).__name__, batch, seq)
                    inputs = _example_tensors({"input_ids": torch.zeros(batch, seq, dtype=torch.long)})
                    graph, *_ = _capture(LossModule(self.model, self.loss_fn), inputs, dynamic=False)
                    self._graphs[key] = graph
        return graph

    def params(self) -> dict[str, torch.Tensor]:
        """Canonical FQN -> the model's live parameter tensor."""
        named = dict(self.model.named_parameters())
        return {fqn: named[fqn] for fqn in self.param_names.values()}

    def buffers(self) -> dict[str, torch.Tensor]:
        named = dict(self.model.named_buffers(remove_duplicate=False))
        return {fqn: named[fqn] for fqn in self.buffer_names.values()}

    def layer_of(self, fqn: str) -> int | None:
        """Layer index in a name like ``layers.3.attn...`` or ``h.3.mlp...``; None outside layers."""
        return layer_index(self.tied.get(fqn, fqn))

    def flat_args(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The graph's positional arguments; ``params`` (FQN -> tensor) overrides the model's own."""
        position_ids, targets = _fill_inputs(input_ids, position_ids, targets)
        values = dict(self.params())
        if params is not None:
            values.update(params)
        return [values[f] for f in self.param_names.values()] + list(self.buffers().values()) + [
            input_ids, position_ids, targets
        ]

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the graph (under autograd) and return the summed loss."""
        gm = self.graph_for(*input_ids.shape)
        return gm(*self.flat_args(input_ids, position_ids, targets, params))

    def op_counts(self) -> Counter:
        return Counter(
            _op_name(n.target) for n in self.graph_module.graph.nodes if n.op == "call_function"
        )

    def __str__(self) -> str:
        counts = self.op_counts()
        ops = ", ".join(f"{name}×{count}" for name, count in sorted(counts.items()))
        tied = f", tied {self.tied}" if self.tied else ""
        return (
            f"TracedModel({type(self.model).__name__}: {len(self.param_names)} params, "
            f"{len(self.buffer_names)} buffers{tied}, inputs {', '.join(self.input_names)}, "
            f"{'dynamic' if self.dynamic else 'static'} shapes, {sum(counts.values())} ops)\n  ops: {ops}"
        )


def trace(
    model: nn.Module,
    example_inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    dynamic: bool = True,
    max_seq_len: int | None = None,
) -> TracedModel:
    """Capture ``loss_fn(model(input_ids, position_ids), targets)`` as a ``TracedModel``.

    ``example_inputs``: ``input_ids`` ``[b, s]`` alone, a tuple ``(input_ids[, position_ids[, targets]])``
    or a dict with those keys; missing position ids default to ``arange``, missing targets are made up
    (only shapes matter). ``loss_fn`` defaults to ``default_loss``. ``max_seq_len``: the longest
    sequence the graph must serve (default: the bound the model states, as export finds it).
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"trace needs a torch.nn.Module, got {type(model).__name__}")
    inputs = _example_tensors(_as_dict(example_inputs))
    refuse_unsupported_mixers(model)
    materialize_buffers(model)  # a meta model's construction-time buffers (rotary tables), by its own scheme
    wrapper = LossModule(model, loss_fn or default_loss)
    graph, param_names, buffer_names, tied, is_dynamic, static_reason = _capture(wrapper, inputs, dynamic, max_seq_len)
    shape = tuple(inputs[0].shape)
    return TracedModel(model, wrapper.loss_fn, graph, param_names, buffer_names, tied, is_dynamic, shape,
                       static_reason)


# ----------------------------------------------------------------------------- inputs
def _as_dict(example_inputs: Any) -> dict[str, torch.Tensor]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        unknown = set(example_inputs) - set(INPUT_NAMES)
        if unknown or "input_ids" not in example_inputs:
            raise InputError(
                f"example_inputs keys {sorted(example_inputs)}: need 'input_ids', may add 'position_ids' "
                "and 'targets'"
            )
        inputs = dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)) and 1 <= len(example_inputs) <= 3:
        inputs = dict(zip(INPUT_NAMES, example_inputs))
    else:
        raise InputError(
            "example_inputs must be input_ids, a tuple (input_ids[, position_ids[, targets]]) or a dict, "
            f"got {type(example_inputs).__name__}"
        )
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            kind = type(value).__name__
            raise InputError(f"example input '{name}' must be an int64 tensor [batch, seq], got {kind}")
        if value.dim() != 2 or value.dtype != torch.long:
            got = f"{value.dtype} {tuple(value.shape)}"
            raise InputError(f"example input '{name}' must be an int64 tensor [batch, seq], got {got}")
    return inputs


def _fill_inputs(
    input_ids: torch.Tensor, position_ids: torch.Tensor | None, targets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    if targets is None:
        targets = torch.roll(input_ids, -1, dims=1)
    return position_ids, targets


def _example_tensors(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Complete inputs to (input_ids, position_ids, targets), all the shape of ``input_ids``."""
    input_ids = inputs["input_ids"]
    position_ids, targets = _fill_inputs(input_ids, inputs.get("position_ids"), inputs.get("targets"))
    for name, value in (("position_ids", position_ids), ("targets", targets)):
        if value.shape != input_ids.shape:
            raise InputError(
                f"example {name} has shape {tuple(value.shape)}, input_ids {tuple(input_ids.shape)}; "
                "they must match"
            )
    # Fresh contiguous copies: a view's strides (``ids[:, :8]`` keeps the parent's row stride) are
    # not expressible in the symbolic sizes, and export would pin the example's shape into the graph.
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in (input_ids, position_ids, targets))


def _tracing_examples(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Inputs with batch and sequence of at least 2: export would specialise a size of 1 to a constant."""
    input_ids, position_ids, targets = inputs
    b, s = input_ids.shape
    if b >= 2 and s >= 2:
        return inputs
    reps = (2 if b < 2 else 1, 2 if s < 2 else 1)
    input_ids, targets = input_ids.repeat(*reps), targets.repeat(*reps)
    if s < 2:
        position_ids = torch.arange(2 * s).expand(input_ids.shape).contiguous()
    else:
        position_ids = position_ids.repeat(*reps)
    return input_ids, position_ids, targets


# ----------------------------------------------------------------------------- capture
def _capture(
    wrapper: LossModule, inputs: tuple[torch.Tensor, ...], dynamic: bool, max_seq_len: int | None = None
) -> tuple[fx.GraphModule, dict[str, str], dict[str, str], dict[str, str], bool, str]:
    """Export ``wrapper``; on a dynamic-shape failure fall back to static shapes. Meta parameters
    are traced as fake CPU tensors (``hgraph.frontend.meta.fake_parameters``): the graph is the eager model's.
    Returns the graph, parameter, buffer and tied names, whether shapes are dynamic, and why not
    (the failed dynamic capture's message; ``""`` when dynamic or when static shapes were asked for)."""
    with fake_parameters(wrapper.model):
        return _capture_model(wrapper, inputs, dynamic, max_seq_len)


def _capture_model(
    wrapper: LossModule, inputs: tuple[torch.Tensor, ...], dynamic: bool, max_seq_len: int | None = None
) -> tuple[fx.GraphModule, dict[str, str], dict[str, str], dict[str, str], bool, str]:
    reason = ""
    if dynamic:
        program, reason = _export_dynamic(wrapper, inputs, max_seq_len)
        dynamic = program is not None
        if not dynamic:
            log.warning("%s: traced with static shapes, one graph per [batch, seq] shape, because %s",
                        type(wrapper.model).__name__, reason)
    if not dynamic:
        program = _export(wrapper, inputs, None)
    graph, param_names, buffer_names, tied = lift_exported(wrapper.model, program)
    params = dict(wrapper.model.named_parameters())
    buffers = dict(wrapper.model.named_buffers(remove_duplicate=False))
    example_args = [params[f] for f in param_names.values()] + [buffers[f] for f in buffer_names.values()]
    canonicalize(graph, example_args + list(inputs))
    return graph, param_names, buffer_names, tied, dynamic, "" if dynamic else reason


def _export_dynamic(
    wrapper: LossModule, inputs: tuple[torch.Tensor, ...], max_seq_len: int | None
) -> tuple[torch.export.ExportedProgram | None, str]:
    """Export with dynamic batch and sequence, bounded where the model bounds its length: export's own
    suggested fix is taken while it only lowers ``seq``'s maximum (``hgraph.frontend.seq_bounds``; a
    bound at the limit itself, as MPT's ALiBi slice, takes a second round). Else (None, why)."""
    examples = _tracing_examples(inputs)
    spec: Any = sequence_spec(INPUT_NAMES, max_seq_len)
    guards = SizeGuards(wrapper.model)
    for _ in range(4):
        guards.guards.clear()
        try:
            with watching(guards):
                return _export(wrapper, examples, spec), ""
        except TraceError as exc:
            if not exc.shape_specialised:  # type: ignore[attr-defined]
                raise
            branch = guards.branch()
            if branch is not None:
                return None, f"it branches on the sequence length in Python: {branch}"
            refined = refined_spec(exc.__cause__, spec, examples[0].shape[1])
            if refined is None:  # not a bound after all: name the condition the user's code stated
                where = f": {guards.guards[0]}" if guards.guards else ""
                return None, f"it specialises on its input shape{where} ({exc})"
            seq = refined[INPUT_NAMES[0]][1]
            log.info("%s: exporting again with the sequence bound export suggests (seq <= %s)",
                     type(wrapper.model).__name__, getattr(seq, "max", seq))
            spec = refined
    return None, "export kept asking for a tighter sequence bound; give CompileOptions(max_seq_len=...)"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.export prints partial graphs and warnings on failure; our TraceError says what matters.
    (The shapes logger's records still reach handlers of its own: ``seq_bounds.SizeGuards``.)"""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    propagate = logger.propagate
    logger.propagate = False
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.propagate = propagate


def _export(
    wrapper: LossModule, inputs: tuple[torch.Tensor, ...], spec: Any
) -> torch.export.ExportedProgram:
    try:
        with _quiet(), hf_kernels(wrapper.model):
            return torch.export.export(wrapper, inputs, dynamic_shapes=spec)
    except Exception as exc:  # noqa: BLE001 - every export failure becomes a TraceError
        raise _trace_error(exc, wrapper) from exc


def _trace_error(exc: BaseException, wrapper: LossModule) -> TraceError:
    """A TraceError naming what failed, where in the user's code, and in which module."""
    model = wrapper.model
    text = str(exc).strip()
    first = text.splitlines()[0].split(" (unhinted")[0] if text else type(exc).__name__
    kind = type(exc).__name__
    if "data-dependent" in text:
        what = f"data-dependent control flow or value ({first})"
    elif "Constraints violated" in text or "specialized" in text or "specialize" in text:
        what = f"the model specialises on its input shape ({first})"
    else:
        what = f"{kind}: {first}"
    where = ""
    modules = {id(m): name for name, m in model.named_modules()}
    user_frames = [
        f for f, _ in traceback.walk_tb(exc.__traceback__)
        if not f.f_code.co_filename.startswith(_TORCH_DIR) and f.f_code.co_filename != __file__
    ]
    if user_frames:
        frame = user_frames[-1]
        info = inspect.getframeinfo(frame, context=1)
        code = info.code_context[0].strip() if info.code_context else ""
        owner = frame.f_locals.get("self")
        module = ""
        if isinstance(owner, nn.Module):
            name = modules.get(id(owner))
            label = f"module '{name or '<root>'}' " if name is not None else ""
            module = f" in {label}({type(owner).__name__})"
        where = f" at {info.filename}:{info.lineno}{module}: `{code}`"
    error = TraceError(f"cannot trace {type(model).__name__}: {what}{where}")
    error.shape_specialised = what.startswith("the model specialises")  # type: ignore[attr-defined]
    return error


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__module__", "") + "." + getattr(target, "__qualname__", str(target))
