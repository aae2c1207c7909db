"""The exported program rebuilt as hgraph's traced graph: ``(*params, *buffers, *inputs) -> loss``."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from hgraph.errors import TraceError


def lift_exported(
    model: nn.Module, program: torch.export.ExportedProgram
) -> tuple[fx.GraphModule, dict[str, str], dict[str, str], dict[str, str]]:
    """Rebuild the exported graph as ``(*params, *buffers, *inputs) -> loss`` with readable names.

    Placeholders are named after FQNs (``p_layers_0_attn_q_proj_weight``); tied parameters collapse
    onto the canonical name (the one ``model.named_parameters()`` reports); lifted tensor constants
    become attributes of the GraphModule.
    """
    canonical = {id(p): name for name, p in model.named_parameters()}
    all_params = dict(model.named_parameters(remove_duplicate=False))
    tied = {name: canonical[id(p)] for name, p in all_params.items() if canonical[id(p)] != name}
    for spec in program.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise TraceError(
                f"cannot trace {type(model).__name__}: it updates '{spec.target}' in place during forward "
                f"({spec.kind.name}); hgraph needs a pure forward"
            )

    old = program.graph_module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    param_names: dict[str, str] = {}
    buffer_names: dict[str, str] = {}
    by_fqn: dict[str, fx.Node] = {}
    constants: dict[str, torch.Tensor] = {}
    placeholders = [n for n in old.graph.nodes if n.op == "placeholder"]
    user_inputs, constant_inputs = [], []
    for node, spec in zip(placeholders, program.graph_signature.input_specs):
        target = spec.target.removeprefix("model.") if spec.target else None
        if spec.kind == InputKind.PARAMETER:
            fqn = tied.get(target, target)
            if fqn not in by_fqn:
                by_fqn[fqn] = graph.placeholder("p_" + fqn.replace(".", "_"))
                by_fqn[fqn].meta = dict(node.meta)
                param_names[by_fqn[fqn].name] = fqn
            env[node] = by_fqn[fqn]
        elif spec.kind == InputKind.BUFFER:
            env[node] = graph.placeholder("b_" + target.replace(".", "_"))
            env[node].meta = dict(node.meta)
            buffer_names[env[node].name] = target
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
        else:
            constant_inputs.append((node, spec))
    for node in user_inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node, spec in constant_inputs:
        attr = f"_const_{len(constants)}"
        constants[attr] = program.constants[spec.target]
        env[node] = graph.get_attr(attr)
        env[node].meta = dict(node.meta)
    for node in old.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            (result,) = node.args[0]
            graph.output(env[result])
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    for attr, value in constants.items():
        if value.is_meta:
            raise TraceError(
                f"cannot trace {type(model).__name__}: a tensor attribute (constant {attr}, {tuple(value.shape)}) is on the "
                "meta device and no scheme recomputes it; register it as a buffer that reset_parameters() recomputes"
            )
        old.register_buffer(attr, value)
    gm = fx.GraphModule(old, graph, class_name=type(model).__name__ + "Loss")
    return gm, param_names, buffer_names, tied
