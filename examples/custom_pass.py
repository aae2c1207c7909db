"""A custom resharding pass: split every tensor-parallel all-reduce into reduce-scatter + all-gather.

Same result, same bytes (a ring all-reduce *is* a reduce-scatter followed by an all-gather), but two
separate nodes that a scheduler can move apart, and a place to insert work on the scattered shard
(e.g. a sequence-parallel norm). The pass is a plain function ``(GraphModule, ctx) -> GraphModule``
placed after hgraph's built-in ``localize`` pass:

    python examples/custom_pass.py
"""

from __future__ import annotations

import torch
import torch.fx as fx

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.kernels.collectives import all_gather, all_reduce, reduce_scatter
from hgraph.passes.pipeline import Pass


def split_all_reduce(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Rewrite ``all_reduce(x, "tp")`` as ``all_gather(reduce_scatter(x, "tp", -1), "tp", -1)``."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not all_reduce or node.args[1] != "tp":
            continue
        info = dict(node.meta.get("hgraph_comm", {}))
        with gm.graph.inserting_after(node):
            scattered = gm.graph.call_function(reduce_scatter, (node.args[0], "tp", -1))
        with gm.graph.inserting_after(scattered):
            gathered = gm.graph.call_function(all_gather, (scattered, "tp", -1))
        node.replace_all_uses_with(gathered)
        gm.graph.erase_node(node)
        src, dst = info.get("src"), info.get("dst")
        middle = "R,S(-1)"  # the scattered shard: last dim cut over tp
        scattered.meta["hgraph_comm"] = {**info, "op": "reduce_scatter", "src": src, "dst": middle}
        gathered.meta["hgraph_comm"] = {**info, "op": "all_gather", "src": middle, "dst": dst}
    gm.graph.lint()
    gm.recompile()
    return gm


def main() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=2))
    ids = torch.randint(0, 256, (2, 16))
    plain = hgraph.compile(model, ["tp2 + 2x tp1"], example_inputs=ids)
    custom = hgraph.compile(
        model, ["tp2 + 2x tp1"], example_inputs=ids,
        options=hgraph.CompileOptions(passes=[Pass("split_all_reduce", split_all_reduce, after="localize")])
    )
    loss_a, grads_a = plain.simulate(0, ids)
    loss_b, grads_b = custom.simulate(0, ids)
    same = torch.allclose(loss_a, loss_b) and all(torch.allclose(grads_a[k], grads_b[k], atol=1e-6) for k in grads_a)
    print(custom.explain(0, 0))
    print("passes:", " -> ".join(r.name for r in custom.pass_history))
    print(f"same loss and gradients as without the pass: {same}")


if __name__ == "__main__":
    main()
