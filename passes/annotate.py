"""Annotate pass: give every value of the global graph its shard spec on the stage mesh ``(cp, tp)``.

Specs propagate forward in graph order. Data inputs start token-split on cp (``Shard(seq_dim)``) and
replicated on tp; a parameter's placement is chosen by its first consumer's rule (a linear fed by a
replicated activation takes its weight column-cut, one fed by a feature-cut activation row-cut — the
Megatron pairing falls out of propagation). Each rule's ``Decision`` is kept for ``localize``.

Recorded in ``node.meta``:

* ``hgraph_spec`` — the value's spec (tuple of specs for list outputs, ``None`` for non-tensors);
* ``hgraph_decision`` — the rule's decision (required input specs, lowering);
* ``hgraph_grad_reduce`` — on a consumer, ``{input: mesh dims}`` where that use produces a partial
  gradient that must be summed inside the program (``grad_all_reduce``, or a gather whose backward
  reduce-scatters) because its producer needs an exact gradient;
* on parameter placeholders: ``hgraph_param_spec`` (compute placement) and ``hgraph_grad_spec``
  (placement of the gradient autograd leaves: ``Partial`` on a mesh dim where every use computes on
  sharded tokens/features with the replicated weight, e.g. every weight on cp, norm weights under
  sequence parallelism; the Push Gradient pass reduces it); for expert weights under expert
  parallelism also ``hgraph_param_mesh``, the expert mesh ``(ep, etp)`` both specs are on.

Nodes marked ``meta["hgraph_mesh"] == "expert"`` (``hgraph.passes.experts``) are decided on the
expert mesh (``ShardingOptions.experts``), every other node on the stage mesh.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from hgraph.errors import ShardingRuleError
from hgraph.core.placement import Partial, Replicate, Shard
from hgraph.rules.base import CP, Decision, local_shape, REPLICATED, RuleInput, scalar_decision, Spec, spec_str
from hgraph.rules.mesh import EXPERT_MESH, MESH_DIMS, MESH_KEY, ShardingOptions
from hgraph.rules.registry import lookup

if TYPE_CHECKING:
    from hgraph.program.context import CompileContext


def annotate(gm: fx.GraphModule, ctx: "CompileContext") -> fx.GraphModule:
    """Annotate ``gm`` in place (see the module docstring) and return it."""
    options = ShardingOptions.from_context(ctx)
    specs: dict[fx.Node, Any] = {}
    free: set[fx.Node] = set()
    stage_rin = RuleInput(options, specs, free)
    expert_rin = RuleInput(options.experts(), specs, free) if options.ep > 1 else stage_rin
    params: list[fx.Node] = []
    views: dict[fx.Node, fx.Node] = {}  # free transposes of free parameters -> the parameter
    for node in gm.graph.nodes:
        rin = expert_rin if node.meta.get(MESH_KEY) == EXPERT_MESH else stage_rin
        rin.node = node
        if node.op == "placeholder":
            if options.is_param(node):
                params.append(node)
                free.add(node)
            else:
                specs[node] = _input_spec(node, rin)
        elif node.op == "get_attr":
            specs[node] = REPLICATED if rin.is_tensor(node) else None
        elif node.op == "call_function":
            if node.target in _PARAM_VIEWS and node.args[0] in free:
                free.add(node)  # a transposed or cast parameter: placed by its consumer, like the parameter
                views[node] = node.args[0]
                continue
            decision = _decide(node, rin)
            for inp, req in decision.inputs.items():
                if inp in free:
                    if any(isinstance(p, Partial) for p in req):
                        raise rin.error(f"rule asks for parameter {inp.name} as Partial {spec_str(req)}")
                    free.discard(inp)
                    specs[inp] = req
                    if inp in views:
                        _place_view(inp, views.pop(inp), req, rin, free, specs, views)
                        rin.node = node
            specs[node] = decision.output
            node.meta["hgraph_decision"] = decision
        elif node.op == "output":
            outputs = node.all_input_nodes
            node.meta["hgraph_decision"] = Decision(
                output=None, inputs={n: REPLICATED for n in outputs if rin.is_tensor(n)}
            )
            specs[node] = None
        else:
            raise ShardingRuleError(
                f"node '{node.name}' is a {node.op} ({node.target}); annotate needs a flat ATen graph from "
                "hgraph.frontend.trace (call_module/call_method nodes have no sharding rules)"
            )
    while views:  # newest first: a cast of a transpose places the transpose with it
        view, param = views.popitem()
        free.discard(view)
        _place_view(view, param, REPLICATED, expert_rin if view.meta.get(MESH_KEY) == EXPERT_MESH else stage_rin, free, specs,
                    views)
    for p in free:
        specs[p] = REPLICATED
    for node in gm.graph.nodes:
        node.meta["hgraph_spec"] = specs.get(node)
    _gradient_placements(gm, options, params, stage_rin, expert_rin)
    return gm


_PARAM_VIEWS = (torch.ops.aten.transpose.int, torch.ops.aten.t.default, torch.ops.aten.permute.default,
                torch.ops.aten.to.dtype)  # the precision pass's fp32 upcast of a bf16-pulled parameter


def _place_view(view: fx.Node, param: fx.Node, req: Spec, rin: RuleInput, free: set, specs: dict,
                views: dict) -> None:
    """A transposed (or cast) parameter placed as ``req`` by its consumer: the parameter takes the
    placement that the transpose maps to ``req`` (when still free), then the view is decided as usual.
    ``param`` may itself be a view (the compute-dtype cast of a transposed weight): placed the same way."""
    if param in free:
        ndim = rin.ndim(param)
        if view.target is torch.ops.aten.to.dtype:
            source = list(range(ndim))
        elif view.target is torch.ops.aten.permute.default:
            source = [d % ndim for d in view.args[1]]
        else:
            a, b = (0, 1) if view.target is torch.ops.aten.t.default else (view.args[1] % ndim, view.args[2] % ndim)
            source = list(range(ndim))
            source[a], source[b] = b, a
        placed = tuple(replace(p, dim=source[p.dim % ndim]) if isinstance(p, Shard) else p for p in req)
        free.discard(param)
        specs[param] = placed
        if param in views:
            _place_view(param, views.pop(param), placed, rin, free, specs, views)
    rin.node = view
    decision = _decide(view, rin)
    specs[view] = decision.output
    view.meta["hgraph_decision"] = decision


def _input_spec(node: fx.Node, rin: RuleInput) -> Spec | None:
    """Data inputs ``[batch, seq, ...]`` are token-split on cp and replicated on tp; buffers replicated."""
    if not rin.is_tensor(node):
        return None
    if rin.options.is_buffer(node):
        return REPLICATED
    seq = rin.options.seq_dim
    if rin.degree(CP) > 1 and rin.ndim(node) > seq:
        return (Shard(seq), Replicate())
    return REPLICATED


def _decide(node: fx.Node, rin: RuleInput) -> Decision:
    rule = lookup(node.target)
    if rule is None:
        if not rin.tensor_inputs(node) and not rin.is_tensor(node):
            return Decision(output=None)  # arithmetic on sizes
        raise rin.error(
            "no sharding rule for this op; register one with hgraph.rules.register(op, rule) "
            "(hgraph never replicates an unknown op silently)"
        )
    rin.interleave_aware = bool(getattr(rule, "interleave_aware", False))
    decision = scalar_decision(node, rin) or rule(node, rin)
    if not isinstance(decision, Decision):
        raise rin.error(f"rule {getattr(rule, '__name__', rule)} returned {type(decision).__name__}, not a Decision")
    for inp, req in decision.inputs.items():
        _check_spec(rin, inp, req)
    return decision


def _check_spec(rin: RuleInput, node: fx.Node, spec: Spec) -> None:
    if not (isinstance(spec, tuple) and len(spec) == len(MESH_DIMS)):
        raise rin.error(f"required spec {spec!r} of {node.name} is not one placement per mesh dim {MESH_DIMS}")
    for m, p in enumerate(spec):
        if rin.degree(m) == 1 and not isinstance(p, Replicate):
            raise rin.error(f"spec {spec_str(spec)} of {node.name} places mesh dim '{rin.options.mesh_names[m]}' of size 1")
        if isinstance(p, Shard) and not -rin.ndim(node) <= p.dim < rin.ndim(node):
            raise rin.error(f"spec {spec_str(spec)} shards dim {p.dim} of {node.name}, which has {rin.ndim(node)} dims")


def _has_floating_value(val: Any) -> bool:
    """A floating tensor, or a list/tuple holding one (``split``/``chunk`` outputs: their
    ``getitem`` users carry the gradient on)."""
    if isinstance(val, (list, tuple)):
        return any(_has_floating_value(v) for v in val)
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)


def _requires_grad(gm: fx.GraphModule, options: ShardingOptions) -> set[fx.Node]:
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        floating = _has_floating_value(node.meta.get("val"))
        if node.op == "placeholder":
            if options.is_param(node):
                out.add(node)
        elif floating and any(n in out for n in node.all_input_nodes):
            out.add(node)
    return out


def _partial_uses(node: fx.Node, decision: Decision, grad: set[fx.Node]) -> dict[fx.Node, set[int]]:
    """Inputs that ``node`` needs replicated on a mesh dim where it computes sharded: their
    gradient through this use is partial on that mesh dim."""
    out_specs = decision.output if isinstance(decision.output, tuple) and decision.output and isinstance(decision.output[0], tuple) else (decision.output,)
    result: dict[fx.Node, set[int]] = {}
    for inp, req in decision.inputs.items():
        if inp not in grad:
            continue
        for m, p in enumerate(req):
            if not isinstance(p, Replicate) or m in decision.exact_grad.get(inp, ()):
                continue
            others = [r[m] for i, r in decision.inputs.items() if i is not inp]
            others += [s[m] for s in out_specs if s is not None]
            if any(not isinstance(q, Replicate) for q in others):
                result.setdefault(inp, set()).add(m)
    return result


def _gradient_placements(
    gm: fx.GraphModule, options: ShardingOptions, params: list[fx.Node], stage_rin: RuleInput, expert_rin: RuleInput
) -> None:
    grad = _requires_grad(gm, options)
    partial: dict[fx.Node, dict[fx.Node, set[int]]] = {}
    for node in gm.graph.nodes:
        decision = node.meta.get("hgraph_decision")
        if node.op == "call_function" and decision is not None:
            partial[node] = _partial_uses(node, decision, grad)
            node.meta["hgraph_grad_reduce"] = {
                inp: dims for inp, dims in partial[node].items() if not options.is_param(inp)
            }
    for p in params:
        spec = p.meta["hgraph_spec"]
        uses = [u for u in p.users if p in getattr(u.meta.get("hgraph_decision"), "inputs", {})]
        rin = expert_rin if uses and all(u.meta.get(MESH_KEY) == EXPERT_MESH for u in uses) else stage_rin
        degrees = rin.options.degrees
        grad_spec = list(spec)
        for m, placement in enumerate(spec):
            partial_uses = [u for u in uses if m in partial.get(u, {}).get(p, set())]
            if degrees[m] == 1 or not partial_uses:
                continue
            if isinstance(placement, Replicate) and len(partial_uses) == len(uses):
                grad_spec[m] = Partial()
            else:  # mixed or sharded: sum the partial uses inside the program so the gradient is exact
                for u in partial_uses:
                    u.meta["hgraph_grad_reduce"].setdefault(p, set()).add(m)
        p.meta["hgraph_param_spec"] = spec
        p.meta["hgraph_grad_spec"] = (grad_spec[0], grad_spec[1])
        p.meta["hgraph_local_shape"] = local_shape(rin.shape(p), spec, degrees)
        if rin.options.expert_parallel:  # an expert weight: its specs are on the expert mesh
            p.meta["hgraph_param_mesh"] = degrees
            p.meta[MESH_KEY] = EXPERT_MESH


__all__ = ["annotate"]
