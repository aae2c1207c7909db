"""Experts pass: route each mixture-of-experts layer's tokens through dispatch and combine (``ep > 1``).

HuggingFace's experts (``grouped_mm_experts_forward``: Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...) trace
as: sort the ``(token, k)`` pairs by expert id, gather their token rows, count rows per expert
(``histc``) and cumulate them into offsets, run grouped matmuls over the expert weights ``[E, ...]``
(the *expert body*: gate/up projection, activation, down projection), weight the rows and sum each
token's ``k`` results. ``find_expert_blocks`` recognises that shape; ``route_experts`` rewrites it into
the token movement of ``hgraph.runtime.kernels.expert_dispatch``::

    rows, counts, order = permute_tokens(x, top_k_index, E)
    rows_e, offsets, layout = dispatch(rows, counts)          # to the ranks of their experts
    y = <expert body on rows_e, with offsets>                 # nodes kept as traced
    out = unpermute_tokens(combine(y, order, counts, layout), order, top_k_weights)

On one device the rewritten graph computes what the traced one does. The body's nodes are marked
``meta["hgraph_mesh"] = "expert"``: ``annotate`` gives them specs on the expert
mesh ``(ep, etp)`` instead of the stage mesh ``(cp, tp)`` (``hgraph.rules.base.ShardingOptions.experts``),
so the expert weights are cut along their expert dim on ep and tensor-parallel on etp. Routers stay
as traced (their ops are per token). An MoE layer in another shape raises ``StrategyError`` naming its
module and what differs, so ``ep`` never silently changes a model.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.fx as fx

from hgraph.errors import StrategyError
from hgraph.frontend.traced_layout import with_traced_layout
from hgraph.rules.mesh import EXPERT_MESH, MESH_KEY
from hgraph.rules.base import module_of
from hgraph.runtime.kernels.expert_dispatch import combine, dispatch, permute_tokens, unpermute_tokens

if TYPE_CHECKING:
    from hgraph.program.context import CompileContext

aten = torch.ops.aten
_GROUPED_MM = ("transformers::grouped_mm_fallback",)
_VIEWS = (aten.transpose.int, aten.t.default, aten.permute.default)
_CASTS = (aten.to.dtype, aten._to_copy.default)  # the precision pass casts weights to the compute dtype


@dataclass(frozen=True)
class ExpertsBlock:
    """One recognised MoE experts layer of a traced graph (see the module docstring)."""

    module: str  # where it is, for messages: " in MixtralForCausalLM module 'model.layers.0.mlp.experts' (...)"
    layer: str  # the MoE layer's module path (router and experts inside it): "model.layers.0.mlp"
    tokens: fx.Node  # x [N, h]
    top_k_index: fx.Node  # [N, k]
    top_k_weights: fx.Node  # [N, k]
    num_experts: int
    gathered: fx.Node  # x[order // k]: the body's rows
    offsets: fx.Node  # cumulative rows per expert, read by the grouped matmuls
    body: tuple[fx.Node, ...]  # the expert body, in graph order (parameter views included)
    result: fx.Node  # the body's output rows
    output: fx.Node  # the layer's [N, h] result
    weights: tuple[fx.Node, ...]  # the expert weight placeholders [E, ...]

    def __str__(self) -> str:
        names = ", ".join(w.name for w in self.weights)
        return f"ExpertsBlock({self.num_experts} experts, top-{_shape(self.top_k_index)[-1]}, weights {names}{self.module})"


def is_grouped_mm(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.name().split(".")[0] in _GROUPED_MM


def find_expert_blocks(gm: fx.GraphModule, params: Optional[set[str]] = None) -> list[ExpertsBlock]:
    """Every MoE experts layer of ``gm`` (``params``: names of the parameter placeholders; default
    those named ``p_*``). Raises ``StrategyError`` for grouped matmuls in a shape ``route_experts``
    cannot split by expert."""
    is_param = (lambda n: n.op == "placeholder" and n.name in params) if params is not None else (
        lambda n: n.op == "placeholder" and n.name.startswith("p_"))
    by_offsets: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_grouped_mm(node):
            by_offsets.setdefault(node.args[2], []).append(node)
    return [_block(offsets, mms, is_param) for offsets, mms in by_offsets.items()]


def _refuse(node: fx.Node, why: str) -> StrategyError:
    return StrategyError(
        f"ep > 1: the experts{module_of(node)} are not in a form hgraph can split by expert ({why}); "
        "hgraph splits HuggingFace's grouped-mm experts (sorted pairs, histc counts, grouped matmuls "
        "of [E, ...] weights); use ep=1 for this model"
    )


def _shape(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _only(nodes: list[fx.Node], what: str, near: fx.Node) -> fx.Node:
    if len(nodes) != 1:
        raise _refuse(near, f"expected one {what}, found {len(nodes)}")
    return nodes[0]


def _block(offsets: fx.Node, mms: list[fx.Node], is_param: Any) -> ExpertsBlock:
    near = mms[0]
    # offsets = cumsum(histc(sorted_ids.to(float), bins=E, ...)), sorted_ids, order = sort(top_k_index.reshape(-1))
    if offsets.target is not aten.cumsum.default or offsets.args[0].target is not aten.histc.default:
        raise _refuse(near, f"the group offsets {offsets.name} are not a cumsum of a histc of expert ids")
    histc = offsets.args[0]
    num_experts = histc.args[1] if len(histc.args) > 1 else histc.kwargs.get("bins", 100)
    sorted_ids = histc.args[0]
    while sorted_ids.op == "call_function" and sorted_ids.target in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout):
        sorted_ids = sorted_ids.args[0]
    if sorted_ids.target is not operator.getitem or sorted_ids.args[0].target is not aten.sort.default:
        raise _refuse(near, f"{histc.name} does not count the output of a sort of expert ids")
    sort = sorted_ids.args[0]
    flat_ids = sort.args[0]
    if flat_ids.target not in (aten.reshape.default, aten.view.default) or len(_shape(flat_ids)) != 1:
        raise _refuse(near, f"{sort.name} does not sort the flattened [tokens, k] expert ids")
    top_k_index = flat_ids.args[0]
    order = _only([u for u in sort.users if u.target is operator.getitem and u.args[1] == 1], "sort order", near)
    divisions = [u for u in order.users if u.target in (aten.floor_divide.default, aten.div.Tensor_mode)]
    divide = _only(divisions, "token index (order // k)", near)
    gathered = _only([u for u in divide.users if u.target is aten.index.Tensor], "gather of token rows", near)
    tokens = gathered.args[0]
    picks = [u for u in order.users if u.target is aten.index.Tensor and u.args[0].target in (aten.reshape.default, aten.view.default)]
    top_k_weights = _only(picks, "gather of routing weights", near).args[0].args[0]
    k = _shape(top_k_index)[-1]
    if (len(_shape(top_k_index)) != 2 or _shape(top_k_weights) != _shape(top_k_index) or len(_shape(tokens)) != 2
            or str(_shape(tokens)[0]) != str(_shape(top_k_index)[0]) or divide.args[1] != k):
        raise _refuse(near, f"the router's choices {top_k_index.name} {_shape(top_k_index)} are not [tokens, k] "
                            f"for the tokens {tokens.name} {_shape(tokens)}")
    body = _body(gathered, offsets, is_param)
    if any(mm not in body for mm in mms):
        outside = [mm.name for mm in mms if mm not in body]
        raise _refuse(near, f"grouped matmul {', '.join(outside)} also reads values gathered outside the experts "
                            "(per-expert biases or inputs)")
    leaving = [n for n in body if any(u not in body for u in n.users)]
    result = _only(leaving, "result of the expert body", near)
    output = _output(result, tokens, near)
    weights = tuple(dict.fromkeys(a for n in body for a in n.all_input_nodes if is_param(a)))
    for w in weights:
        if not _shape(w) or _shape(w)[0] != num_experts:
            raise _refuse(near, f"weight {w.name} {_shape(w)} does not hold one slice per expert ({num_experts})")
    ordered = tuple(n for n in gathered.graph.nodes if n in body)
    return ExpertsBlock(module_of(near), _layer_path(near), tokens, top_k_index, top_k_weights, int(num_experts),
                        gathered, offsets, ordered, result, output, weights)


def _layer_path(node: fx.Node) -> str:
    """Module path of the MoE layer around the experts (the module above them), as errors name it."""
    stack = [path for path, kind in (node.meta.get("nn_module_stack") or {}).values() if not kind.endswith("loss_module.LossModule")]
    stack = [path.removeprefix("model").lstrip(".") for path in stack]  # the frontend wraps the user's model as 'model'
    return stack[-2] if len(stack) > 1 else (stack[-1] if stack else "")


def _body(gathered: fx.Node, offsets: fx.Node, is_param: Any) -> set[fx.Node]:
    """Nodes computed from the gathered rows, the offsets and parameters alone (and the parameter
    views and casts they read)."""

    def of_param(a: fx.Node) -> bool:  # a parameter, or a view or dtype cast of one
        return is_param(a) or (a.op == "call_function" and a.target in _VIEWS + _CASTS
                               and bool(a.all_input_nodes) and of_param(a.all_input_nodes[0]))

    body: set[fx.Node] = set()
    for node in gathered.graph.nodes:
        if node.op != "call_function" or node is gathered or of_param(node):
            continue  # parameter views and casts: part of the body when a body node reads them (below)
        inputs = node.all_input_nodes
        allowed = lambda a: a is gathered or a is offsets or a in body or of_param(a)  # noqa: E731
        if any(a is gathered or a in body for a in inputs) and all(allowed(a) for a in inputs):
            body.add(node)
    views: set[fx.Node] = set()
    frontier = [a for n in body for a in n.all_input_nodes if a.op == "call_function" and of_param(a)]
    while frontier:
        a = frontier.pop()
        if a not in views:
            views.add(a)
            frontier += [b for b in a.all_input_nodes if b.op == "call_function"]
    return body | views


def _output(result: fx.Node, tokens: fx.Node, near: fx.Node) -> fx.Node:
    """The layer's [N, h] result: the first node after ``result`` shaped like the tokens (the sum of
    each token's k weighted rows), reached through one chain of uses."""
    node = result
    for _ in range(8):
        users = list(node.users)
        if len(users) != 1:
            break
        node = users[0]
        if str(_shape(node)) == str(_shape(tokens)) and node.target is aten.sum.dim_IntList:
            return node
    raise _refuse(near, f"the rows of {result.name} are not weighted and summed back into the tokens' shape")


def route_experts(gm: fx.GraphModule, ctx: "CompileContext") -> fx.GraphModule:
    """Rewrite every experts block of ``gm`` (see the module docstring); ``gm`` unchanged when
    ``ctx.ep == 1``. Raises ``StrategyError`` when ``ep > 1`` and the model has no experts block."""
    if getattr(ctx, "ep", 1) == 1:
        return gm
    params = set(getattr(getattr(ctx, "traced", None), "param_names", {}) or ()) or None
    blocks = find_expert_blocks(gm, params)
    if not blocks:
        raise StrategyError(
            f"ep={ctx.ep}: the model has no mixture-of-experts layer hgraph recognises (grouped-mm experts of "
            "[E, ...] weights); use ep=1"
        )
    for block in blocks:
        _rewrite(gm.graph, block)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _rewrite(graph: fx.Graph, block: ExpertsBlock) -> None:
    fake = block.tokens.meta["val"].fake_mode

    def add(target: Any, args: tuple, like: fx.Node, expert: bool = False) -> fx.Node:
        node = graph.call_function(target, args)
        node.meta["nn_module_stack"] = dict(like.meta.get("nn_module_stack") or {})
        node.meta["stack_trace"] = like.meta.get("stack_trace")
        with fake:
            node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
        if expert:
            node.meta[MESH_KEY] = EXPERT_MESH
        return node

    def item(source: fx.Node, index: int) -> fx.Node:
        node = graph.call_function(operator.getitem, (source, index))
        node.meta.update({k: v for k, v in source.meta.items() if k in ("nn_module_stack", "stack_trace")})
        node.meta["val"] = source.meta["val"][index]
        if source.meta.get(MESH_KEY):
            node.meta[MESH_KEY] = source.meta[MESH_KEY]
        return node

    with graph.inserting_before(block.gathered):
        permuted = add(permute_tokens, (block.tokens, block.top_k_index, block.num_experts), block.gathered)
        rows, counts, order = (item(permuted, i) for i in range(3))
        dispatched = add(dispatch, (rows, counts), block.gathered)
        rows_e, offsets, layout = (item(dispatched, i) for i in range(3))
    for node in block.body:
        node.args = fx.node.map_arg(node.args, lambda a: rows_e if a is block.gathered else offsets if a is block.offsets else a)
        node.kwargs = fx.node.map_arg(node.kwargs, lambda a: rows_e if a is block.gathered else offsets if a is block.offsets else a)
        node.meta[MESH_KEY] = EXPERT_MESH
    with graph.inserting_after(block.result):
        combined = add(combine, (block.result, order, counts, layout), block.result)
    with graph.inserting_after(combined):
        out = add(unpermute_tokens, (combined, order, block.top_k_weights), block.output)
    out.meta["val"] = block.output.meta["val"]
    block.output.replace_all_uses_with(with_traced_layout(graph, out, block.output.meta["val"]))


__all__ = ["ExpertsBlock", "find_expert_blocks", "is_grouped_mm", "route_experts"]
