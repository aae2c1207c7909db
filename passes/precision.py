"""Mixed-precision pass: under a reduced ``compute_dtype`` the loss is computed in fp32.

Parameters are pulled in the compute dtype (bf16), so logits come out in bf16; the pass casts the
logits input of every cross-entropy node of the stage program (``aten.cross_entropy_loss`` and
``hgraph.runtime.kernels.vocab_parallel.vocab_parallel_cross_entropy``) to fp32, so the log-softmax, its reductions
(also the vocab-parallel max/sum all-reduces) and the returned loss are fp32; the cast's backward
hands bf16 gradients to the head again. A last stage without such a node gets its loss output cast.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from hgraph.program.products import CompileContext
from hgraph.runtime.kernels.vocab_parallel import vocab_parallel_cross_entropy


def _is_cross_entropy(node: fx.Node) -> bool:
    return node.op == "call_function" and (
        node.target is vocab_parallel_cross_entropy or node.target is torch.ops.aten.cross_entropy_loss.default
    )


def _upcast(gm: fx.GraphModule, value: fx.Node, before: fx.Node) -> fx.Node:
    with gm.graph.inserting_before(before):
        cast = gm.graph.call_function(torch.ops.aten.to.dtype, (value, torch.float32))
    val = value.meta.get("val")
    cast.meta = {k: v for k, v in value.meta.items() if k != "val"}
    if isinstance(val, torch.Tensor):
        cast.meta["val"] = val.to(torch.float32)
    return cast


def fp32_loss(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Cast the inputs of the loss (or the loss itself) to fp32 when ``compute_dtype`` is reduced;
    ``gm`` is a last stage (its first output is the loss)."""
    dtype = ctx.options.compute_dtype
    if dtype is None or dtype == torch.float32:
        return gm
    losses = [n for n in gm.graph.nodes if _is_cross_entropy(n)]
    for node in losses:  # the logits are the first argument
        node.args = (_upcast(gm, node.args[0], node), *node.args[1:])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    if not losses and outs:
        output.args = ((_upcast(gm, outs[0], output), *outs[1:]),)
    gm.graph.lint()
    gm.recompile()
    return gm
